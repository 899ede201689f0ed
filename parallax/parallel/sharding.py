"""Logical axis names and the one rules table that maps them onto the mesh.

Model code names every dimension with a logical name (`embed`, `heads`, `batch`, ...); this table
decides which mesh axes shard it. The rules are a plain tuple of `(logical_name, mesh_axes)` pairs,
usable as they are with `flax.linen.logical_axis_rules(...)` and `flax.nnx.logical_axis_rules(...)`
in any Flax model.

Parameters and activations have separate names (`embed` vs `activation_embed`, as in MaxText) so
that ZeRO-3 can shard the parameter `embed` dimension over `data` while the activation batch stays
on `data`. The Flax-example names `batch` / `length` are activation names.

What model code itself uses (`constrain`, the parameter placement, `vary`) is in logical.py, which
knows no mesh axis; this module builds what is injected into the model from the parallel config
(`param_placer`) and the context a model is traced in (`logical_context`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import ParallelConfig
from parallax.model.logical import ParamPlacer, Rules, ShardingError, entry_axes, logical_to_spec, validate_rules
from parallax.parallel.mesh import AXES, DATA, EXPERT, PIPE, TENSOR

BATCH_AXES = (DATA, EXPERT)  # outside MoE layers the expert axis is more data parallelism

DEFAULT_RULES: Rules = (
    # activations (Flax examples / T5X names, then MaxText-style names)
    ("batch", BATCH_AXES),
    ("length", None),
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    # The residual stream's T between tensor-parallel regions (MaxText's name): `tensor` under
    # sequence parallelism (compute_rules), so norms, residual adds and saved block inputs are 1/t;
    # or its D (parallel.sequence_parallel_dim='embed'), the same 1/t where T is no multiple of t.
    ("activation_norm_length", None),
    ("activation_norm_embed", None),
    ("activation_embed", None),
    ("activation_heads", TENSOR),
    ("activation_kv_heads", TENSOR),
    ("activation_kv", None),
    ("activation_mlp", TENSOR),
    ("activation_vocab", TENSOR),
    # MoE slots after the all-to-all (expert_parallel.py): experts over `expert`, batch over `data`
    ("activation_expert", EXPERT),
    ("activation_batch_no_expert", DATA),
    # parameters (Megatron column/row split on heads, mlp and vocab)
    ("embed", None),
    ("vocab", TENSOR),
    ("heads", TENSOR),
    ("kv_heads", TENSOR),
    ("kv", None),  # head dimension
    ("joined_kv", TENSOR),  # heads * head_dim fused, as in Flax examples / T5X
    ("mlp", TENSOR),
    ("norm", None),
    ("layers", None),  # the scanned block stack
    ("stage", PIPE),  # pipeline stages (pipeline.py)
    ("repeat", None),  # circular schedule: chunks per stage
    ("exp", EXPERT),  # MoE expert weights [E, ...] (moe.py, expert_parallel.py)
)


def _replace(rules: Rules, **targets: Any) -> Rules:
    return tuple((name, targets.get(name, axes)) for name, axes in rules)


def make_rules(parallel: ParallelConfig | None = None) -> Rules:
    """Parameter placement (storage) rules under a parallel config: ZeRO-3 puts `embed` on data.

    Compute placement (activations, and parameters at the point of use) follows compute_rules:
    a ZeRO-3 weight is all-gathered over `data` before its matmul.
    """
    parallel = parallel or ParallelConfig()
    if parallel.zero >= 3:
        return _sharded_over_data(DEFAULT_RULES)
    return DEFAULT_RULES


def _sharded_over_data(rules: Rules) -> Rules:
    """ZeRO's storage placement: the parameters' `embed` dimension over `data`."""
    return _replace(rules, embed=DATA)


def compute_rules(parallel: ParallelConfig | None = None) -> Rules:
    """Compute placement (activations, parameters at the point of use) under a parallel config.

    Sequence parallelism (Megatron-LM, Korthikanti et al. 2022) shards the residual stream's
    sequence dimension over `tensor` between the tensor-parallel regions: each tensor all-reduce
    of [B, T, D] becomes a reduce-scatter into the T-sharded residual plus an all-gather before
    the next column-parallel matmul. Same bytes on the wire; the residual stream's activation
    memory (norms, residual adds, saved block inputs, pipeline sends) falls by the tensor size.
    `sequence_parallel_dim='embed'` shards the residual stream's D instead (GSPMD's 2D layout:
    Xu et al. 2021), for a T that is no multiple of the tensor size: the same collectives on D
    (the reduce-scatter and the gather before the matmul) and the same memory; a norm's mean of
    squares is then a partial sum over tensor, one [B, T] float32 all-reduce per norm.
    """
    parallel = parallel or ParallelConfig()
    if parallel.sequence_parallel:
        dim = "activation_norm_embed" if parallel.sequence_parallel_dim == "embed" else "activation_norm_length"
        return _replace(DEFAULT_RULES, **{dim: TENSOR})
    return DEFAULT_RULES


def optimizer_rules(parallel: ParallelConfig | None = None) -> Rules:
    """Rules for optimizer state: ZeRO-1 and ZeRO-3 shard it over data on the `embed` dimension."""
    parallel = parallel or ParallelConfig()
    if parallel.zero >= 1:
        return _sharded_over_data(DEFAULT_RULES)
    return DEFAULT_RULES


@dataclass(frozen=True)
class ParamLayout:
    """One row of `check`: where a parameter lives."""

    name: str
    shape: tuple[int, ...]
    logical: tuple[str | None, ...] | None  # None: not annotated (replicated)
    spec: P


def _logical_leaves(variables: Any) -> list[tuple[str, tuple[int, ...], tuple | None]]:
    """(path, shape, logical names) for Linen boxed variables or an NNX module/state."""
    from flax import nnx  # NNX is optional for users of Linen only

    if isinstance(variables, nnx.Module):
        variables = nnx.state(variables)
    rows = []
    if isinstance(variables, nnx.State):
        for path, var in nnx.to_flat_state(variables):
            meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
            names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
            value = var.get_value() if hasattr(var, "get_value") else var.value
            rows.append(("/".join(map(str, path)), tuple(value.shape), tuple(names) if names else None))
        return rows
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables, is_leaf=is_box)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        if isinstance(leaf, nn.Partitioned):
            names = tuple(leaf.names)
            if not isinstance(leaf, nn.LogicallyPartitioned):
                raise ShardingError(f"{name}: annotated with mesh axes {names}, not logical names")
            rows.append((name, tuple(leaf.value.shape), names))
        else:
            rows.append((name, tuple(getattr(leaf, "shape", ())), None))
    return rows


def check(abstract_variables: Any, rules: Iterable[tuple[str, Any]], mesh: jax.sharding.Mesh | None = None) -> list[ParamLayout]:
    """Lay out a (foreign) model's variables and fail loudly on anything ambiguous.

    `abstract_variables`: Linen variables from `jax.eval_shape(model.init, ...)` (boxed with
    `nn.with_logical_partitioning`) or an NNX module / `nnx.state(...)`. Raises `ShardingError`
    on conflicting rules, a logical name no rule covers, two dimensions of one array on the same
    mesh axis, or (when a mesh is given, or set with `jax.set_mesh`) a dimension not divisible by
    its mesh axes' size. Unannotated variables are reported as replicated.
    """
    if mesh is None:
        ambient = jax.sharding.get_abstract_mesh()
        mesh = None if ambient.empty else ambient
    table = validate_rules(rules, mesh if mesh is not None else AXES)  # no mesh: parallax's four axes
    rows = []
    for name, shape, logical in _logical_leaves(abstract_variables):
        if logical is None:
            rows.append(ParamLayout(name, shape, None, P()))
            continue
        if len(logical) != len(shape):
            raise ShardingError(f"{name}: {len(logical)} logical names {logical} for a rank-{len(shape)} array")
        spec = logical_to_spec(logical, table, where=name)
        if mesh is not None:
            for dim, (size, axes) in enumerate(zip(shape, spec)):
                n = math.prod(mesh.shape[a] for a in entry_axes(axes))
                if size % n:
                    raise ShardingError(
                        f"{name}: dimension {dim} ({logical[dim]!r}) of size {size} is not divisible "
                        f"by mesh axes {entry_axes(axes)} of size {n}"
                    )
        rows.append(ParamLayout(name, shape, tuple(logical), spec))
    return rows


def logical_shardings(logical_specs: Any, mesh: jax.sharding.Mesh, rules: Rules) -> Any:
    """A tree of logical PartitionSpecs (from `nn.get_partition_spec`) -> NamedShardings."""
    table = validate_rules(rules, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, spec: NamedSharding(mesh, logical_to_spec(tuple(spec), table, where=jax.tree_util.keystr(path))),
        logical_specs,
        is_leaf=lambda x: isinstance(x, P),
    )


@contextlib.contextmanager
def logical_context(mesh: jax.sharding.Mesh, rules: Rules) -> Iterator[None]:
    """Trace model code under `rules` on `mesh` (usable inside `jax.jit`, unlike `jax.set_mesh`).
    ZeRO-3 is not a matter of context: the model is built with `param_placer(parallel)`."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
        yield


def param_placer(parallel: ParallelConfig | None = None) -> ParamPlacer | None:
    """The ZeRO-3 placer to inject into the model (transformer.Transformer's `placer`): parameters stored
    by make_rules (`embed` over data) and gathered to the compute rules where used; None below
    ZeRO-3, where storage equals compute placement and parameters are only cast."""
    parallel = parallel or ParallelConfig()
    return ParamPlacer(make_rules(parallel)) if parallel.zero >= 3 else None
