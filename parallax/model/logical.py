"""What model code uses to speak logical axis names: constraints, parameter placement, `vary`.

Model code names every dimension with a logical name (`embed`, `heads`, `batch`, ...) and never a
mesh axis: the rules table that maps the names onto the mesh lives in sharding.py and reaches the
model only through the ambient Flax rules (`sharding.logical_context`) or an injected object
(`ParamPlacer`, built by sharding.param_placer). This module knows neither the mesh's axis names
nor the table; it resolves names against whatever rules and mesh are in effect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from parallax.config import UserError

Rules = tuple[tuple[str, Any], ...]


class ShardingError(UserError):
    """A rules table or a model's annotations cannot be laid out on the mesh."""


def entry_axes(axes: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (or rules-table value): None, a name, or a tuple."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def validate_rules(rules: Iterable[tuple[str, Any]], mesh: Any = None) -> dict[str, tuple[str, ...]]:
    """The rules as a dict; a name given twice (even identically) or a malformed rule raises.

    `mesh`: a Mesh or AbstractMesh, or a sequence of mesh axis names; every axis a rule names
    must be one of them. None skips that check (sharding.check checks against parallax's axes).
    """
    table: dict[str, tuple[str, ...]] = {}
    known = None if mesh is None else tuple(getattr(mesh, "axis_names", mesh))
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
            if known is not None and a not in known:
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


def drop_axes(spec: P, axes: Iterable[str]) -> P:
    """`spec` without the given mesh axes: inside a shard_map that is manual over some axes
    (pipe, and the batch axes in the pipeline), the partitioner only places the others."""
    axes = set(axes)
    out = []
    for entry in spec:
        kept = tuple(a for a in entry_axes(entry) if a not in axes)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return P(*out)


def spec_axes(spec: P) -> set[str]:
    """Every mesh axis `spec` shards over."""
    return {a for entry in spec for a in entry_axes(entry)}


def keep_axes(spec: P, axes: Iterable[str]) -> P:
    """`spec` restricted to the given mesh axes (the in_specs of a partly manual shard_map)."""
    return drop_axes(spec, spec_axes(spec) - set(axes))


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by logical names under the ambient rules and mesh.

    Stricter than `nn.with_logical_constraint`: an unknown name or a mesh axis used twice raises
    instead of silently leaving the dimension unsharded. A no-op when no mesh is set (e.g. plain
    single-device use of the model).
    """
    return pin(names)(x)


@dataclass(frozen=True)
class Pin:
    """An activation layout resolved under the ambient rules and mesh, applied later: a custom
    VJP's backward rule is traced after the differentiated function has returned, outside
    `logical_context`, so it constrains with what its forward pass captured (as ParamPlacement
    does for parameters). Hashable: a custom VJP's static argument. Unpinned without a mesh."""

    mesh: Any = None
    spec: P | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.spec is None:
            return x
        with jax.sharding.use_abstract_mesh(self.mesh):
            return jax.lax.with_sharding_constraint(x, self.spec)

    def ways(self, dim: int) -> int:
        """Shards of dimension `dim` under this layout (1 unpinned)."""
        if self.spec is None or dim >= len(self.spec):
            return 1
        return math.prod(self.mesh.shape[a] for a in entry_axes(self.spec[dim]))

    def stacked(self, dim: int, inner: Pin) -> Pin:
        """A layout for [n, *inner's shape]: the leading n sharded as this layout's `dim`."""
        if self.spec is None or inner.spec is None:
            return Pin()
        return Pin(self.mesh, P(self.spec[dim] if dim < len(self.spec) else None, *inner.spec))


def pin(names: tuple[str | None, ...]) -> Pin:
    """The layout `constrain(x, names)` would give x, captured now (see Pin)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return Pin()
    spec = logical_to_spec(names, validate_rules(rules, mesh), where=f"activation {names}")
    return Pin(mesh, drop_axes(spec, mesh.manual_axes))


# ----------------------------------------------------------------------------------------------
# shard_map's varying types


def varying_axes(x: jax.Array) -> frozenset:
    """The manual shard_map axes x varies over (empty outside shard_map)."""
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval: Any) -> frozenset:
    """varying_axes of an abstract value (a jaxpr's avals)."""
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; older releases call it `vma`
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary(x: jax.Array, axes: Iterable[str]) -> jax.Array:
    """x typed as varying over the manual shard_map axes `axes` (a no-op for those it already
    varies over). The transpose of the cast is the psum of the cotangent over them."""
    have = varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# ----------------------------------------------------------------------------------------------
# Parameters: where they are stored vs where they are computed with (ZeRO-3)

PARAM_COMPUTE = "param_compute"  # checkpoint name of a parameter gathered to its compute layout
# Checkpoint names of the activations the `save_attn_mlp` remat policies keep (transformer.REMAT_POLICIES):
# the attention block's output after its output projection (MaxText's "out_proj") and the MLP's
# first projection, gate and up together (MaxText's "mlpwi"; the MoE experts' and shared experts' too).
ATTN_OUT = "attn_out"
MLP_WI = "mlp_wi"
SAVED_ACTIVATIONS = (ATTN_OUT, MLP_WI)


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter is stored and where it is computed with, fixed when the forward pass
    is traced. Hashable: a custom VJP takes it as a static argument.

    Captured, not looked up: a custom VJP's backward rule is traced after the differentiated
    function has returned, outside `logical_context`, where no mesh or rules are set; it
    re-enters the mesh captured here. `storage` and `compute` are None when nothing is pinned
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
        gathered copy is named PARAM_COMPUTE for the remat policies (transformer.remat_policy)."""
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


@dataclass(frozen=True)
class ParamPlacer:
    """ZeRO-3, injected into the model (as the FP8 `dot_general` is): parameters are stored by
    `storage` (sharding.make_rules: `embed` over data) and computed with under the ambient rules,
    so each one is gathered where it is used. Hashable (a Flax module attribute).

    Where parameters are stored and where they are computed with are separate tables, as in
    Levanter. Left to itself, GSPMD was seen keeping a ZeRO-3 weight sharded and all-reducing
    [B, T, F]-sized activations over `data` instead of all-gathering the weight. With storage
    equal to compute placement the pin would only add copies: then no placer is injected (None),
    and parameters are only cast.
    """

    storage: Rules

    def __call__(self, names: tuple[str | None, ...]) -> ParamPlacement:
        """The placement of a parameter with logical `names` under the ambient abstract mesh and
        rules (unpinned without them, e.g. at init under `eval_shape`); manual axes dropped."""
        mesh = jax.sharding.get_abstract_mesh()
        rules = nn.get_logical_axis_rules()
        if mesh.empty or not rules:
            return ParamPlacement()
        where = f"parameter {names}"
        storage = logical_to_spec(names, validate_rules(self.storage, mesh), where=where)
        compute = logical_to_spec(names, validate_rules(rules, mesh), where=where)
        return ParamPlacement(mesh, drop_axes(storage, mesh.manual_axes), drop_axes(compute, mesh.manual_axes))


def param_placement(placer: ParamPlacer | None, names: tuple[str | None, ...]) -> ParamPlacement:
    """`placer(names)`, or the unpinned placement when no placer is injected (no ZeRO-3)."""
    return ParamPlacement() if placer is None else placer(names)


def constrain_param(x: jax.Array, names: tuple[str | None, ...], placer: ParamPlacer | None,
                    dtype: Any = None) -> jax.Array:
    """Place a parameter in its compute layout where it is used, if the injected `placer` stores
    it elsewhere (ZeRO-3); see ParamPlacer.

    `dtype`: the caller's compute dtype. A float32 master weight is cast on its shard, before
    the gather (bfloat16: half the bytes on the wire); the result is the same as casting after.
    Plain autodiff of this cast leaves the weight gradient in `dtype` up to its reduction over
    data: the matmul weights go through `layers.param_matmul` instead, whose custom VJP produces
    it in `parallel.grad_reduce_dtype`. Used as it is for the norm scales and the MoE router
    (float32) and the ragged MoE path's expert weights (gradients in `dtype`).
    """
    return param_placement(placer, names).to_compute(x, dtype)
