"""The `expert` axis: MoE slots moved to the devices that hold their experts and back.

Experts are sharded over `expert` (their hidden dimension over `tensor`); outside MoE layers the
batch is sharded over ('data', 'expert'), so `expert` is more data parallelism there. Routing,
dispatch into [G, E, C, D] slots and the combine are per sequence and need no communication;
between them the slots change owner: before the exchange a device holds all E experts' slots of
its own sequences, after it the slots of its E/ep experts from the ep devices of its `expert`
group. That is one `all_to_all` over `expert` each way, in a `shard_map` that is manual over the
batch axes (the partitioner, left to itself, was seen all-gathering instead: ANCHORS.md).

The exchange is the identity when `expert` has size 1. Inside a `shard_map` that is already
manual over `expert` (a pipeline stage), the collective runs directly on the local block.

The ragged (dropless) path moves sorted tokens instead of slots: each device sorts its tokens'
assignments by expert (hence by owning device), the per-expert counts go round first in one
`all_to_all`, then `jax.lax.ragged_all_to_all` sends each device's contiguous run to the owner,
which regroups what it received by local expert for `ragged_dot`, and a second
`ragged_all_to_all` sends the results back to where they came from. XLA:CPU cannot run
ragged_all_to_all (jax #34755): make_layout refuses this path on CPU meshes with expert > 1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from parallax.model.logical import vary, varying_axes
from parallax.parallel.mesh import DATA, EXPERT
from parallax.model.moe import LOCAL, Exchange, Grouped, RaggedLayer, inverse_permutation
from parallax.parallel.sharding import BATCH_AXES

# [G, E, C, D]: before, sequences over the batch axes; after, sequences over data, experts over expert.
_TOKEN_MAJOR = P(BATCH_AXES)
_EXPERT_MAJOR = P(DATA, EXPERT)


def _to_experts_local(x: jax.Array) -> jax.Array:
    # [g, E, C, D] -> [g * ep, E / ep, C, D]: split experts, gather the group's sequences
    return jax.lax.all_to_all(x, EXPERT, split_axis=1, concat_axis=0, tiled=True)


def _from_experts_local(x: jax.Array) -> jax.Array:
    # [g * ep, E / ep, C, D] -> [g, E, C, D]: the inverse
    return jax.lax.all_to_all(x, EXPERT, split_axis=0, concat_axis=1, tiled=True)


def _exchange(local, in_spec: P, out_spec: P):
    def move(x: jax.Array) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or EXPERT not in mesh.axis_names or mesh.shape[EXPERT] == 1:
            return x
        if EXPERT in mesh.manual_axes:  # already inside a shard_map over expert (pipeline stage)
            return local(x)
        return jax.shard_map(local, mesh=mesh, in_specs=in_spec, out_specs=out_spec, axis_names=set(BATCH_AXES))(x)

    return move


def _experts_here(num_experts: int) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and EXPERT in mesh.manual_axes:
        return num_experts // mesh.shape[EXPERT]
    return num_experts


# The collective, looked up at trace time so that a test can stand in a CPU emulation of it.
ragged_all_to_all = jax.lax.ragged_all_to_all


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def through_experts(ffn: Grouped) -> Grouped:
    """Lift `ffn`, a grouped FFN over the E/ep experts held here, to one over this device's tokens
    sorted by global expert with global group sizes [E]. Runs inside a shard_map manual over
    `expert`. Expert j*E/ep + l lives on device j as its local expert l."""

    def moved(tokens: jax.Array, sizes: jax.Array, wi: jax.Array, wo: jax.Array) -> jax.Array:
        n, d = tokens.shape
        ep = jax.lax.axis_size(EXPERT)
        e_here = sizes.shape[0] // ep
        counts = sizes.reshape(ep, e_here)  # [ep, E/ep]: my tokens per expert, rows by owner
        send_sizes = jnp.sum(counts, axis=1)  # [ep] to each owner
        input_offsets = _exclusive_cumsum(send_sizes)  # sorted by expert, so by owner too
        # Row i: what device i sends me, per local expert; my receive buffer holds the sources
        # back to back (device 0's run first), each run sorted by local expert.
        recv_counts = jax.lax.all_to_all(counts, EXPERT, 0, 0, tiled=True)  # [ep, E/ep]
        recv_sizes = jnp.sum(recv_counts, axis=1)  # [ep] from each device
        recv_offsets = _exclusive_cumsum(recv_sizes)
        # ragged_all_to_all wants, per destination, where my run lands *there*: device j's
        # recv_offsets[me], fetched with an all_to_all (the docstring's convention).
        output_offsets = jax.lax.all_to_all(recv_offsets, EXPERT, 0, 0, tiled=True)
        # Static buffer, the dropless worst case: every device sends all N of its rows to me.
        rows = ep * n
        # The output buffers are typed as varying like the tokens: ragged_all_to_all returns its
        # `output` operand's type, and the result differs per device.
        buffer = vary(jnp.zeros((rows, d), tokens.dtype), sorted(varying_axes(tokens)))
        received = ragged_all_to_all(tokens, buffer, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=EXPERT)
        # Regroup by local expert: row r lies in (source, expert) block `block`; padding rows
        # (past the last block) get the sentinel E/ep and sort last, outside every group.
        # block[r] = how many blocks end at or before r: a count of block ends, then a running sum
        # (jnp.searchsorted trips over mixed varying types inside shard_map in jax 0.10.2).
        ends = jnp.cumsum(recv_counts.reshape(-1))  # [ep * E/ep], each <= rows
        block = jnp.cumsum(jnp.zeros((rows + 1,), jnp.int32).at[ends].add(1))[:rows]
        local = jnp.where(block < ep * e_here, block % e_here, e_here)
        order = jnp.argsort(local, stable=True)
        out = ffn(received[order], jnp.sum(recv_counts, axis=0), wi, wo)
        out = out[inverse_permutation(order)]  # [ep*N, D] as received
        # Back: my run for source i starts at recv_offsets[i] and lands at its input_offsets[me].
        back_offsets = jax.lax.all_to_all(input_offsets, EXPERT, 0, 0, tiled=True)
        return ragged_all_to_all(out, vary(jnp.zeros((n, d), out.dtype), sorted(varying_axes(out))),
                                 recv_offsets, recv_sizes, back_offsets, send_sizes, axis_name=EXPERT)

    return moved


def _identity(ffn: Grouped) -> Grouped:
    return ffn


def make_ragged(exchange_at_one: bool = False):
    """The Exchange.ragged hook: the ragged layer's local math in a shard_map manual over the batch
    axes (so that each device sorts only its own tokens, with no global sort), or directly when
    already manual over them (a pipeline stage). Tokens move only when `expert` > 1
    (`exchange_at_one`: also at size 1, to exercise the collectives on a single GPU)."""

    def run(layer: RaggedLayer, x: jax.Array, experts: jax.Array, gates: jax.Array, wi: Any, wo: Any) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or EXPERT not in mesh.axis_names:
            return layer(x, experts, gates, wi, wo, _identity)
        through = through_experts if mesh.shape[EXPERT] > 1 or exchange_at_one else _identity

        def body(x, experts, gates, wi, wo):
            return layer(x, experts, gates, wi, wo, through)

        if EXPERT in mesh.manual_axes:
            return body(x, experts, gates, wi, wo)
        batch, owned = P(BATCH_AXES), P(EXPERT)  # weights [E, ...]: experts over expert, F left to tensor
        return jax.shard_map(body, mesh=mesh, in_specs=(batch, batch, batch, owned, owned), out_specs=batch,
                             axis_names=set(BATCH_AXES))(x, experts, gates, wi, wo)

    return run


EXPERT_EXCHANGE = Exchange(_exchange(_to_experts_local, _TOKEN_MAJOR, _EXPERT_MAJOR),
                           _exchange(_from_experts_local, _EXPERT_MAJOR, _TOKEN_MAJOR), _experts_here, make_ragged())

__all__ = ["EXPERT_EXCHANGE", "LOCAL"]
