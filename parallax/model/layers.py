"""Building blocks: Dense with an injectable dot_general, RMSNorm, SwiGLU MLP (the vocabulary ends: vocab.py).

Single-device math annotated with logical axis names only; sharding.py decides where they live.
Parameters are float32 (master weights); compute happens in `dtype`. ZeRO-3 is injected as
`placer` (logical.ParamPlacer; None: parameters are only cast), as FP8 is as `dot_general`.

Every matmul whose weight is a parameter goes through `param_matmul`: the float32 master is cast
to the compute dtype (under ZeRO-3 also all-gathered there, logical.ParamPlacement) inside a
custom VJP whose weight gradient leaves the matmul in `grad_dtype`. Why: with plain autodiff of
`kernel.astype(bfloat16)` the weight-gradient matmul's output is bfloat16, and the partitioner
reduces that partial sum over the batch axes in bfloat16 right after the dot; the cast's
transpose converts to float32 only afterwards. Megatron's weight-gradient GEMM writes an fp32
main_grad and reduces that: `grad_dtype='float32'` (parallel.grad_reduce_dtype) is the same here.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from parallax.model.logical import (MLP_WI, ParamPlacement, ParamPlacer, constrain, constrain_param, param_placement,
                                    vary, varying_axes)

# A factory returning a Flax module with lax.dot_general's signature (e.g. an FP8 op that keeps
# its scaling state in its own collection). None means plain jax.lax.dot_general. Called from
# `param_matmul`, the module also gets the float32 master weight as `rhs` and `param=ParamUse`:
# it casts (and gathers) the weight itself and returns its gradient as ParamUse says.
DotGeneralFactory = Callable[[], nn.Module] | None


class QuantizedWeight(NamedTuple):
    """A master weight with its FP8 copy for this step, made once per step outside the loops that
    use it (fp8.quantize_weights: a pipeline stage's weights before its tick loop, the scanned
    stack's before the scan). It takes the
    master weight's place in the parameters; `param_matmul` hands it to the FP8 dot, which reads
    `bits` (E4M3 as uint8) and `scale` in place of quantising the master at every use, and
    returns the master's gradient as `master`'s cotangent (straight through, as before)."""

    master: jax.Array  # float32 [...]: only its cotangent is used
    bits: jax.Array  # uint8 [...]: the E4M3 weight, master / scale rounded (float32, its exact value, where emulated)
    scale: jax.Array  # float32 [1]


class CastWeight(NamedTuple):
    """A master weight's compute-dtype copy for this step, made once outside the loops that use
    it: a pipeline stage's ZeRO-3 weights, cast on their shard and then gathered over `data`
    (pipeline.gather_stage_weight), so that the gather and the gathered buffer are in the compute
    dtype, as logical.ParamPlacement.to_compute has them outside a pipeline. It takes the master
    weight's place in the parameters; `param_matmul` reads `copy` and returns the master's
    gradient (float32) as `master`'s cotangent."""

    master: jax.Array  # float32 [...] zeros: only its shape, dtype and cotangent are used
    copy: jax.Array  # compute dtype [...]: the weight the matmul reads


def make_dot(factory: DotGeneralFactory) -> Callable[..., jax.Array] | None:
    """One dot_general module from `factory` (a submodule of the caller), or None for lax's."""
    return None if factory is None else factory()


# ----------------------------------------------------------------------------------------------
# The matmul of an activation with a parameter


@dataclass(frozen=True)
class ParamUse:
    """How one matmul uses its master weight (hashable: a custom VJP's static argument)."""

    placement: ParamPlacement  # ZeRO-3: gathered in the forward pass, its gradient reduce-scattered
    dtype: Any  # compute dtype: the weight is cast to it (on its shard) before the matmul
    grad_dtype: Any  # the weight-gradient matmul's output dtype, hence its reduction's
    param_dtype: Any  # the master weight's dtype (float32), which its gradient is returned in

    def weight(self, w: jax.Array | CastWeight) -> jax.Array:
        """The master weight as the matmul uses it: cast and, under ZeRO-3, gathered (a
        CastWeight: its copy, cast and gathered already)."""
        if isinstance(w, CastWeight):
            return w.copy.astype(self.dtype)
        return self.placement.to_compute(w, self.dtype)

    def weight_grad(self, dw: jax.Array) -> jax.Array:
        """A weight gradient in `grad_dtype` (a partial sum over the batch axes) -> the master's
        gradient: into the storage layout in `grad_dtype` (ZeRO-3's reduce-scatter), then cast."""
        return self.placement.to_storage(dw).astype(self.param_dtype)


def _remaining(n: int, *removed: tuple[int, ...]) -> list[int]:
    gone = set(itertools.chain(*removed))
    return [i for i in range(n) if i not in gone]


def dot_grad_lhs(g: jax.Array, y: jax.Array, dims: Any, x_ndim: int, out_dtype: Any, swap: bool = False) -> jax.Array:
    """d(x . y)/dx contracted with the output cotangent g, as a matmul that emits `out_dtype`.

    The arithmetic of lax.dot_general's own transpose rule (same dimension numbers, same
    transpose), which always emits the forward's preferred_element_type instead.
    """
    (xc, yc), (xb, yb) = dims
    x_kept, y_kept = _remaining(x_ndim, xc, xb), _remaining(y.ndim, yc, yb)
    nb = len(xb)
    start = nb if swap else nb + len(x_kept)  # output layout: [batch, x kept, y kept] (or swapped)
    ans_y = tuple(range(start, start + len(y_kept)))
    out = lax.dot_general(g, y, ((ans_y, tuple(y_kept)), (tuple(range(nb)), tuple(yb))),
                          preferred_element_type=out_dtype)
    # out: [batch, x kept, x contracted in the order of y's contracted dims] -> x's layout
    x_contract_by_y = [xc[i] for i in np.argsort(yc)]
    return lax.transpose(out, tuple(np.argsort(list(xb) + x_kept + x_contract_by_y)))


def dot_grad_rhs(g: jax.Array, x: jax.Array, dims: Any, y_ndim: int, out_dtype: Any) -> jax.Array:
    """d(x . y)/dy contracted with g (see dot_grad_lhs)."""
    (xc, yc), (xb, yb) = dims
    return dot_grad_lhs(g, x, ((yc, xc), (yb, xb)), y_ndim, out_dtype, swap=True)


def _param_dot_fwd(x: Any, w: Any, dims: Any, use: ParamUse):
    # symbolic_zeros: x and w come as CustomVJPPrimal. An input with no tangent (a constant, as
    # the one-hot embedding input was) needs no input gradient, so the weight is not kept for one.
    need_dx = x.perturbed
    x, w = x.value, jax.tree.map(lambda p: p.value, w, is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal))
    wc = use.weight(w)
    y = lax.dot_general(x, wc, dims, preferred_element_type=use.dtype)
    # Residuals as plain autodiff keeps them: the input and the compute-dtype weight. Under
    # remat full and dots both are recomputed (ZeRO-3: gathered again), not saved; ZeRO-3's
    # `none` policy keeps the gathered weight as it did before (test_grad_reduce.py).
    return y, (x, wc if need_dx else None, wc.ndim, isinstance(w, CastWeight))


def _param_dot_bwd(dims: Any, use: ParamUse, res: tuple, g: Any):
    x, wc, w_ndim, cast = res
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return None, None
    dx = None if wc is None else dot_grad_lhs(g, wc, dims, x.ndim, x.dtype)
    dw = weight_grad_dot(g, x, dims, w_ndim, use.grad_dtype)  # partial sums leave the matmul in grad_dtype
    dw = use.weight_grad(dw)
    return dx, CastWeight(dw, None) if cast else dw  # a CastWeight: the gradient is its master's


def weight_grad_dot(g: jax.Array, x: jax.Array, dims: Any, w_ndim: int, out_dtype: Any) -> jax.Array:
    native = functools.partial(dot_grad_rhs, dims=dims, y_ndim=w_ndim, out_dtype=out_dtype)
    if jnp.dtype(out_dtype).itemsize <= max(g.dtype.itemsize, x.dtype.itemsize):
        return native(g, x)
    # XLA:CPU (jaxlib 0.10.2) compiles some bf16 x bf16 -> f32 dots it then refuses to run
    # ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"); where it runs them,
    # it converts the operands to f32 first. Converting here is that, and exact (bf16 values).
    # GPU and TPU keep the bf16 GEMM with its f32 output (the lowering picks one branch).
    upcast = lambda g, x: native(g.astype(out_dtype), x.astype(out_dtype))  # noqa: E731
    return lax.platform_dependent(g, x, cpu=upcast, default=native)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def param_dot(x: jax.Array, w: jax.Array, dims: Any, use: ParamUse) -> jax.Array:
    """lax.dot_general(x, use.weight(w), dims) in use.dtype, its weight gradient emitted in
    use.grad_dtype. x is already in the compute dtype; w is the master weight."""
    return lax.dot_general(x, use.weight(w), dims, preferred_element_type=use.dtype)


param_dot.defvjp(_param_dot_fwd, _param_dot_bwd, symbolic_zeros=True)


def match_varying(*xs: jax.Array) -> list[jax.Array]:
    """Inside shard_map, give the operands one varying type (x sharded, w replicated: w is cast).
    A custom VJP must return each cotangent with its input's type; the cast's transpose is the
    psum that sums the weight gradient over the shards, as lax.dot_general would."""
    union = sorted(frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(xs))))
    return [jax.tree.map(lambda a: vary(a, union), x) for x in xs]


def param_matmul(x: jax.Array, w: jax.Array, dims: Any, names: tuple[str | None, ...], dtype: Any,
                 grad_dtype: Any, dot: Callable[..., jax.Array] | None = None,
                 placer: ParamPlacer | None = None) -> jax.Array:
    """x . w for a master weight w with logical `names`, in `dtype`; the weight gradient in
    `grad_dtype`. `dot`: an injected dot_general module (FP8), else param_dot. `placer`: the
    injected ZeRO-3 placement (None: w is only cast).

    `grad_dtype=None` is plain autodiff of `w.astype(dtype)` (the weight gradient in `dtype`
    until the cast's transpose): the reference the custom VJP is tested against.
    """
    x = x.astype(dtype)
    if grad_dtype is None:
        wc = constrain_param(w, names, placer, dtype)  # ZeRO-3: all-gather here, in dtype
        return (dot or lax.dot_general)(x, wc, dims, preferred_element_type=dtype)
    master = w.master if isinstance(w, (QuantizedWeight, CastWeight)) else w
    if isinstance(w, CastWeight) and dot is not None:  # an FP8 dot reads a QuantizedWeight or the master
        raise TypeError("param_matmul: a CastWeight goes to param_dot only, not to an injected dot_general")
    use = ParamUse(param_placement(placer, names), jnp.dtype(dtype), jnp.dtype(grad_dtype), jnp.dtype(master.dtype))
    if dot is not None:
        return dot(x, w, dims, preferred_element_type=dtype, param=use)
    x, w = match_varying(x, w)
    return param_dot(x, w, dims, use)


# ----------------------------------------------------------------------------------------------
# Modules


class Dense(nn.Module):
    """y = x . W over the last `contract` dims of x; W has logical names `axes`."""

    features: tuple[int, ...]
    axes: tuple[str, ...]  # logical names of the kernel: contracted input dims, then features
    contract: int = 1
    init_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None
    grad_dtype: Any = "float32"  # the weight gradient's dtype (param_matmul); None: plain autodiff
    placer: ParamPlacer | None = None  # ZeRO-3 (logical.ParamPlacer); None: the kernel is only cast

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[x.ndim - self.contract :]
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.axes),
            (*in_shape, *self.features),
            jnp.float32,
        )
        lhs_dims = tuple(range(x.ndim - self.contract, x.ndim))
        dims = ((lhs_dims, tuple(range(self.contract))), ((), ()))
        return param_matmul(x, kernel, dims, self.axes, self.dtype, self.grad_dtype, make_dot(self.dot_general),
                            self.placer)


class RMSNorm(nn.Module):
    eps: float = 1e-6
    dtype: Any = jnp.float32
    placer: ParamPlacer | None = None  # ZeRO-3 (logical.ParamPlacer): the scale gathered where used

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (x.shape[-1],), jnp.float32
        )
        scale = constrain_param(scale, ("embed",), self.placer)
        # Statistics in float32 whatever the compute dtype.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


class MLP(nn.Module):
    """SwiGLU: (silu(x W0) * (x W1)) W2; F sharded over tensor (column then row parallel)."""

    d_ff: int
    init_std: float = 0.02
    out_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None
    grad_dtype: Any = "float32"
    placer: ParamPlacer | None = None  # ZeRO-3 (logical.ParamPlacer)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        # Gate and up projections fused into one [D, 2, F] kernel: one matmul, so the backward
        # pass all-reduces one input-gradient partial sum over tensor instead of two.
        gate_up = Dense(
            (2, self.d_ff), ("embed", None, "mlp"), init_std=self.init_std, dtype=self.dtype,
            dot_general=self.dot_general, grad_dtype=self.grad_dtype, placer=self.placer, name="wi",
        )(x)  # [B, T, D] -> [B, T, 2, F]
        gate_up = checkpoint_name(gate_up, MLP_WI)  # kept under remat=save_attn_mlp
        h = nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))  # [B, T, F]
        return Dense(
            (d_model,), ("mlp", "embed"), init_std=self.out_std, dtype=self.dtype,
            dot_general=self.dot_general, grad_dtype=self.grad_dtype, placer=self.placer, name="wo",
        )(h)  # [B, T, D]
