"""The fused attention kernels (model/kernels.py) on the mesh: each device runs the kernel on its
own block of batch rows and heads, inside a `shard_map`; injected into the model as its `attend`
(transformer.Transformer), as expert_parallel.py injects the expert exchange.

A Pallas kernel (splash) and a cuDNN custom call are opaque to the partitioner: handed a
sharded operand, GSPMD would gather it whole onto every device (splash has no partitioning rule;
cuDNN's custom partitioning is not usable inside the pipeline's partly manual shard_map). So the
kernel runs under a shard_map whose specs are the rules' own for the operands: q and the output
by ("activation_batch", "activation_length", "activation_heads", "activation_kv"), k and v by
(..., "activation_kv_heads", ...), the segment ids by ("activation_batch", "activation_length"):
batch rows over the batch axes, heads and kv heads over `tensor` (query head k*G + g and its kv
head k land on the same shard: the K dimension splits in contiguous blocks, G query heads each).

Sequence: `activation_length` is never sharded (sequence parallelism shards the residual
stream's `activation_norm_length` only; the attention's q, k and v come from the all-gathered
norm output, and `tensor` already carries the heads there). A rules table that did shard T here
would have it gathered at the shard_map's boundary (the length entry is dropped from the specs):
splash can split queries over devices only with every key on each of them (its q_seq_shards),
and cuDNN's partitioning refuses a sharded sequence outright.

Inside a pipeline stage the enclosing shard_map is already manual over `pipe` and the batch
axes: the manual axes are dropped from the specs, and the nested shard_map is manual over what is
left (`tensor`, and any other axis not manual yet: a Mosaic kernel may be left to the
partitioner on no axis), or the kernel is called directly when nothing is left. The varying
types across that boundary need care (FusedAttention._nested).

`check_vma=False`: a pallas_call's output types carry no varying-axes annotation (Pallas asks
for one or for the check off); each device's output is its own block, as the out_specs say.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from parallax.config import ConfigError
from parallax.model.kernels import KERNELS
from parallax.model.logical import drop_axes, logical_to_spec, validate_rules, vary, varying_axes

Q_NAMES = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
KV_NAMES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
SEGMENT_NAMES = ("activation_batch", "activation_length")


def _spec(names: tuple[str, ...], table: dict, manual: frozenset) -> P:
    spec = drop_axes(logical_to_spec(names, table, where=f"fused attention {names}"), manual)
    return P(spec[0], None, *spec[2:])  # T whole on each device (see the module docstring)


@dataclass(frozen=True)
class FusedAttention:
    """`attend(q, k, v, segment_ids)` for transformer.Transformer: `kernel` ('splash' or 'cudnn',
    model/kernels.py) on each device's block. `interpret`: splash in Pallas' interpreter (the
    CPU tests; never for a TPU). Hashable: a Flax module attribute."""

    kernel: str
    interpret: bool = False

    def local(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        fn = KERNELS[self.kernel]
        if self.kernel == "splash":
            fn = functools.partial(fn, interpret=self.interpret)
        return fn(q, k, v, segment_ids)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        rules = nn.get_logical_axis_rules()
        if mesh.empty or not rules:  # plain single-device use of the model
            return self.local(q, k, v, segment_ids)
        table = validate_rules(rules, mesh)
        manual = frozenset(mesh.manual_axes)
        q_spec, kv_spec = _spec(Q_NAMES, table, manual), _spec(KV_NAMES, table, manual)
        seg_spec = _spec(SEGMENT_NAMES, table, manual)
        # Manual over every axis not manual yet: a Mosaic kernel cannot be left to the
        # partitioner on any axis, even one the operands are replicated over (size-1 `pipe`).
        axes = set(mesh.axis_names) - manual
        if not axes:  # already inside a shard_map manual over every axis
            return self.local(q, k, v, segment_ids)
        args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
        specs = (q_spec, kv_spec, kv_spec, seg_spec)[:len(args)]
        run = jax.shard_map(self.local, mesh=mesh, in_specs=specs, out_specs=q_spec, axis_names=axes,
                            check_vma=False)
        if not manual:
            return run(*args)
        return self._nested(run, mesh, axes, specs, *args)

    def _nested(self, run, mesh, axes: set, specs: tuple, *args: jax.Array) -> jax.Array:
        """`run` (the kernel's unchecked shard_map) inside a shard_map already manual over other
        axes (a pipeline stage). The kernel's outputs carry no varying type, so the nested
        shard_map cannot check types: its values are untyped over the enclosing manual axes, where
        the stage's values vary (each device holds its own rows), and the enclosing shard_map
        refuses a cotangent of the wrong type on either side. So the operands cross into the
        untyped world, and the output back, through casts that move no data (untyped: an unchecked
        identity shard_map; typed: `vary`), each transposed as the other: AD never sees the two
        worlds meet, and no psum is added (a `vary` differentiated plainly would sum the
        cotangents over the batch axes)."""
        outer = sorted(varying_axes(args[0]))

        def crossing(spec: P):
            ident = _untyped_identity(mesh, spec, axes)

            @jax.custom_vjp
            def untyped(x):
                return ident(x)

            untyped.defvjp(lambda x: (ident(x), None), lambda _, ct: (vary(ct, outer),))

            @jax.custom_vjp
            def typed(y):
                return vary(y, outer)

            typed.defvjp(lambda y: (vary(y, outer), None), lambda _, ct: (ident(ct),))
            return untyped, typed

        inputs = [crossing(spec)[0](x) if jnp.issubdtype(x.dtype, jnp.floating)
                  else _untyped_identity(mesh, spec, axes)(x) for x, spec in zip(args, specs)]
        return crossing(specs[0])[1](run(*inputs))


def _untyped_identity(mesh, spec: P, axes: set):
    """x -> x, untyped over the enclosing manual axes: inside an unchecked shard_map a primitive's
    output carries no varying type (x itself would keep its own), so the body multiplies by one
    (XLA folds it away)."""
    return jax.shard_map(lambda x: x * jnp.ones((), x.dtype), mesh=mesh, in_specs=spec, out_specs=spec,
                         axis_names=axes, check_vma=False)


def require_kernel(kernel: str) -> None:
    """cuDNN flash attention needs the cuDNN library even to compile (jax asks it for its version
    while tracing): where it is missing, one line naming the field and the install, not a
    traceback from inside jax. Splash needs nothing beyond jax (and libtpu to compile)."""
    if kernel != "cudnn":
        return
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except Exception as e:  # noqa: BLE001 - RuntimeError "cuDNN is not detected", a loader error, ...
        raise ConfigError(f"model.attention: cuDNN flash attention (chosen for this GPU mesh) needs the cuDNN "
                          f"library, which cannot be loaded ({type(e).__name__}: {e}); pip install nvidia-cudnn-cu12 "
                          "(no GPU is needed to compile), or set model.attention=xla") from None


def make_attend(kernel: str, interpret: bool = False) -> FusedAttention | None:
    """The model's `attend` for a resolved kernel (parallelism.attention_kernel): None for XLA's
    attention (attention.causal_attention, the program as before), else the fused kernel."""
    return None if kernel == "xla" else FusedAttention(kernel, interpret)
