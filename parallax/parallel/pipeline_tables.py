"""1F1B's vocabulary tables (pipeline_1f1b): the embedding, head and final-norm parameters as
they enter the table schedules' tick loop, and their gradients as they leave it.

Every stage holds the tables; only stage 0 embeds and only the last stage runs the head, so each
table's gradient is summed over `pipe` as well as over the batch axes once per step, after the
tick loop. The order (reduce_table): a reduce-scatter over `data` first, then the sum over
`expert` and `pipe` on the 1/data shard; under ZeRO that shard is the update's, without ZeRO it
is gathered back once (to_update).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from parallax.model.logical import drop_axes, entry_axes, keep_axes, spec_axes
from parallax.model.transformer import Transformer
from parallax.model.vocab import sum_shards
from parallax.parallel.mesh import DATA, PIPE
from parallax.parallel.pipeline import manual_over
from parallax.parallel.sharding import BATCH_AXES


def as_masters(tree: Any) -> Any:
    """The tables as float32 masters again (carried_tables): the VJPs differentiate these, inside
    each use, where XLA folds the round trip into the use's own cast."""
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def scatter_dim(update_spec: P | None) -> int | None:
    """The dimension of a vocabulary table the update shards over `data` (ZeRO-1 and 3: `embed`),
    which reduce_table scatters its gradient on; None: the update wants it whole (no ZeRO; the
    final norm's scale)."""
    dims = [d for d, e in enumerate(update_spec or ()) if DATA in entry_axes(e)]
    return dims[0] if dims else None


def table_dim(update_spec: P | None, shape: tuple[int, ...], data: int) -> int | None:
    """The dimension reduce_table scatters a vocabulary table's gradient on over `data`: the one
    ZeRO's update shards (scatter_dim); without ZeRO the first dimension nothing shards that
    `data` divides (to_update gathers the shard back for the update). None: the final
    norm's scale, no data parallelism, or no such dimension."""
    dim = scatter_dim(update_spec)
    if dim is not None or len(shape) < 2 or data < 2:
        return dim
    spec = tuple(update_spec or ()) + (None,) * len(shape)
    return next((i for i, n in enumerate(shape) if not entry_axes(spec[i]) and n % data == 0), None)


def reduce_table(g: jax.Array, update_spec: P | None, manual: set[str], data: int) -> jax.Array:
    """A table's gradient, after the tick loop, to what its update reads. Only stage 0's embedding
    and the last stage's head gradient are non-zero, and every stage holds the tables, so each is
    summed over `pipe` as well as over the batch axes. The gradient is reduce-scattered over `data`
    first and summed over `pipe` on its 1/data shard (table_dim): the psum of the whole table over
    `pipe` was 2 GiB of a 1B model's 2.3 GiB of pipe traffic per step (Llama-3.2-1B shape, data 4 x
    pipe 4; BUILD_NOTES.md). Under ZeRO the shard is what the update reads; without ZeRO to_update
    gathers it back once (the reduce-scatter and that gather move what an all-reduce over `data`
    moves). Without a dimension to scatter (the final norm's scale) the gradient is summed
    over `pipe` here and left one per batch shard [1, ...] for the sum over the batch axes outside."""
    dim = table_dim(update_spec, g.shape, data)
    if dim is None:
        return jax.lax.psum(g, PIPE)[None]
    rest = tuple(a for a in BATCH_AXES if a != DATA and a in manual)  # experts: the tables are replicated over them

    def reduce(g: jax.Array) -> jax.Array:
        g = jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)
        return jax.lax.psum(jax.lax.psum(g, rest) if rest else g, PIPE)

    # `tensor` manual too (pipeline.manual_over): each device scatters its own vocabulary shard
    return manual_over(reduce, drop_axes(update_spec, manual))(g)


def carried_tables(model: Transformer, outer: Any, outer_specs: Any, manual: set[str]) -> Any:
    """The embedding, head and final-norm parameters as they enter the tick loop's shard_map: a
    table stored sharded over a manual axis (ZeRO-3 over `data`) is gathered there, so it is cast
    to the compute dtype on its shard first and the gather moves half the bytes, as unpipelined
    ZeRO-3's (logical.ParamPlacement.to_compute). Every use casts the table to the compute dtype
    anyway, so reading it back as float32 inside the use (`as_masters`) changes no value and no
    gradient. Left float32: the final norm's scale (used in float32) and a table an FP8 head
    quantises (it scales the master's own values)."""
    fp8_head = "embed" if model.cfg.tie_embeddings else "logits"
    skip = (fp8_head,) if model.logits_dot_general is not None else ()

    if outer_specs is None:
        return outer

    def one(path: tuple, a: jax.Array, spec: P) -> jax.Array:
        gathered = a.ndim > 1 and path[0].key not in skip and spec_axes(spec) & (manual - {PIPE})
        return a.astype(model.cfg.dtype) if gathered else a

    return jax.tree_util.tree_map_with_path(one, outer, outer_specs, is_leaf=lambda x: isinstance(x, P))


def table_out_spec(spec: P | None, g: Any, data: int) -> P:
    """How a table's gradient leaves the tick loop's shard_map (reduce_table): a 1/data shard
    (ZeRO's dimension, or table_dim's), or one per batch shard [1, ...] (the final norm's scale)."""
    dim = table_dim(spec, g.shape, data)
    if dim is None:
        return P(BATCH_AXES)
    if scatter_dim(spec) is not None:
        return keep_axes(spec, {DATA})
    return P(*(DATA if i == dim else None for i in range(g.ndim)))


def to_update(g: jax.Array, out: P, spec: P | None, mesh: jax.sharding.Mesh) -> jax.Array:
    """A table's gradient as it left the shard_map (`out`: table_out_spec) to what its update
    reads (`spec`)."""
    if out == P(BATCH_AXES):  # [batch shards, ...] -> [...]
        return sum_shards(g, g.dtype)
    if spec is None or scatter_dim(spec) is not None:  # ZeRO: the shard is the update's
        return g
    # without ZeRO the 1/data shard gathered once here: left to its consumers, the partitioner
    # gathered it once per use (the optimizer's, the norm's: 3 on XLA:CPU)
    return jax.lax.with_sharding_constraint(g, jax.sharding.NamedSharding(mesh, spec))
