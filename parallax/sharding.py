"""Logical axis names and the one rules table that maps them onto the mesh.

Model code names every dimension with a logical name (`embed`, `heads`, `batch`, ...); this table
decides which mesh axes shard it. The rules are a plain tuple of `(logical_name, mesh_axes)` pairs,
usable as they are with `flax.linen.logical_axis_rules(...)` and `flax.nnx.logical_axis_rules(...)`
in any Flax model.

Parameters and activations have separate names (`embed` vs `activation_embed`, as in MaxText) so
that ZeRO-3 can shard the parameter `embed` dimension over `data` while the activation batch stays
on `data`. The Flax-example names `batch` / `length` are activation names.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import ParallelConfig, UserError
from parallax.mesh import AXES, DATA, EXPERT, PIPE, TENSOR

Rules = tuple[tuple[str, Any], ...]

BATCH_AXES = (DATA, EXPERT)  # outside MoE layers the expert axis is more data parallelism

DEFAULT_RULES: Rules = (
    # activations (Flax examples / T5X names, then MaxText-style names)
    ("batch", BATCH_AXES),
    ("length", None),
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    # The residual stream's T between tensor-parallel regions (MaxText's name): `tensor` under
    # sequence parallelism (compute_rules), so norms, residual adds and saved block inputs are 1/t.
    ("activation_norm_length", None),
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


class ShardingError(UserError):
    """A rules table or a model's annotations cannot be laid out on the mesh."""


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
    """
    parallel = parallel or ParallelConfig()
    if parallel.sequence_parallel:
        return _replace(DEFAULT_RULES, activation_norm_length=TENSOR)
    return DEFAULT_RULES


def optimizer_rules(parallel: ParallelConfig | None = None) -> Rules:
    """Rules for optimizer state: ZeRO-1 and ZeRO-3 shard it over data on the `embed` dimension."""
    parallel = parallel or ParallelConfig()
    if parallel.zero >= 1:
        return _sharded_over_data(DEFAULT_RULES)
    return DEFAULT_RULES


def entry_axes(axes: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (or rules-table value): None, a name, or a tuple."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def validate_rules(rules: Iterable[tuple[str, Any]], mesh: jax.sharding.Mesh | None = None) -> dict[str, tuple[str, ...]]:
    """The rules as a dict; a name given twice (even identically) or an unknown mesh axis raises."""
    table: dict[str, tuple[str, ...]] = {}
    known = tuple(mesh.axis_names) if mesh is not None else AXES
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ShardingError(f"rule {rule!r}: expected (logical_name, mesh_axes)")
        name, axes = rule
        if not (axes is None or isinstance(axes, str) or (
            isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes)
        )):
            raise ShardingError(f"rule for {name!r}: mesh axes must be None, a name or a tuple of names, got {axes!r}")
        axes = entry_axes(axes)
        if len(set(axes)) != len(axes):
            raise ShardingError(f"rule for {name!r} names a mesh axis twice: {axes}")
        if name in table:
            raise ShardingError(
                f"conflicting rules for logical axis {name!r}: {table[name] or None} and {axes or None} "
                "(each logical name must appear once)"
            )
        for a in axes:
            if a not in known:
                raise ShardingError(f"rule for {name!r} names mesh axis {a!r}, not one of {known}")
        table[name] = axes
    return table


def logical_to_spec(logical: Iterable[str | None], table: dict[str, tuple[str, ...]], where: str = "") -> P:
    """Map logical names to a PartitionSpec; unknown names and a mesh axis used twice raise."""
    logical = tuple(logical)
    out, used, seen = [], {}, {}
    for dim, name in enumerate(logical):
        if name is None:
            out.append(None)
            continue
        if name in seen:
            raise ShardingError(f"{where}: logical axis {name!r} names both dimensions {seen[name]} and {dim}")
        seen[name] = dim
        if name not in table:
            raise ShardingError(f"{where}: logical axis {name!r} is covered by no rule")
        axes = table[name]
        for a in axes:
            if a in used:
                raise ShardingError(
                    f"{where}: dimensions {used[a]} ({logical[used[a]]!r}) and {dim} ({name!r}) "
                    f"both map to mesh axis {a!r}"
                )
            used[a] = dim
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*out)


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
    table = validate_rules(rules, mesh)
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


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by logical names under the ambient rules and mesh.

    Stricter than `nn.with_logical_constraint`: an unknown name or a mesh axis used twice raises
    instead of silently leaving the dimension unsharded. A no-op when no mesh is set (e.g. plain
    single-device use of the model).
    """
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return x
    spec = logical_to_spec(names, validate_rules(rules, mesh), where=f"activation {names}")
    return jax.lax.with_sharding_constraint(x, drop_axes(spec, mesh.manual_axes))


def drop_axes(spec: P, axes: Iterable[str]) -> P:
    """`spec` without the given mesh axes: inside a shard_map that is manual over some axes
    (pipe, and the batch axes in the pipeline), the partitioner only places the others."""
    axes = set(axes)
    out = []
    for entry in spec:
        kept = tuple(a for a in entry_axes(entry) if a not in axes)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return P(*out)


def keep_axes(spec: P, axes: Iterable[str]) -> P:
    """`spec` restricted to the given mesh axes (the in_specs of a partly manual shard_map)."""
    axes = set(axes)
    return drop_axes(spec, {a for entry in spec for a in entry_axes(entry)} - axes)


_PIN_PARAMS = contextvars.ContextVar("parallax_pin_params", default=False)
PARAM_COMPUTE = "param_compute"  # checkpoint name of a parameter gathered to its compute layout


@contextlib.contextmanager
def logical_context(mesh: jax.sharding.Mesh, rules: Rules, pin_params: bool = False) -> Iterator[None]:
    """Trace model code under `rules` on `mesh` (usable inside `jax.jit`, unlike `jax.set_mesh`).

    `pin_params`: parameters are stored elsewhere than they are computed with (ZeRO-3), so
    `constrain_param` must gather them at the point of use.
    """
    token = _PIN_PARAMS.set(pin_params)
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
            yield
    finally:
        _PIN_PARAMS.reset(token)


def params_pinned() -> bool:
    return _PIN_PARAMS.get()


def constrain_param(x: jax.Array, names: tuple[str | None, ...], dtype: Any = None) -> jax.Array:
    """Place a parameter in its compute layout where it is used, if storage differs (ZeRO-3).

    Where parameters are stored (ZeRO-3: sharded over `data` on `embed`) and where they are
    computed with (never sharded over `data`) are separate tables, as in Levanter. Left to itself,
    GSPMD was seen keeping a ZeRO-3 weight sharded and all-reducing [B, T, F]-sized activations
    over `data` instead of all-gathering the weight. With storage equal to compute placement the
    pin would only add copies, so it is off.

    `dtype`: the caller's compute dtype. A float32 master weight is cast on its shard, before
    the gather (bfloat16: half the bytes on the wire); the result is the same as casting after.
    Plain autodiff of this cast leaves the weight gradient in `dtype` up to its reduction over
    data: the matmul weights go through `layers.param_matmul` instead, whose custom VJP produces
    it in `parallel.grad_reduce_dtype`. Used as it is for the norm scales and the MoE router
    (float32) and the ragged MoE path's expert weights (gradients in `dtype`).
    """
    return param_placement(names).to_compute(x, dtype)


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter is stored and where it is computed with, fixed when the forward pass
    is traced. Hashable: a custom VJP takes it as a static argument.

    Captured, not looked up: a custom VJP's backward rule is traced after the differentiated
    function has returned, outside `logical_context`, where no mesh, rules or ZeRO-3 pin are set;
    it re-enters the mesh captured here. `storage` and `compute` are None when nothing is pinned
    (no ZeRO-3, or no mesh): then the parameter is only cast.
    """

    mesh: Any = None  # the abstract mesh of the forward pass
    storage: P | None = None  # ZeRO-3 storage spec (embed over data), manual axes dropped
    compute: P | None = None  # compute spec (the rules at the point of use), manual axes dropped

    @property
    def pinned(self) -> bool:
        return self.storage is not None

    def to_compute(self, x: jax.Array, dtype: Any = None) -> jax.Array:
        """x cast to `dtype` and, ZeRO-3, gathered to its compute layout, the cast pinned to the
        storage layout first: with only the compute layout pinned, the partitioner gathered the
        float32 weight and cast after (seen in the HLO right after SPMD partitioning). The
        gathered copy is named PARAM_COMPUTE for the remat policies (model.remat_policy)."""
        y = x if dtype is None else x.astype(dtype)
        if not self.pinned:
            return y
        with jax.sharding.use_abstract_mesh(self.mesh):
            if y.dtype != x.dtype:
                y = jax.lax.with_sharding_constraint(y, self.storage)
            y = jax.lax.with_sharding_constraint(y, self.compute)
        return checkpoint_name(y, PARAM_COMPUTE)

    def to_storage(self, grad: jax.Array) -> jax.Array:
        """A weight gradient (a partial sum over the batch axes) into the storage layout, in its
        own dtype, through the compute layout as the transposes of `to_compute`'s constraints
        take it: reduced over every batch axis, then sliced (on GPU/TPU: ZeRO-3's reduce-scatter
        over data). Straight to the storage layout, the partitioner reduced over data and then
        over `expert` on the slice (data x expert meshes), which the cost model does not count."""
        if not self.pinned:
            return grad
        with jax.sharding.use_abstract_mesh(self.mesh):
            grad = jax.lax.with_sharding_constraint(grad, self.compute)
            return jax.lax.with_sharding_constraint(grad, self.storage)


def param_placement(names: tuple[str | None, ...]) -> ParamPlacement:
    """The placement of a parameter with logical `names` under the ambient context (see ParamPlacement)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if not _PIN_PARAMS.get() or mesh.empty or not rules:
        return ParamPlacement()
    where = f"parameter {names}"
    storage = logical_to_spec(names, validate_rules(_sharded_over_data(tuple(rules)), mesh), where=where)
    compute = logical_to_spec(names, validate_rules(rules, mesh), where=where)
    return ParamPlacement(mesh, drop_axes(storage, mesh.manual_axes), drop_axes(compute, mesh.manual_axes))
