"""FP8 matmuls with per-tensor delayed scaling: one `dot_general` module, its state in its own collection.

What one FP8 dot does. Inputs and weights are cast to E4M3 in the forward pass, the output
gradient to E5M2 in the backward pass, each as q = cast(clip(x / s, -max, max)) with a per-tensor
scale s; the matmuls take the FP8 operands, accumulate in float32 and emit the compute dtype
(the weight gradient: float32), and the product is multiplied back by s_a * s_b. Master weights
stay float32 in the optimizer: only the copy entering the matmul is quantised.

Scales. `delayed` (default, as Flax/Praxis/MaxText/Transformer Engine): s_t = amax * 2^margin /
max_representable, where amax is the max of the amax history *before* step t; this step's amax
then enters the history (at index 0, the oldest entry falling out; the rest rotate as in Flax).
`current`: s_t = max|x_t| / 448 (E4M3; 57344 for E5M2 gradients), computed from this step's
tensor before the cast (one more pass over the tensor; the history is still recorded). Both recipes
share the cast, the accumulation and the telemetry. A zero or non-finite amax keeps the previous
scale, and a non-finite amax enters the history as 0 (otherwise one inf would pin the scale for
`amax_history_length` steps). The history arithmetic matches `flax.linen.fp8_ops` exactly
(tests/test_fp8.py holds it to Flax as an oracle).

State. Per dot and per tensor (input, kernel, output_grad): `{t}_scale` [1], `{t}_amax_history`
[H], `{t}_stats` [2] (this step's fraction saturated at the FP8 max, fraction of nonzeros flushed
to zero; NO_TELEMETRY on a step that does not log them: request_telemetry), in the `fp8_meta` collection; under the model's `nn.scan` each gets a leading layers
axis. The state is part of TrainState (replicated, but a pipelined stack's on its stages where that
is a reshape: pipeline.stack_state_spec) and never reaches the optimizer. Between steps it is
fp8_state.py's: the train step hands
the dots a smaller form of it (step_state: per tensor one [4] of the scale to use, an amax slot
and the stats, the delayed scale computed from the history once per step) and pushes the step's
amaxes into the histories once, in `overwrite`; a dot given the stored form (evaluation, direct
use) reads and updates the history itself, with the same numbers.

How the state is updated: the gradient is the new value. The forward amaxes could be written with
`mutable=[...]`, but the output-gradient amax only exists inside the backward pass, where no
mutable collection is reachable. So, as in Flax's `_overwrite_with_gradient`, the state is an input
of the differentiated loss and the custom VJP returns each tensor's *new* state as its "cotangent";
the train step takes that cotangent as the next state (`overwrite`). This composes with
`jax.grad` (one more argnum), `nn.scan` over layers (per-layer slices, stacked cotangents) and
remat (the custom VJP's forward is simply re-run).

Combining uses: by max. If one state is used several times inside one differentiated program
(microbatches in a loop, pipeline ticks, a layer applied twice), autodiff *adds* the cotangents:
summed histories are the Flax bug that PR #3623 fixed, and "last use wins" is another stack's. So
`fp8_variables` converts the state to Flax's `fm32` dtype at the top of the loss, before any loop:
fm32 is float32 whose autodiff addition is `max` (and whose zero is -inf). Every use of a given
state computes the same scale and the same rolled history, so the elementwise max of the uses'
new states is exactly "history with max(amax over uses) appended": the combination by max.

Parallelism. The amax is of the whole logical tensor. Under the partitioner (GSPMD), `jnp.max` of
a sharded array is already global. Inside `shard_map` each device sees its shard: pass the manual
axes the tensor is sharded on as `amax_axes` and the amax is `pmax`-ed over them (the model files
never name mesh axes; the caller of a shard_map knows them). The pmax-ed amax is invariant over
those axes, so the returned state is too, and a replicated state's cotangent is not psum-ed on the
way out of the shard_map (which would be the "amax summed over devices" bug again). Forgetting the
hook there fails loudly: the custom VJP would return a device-varying state for a replicated one.
Under `delayed` a caller may instead keep the amaxes local and combine the state once per step
(`combined_over`: the pipeline does, as its dots run once per tick).

Weights once per step. A weight is the same tensor at every use of a step, so where it is used
many times (a pipeline stage's ticks and remat recomputations) `quantize_weights` casts it once,
before the loop, into a `QuantizedWeight` that the dot reads in place of the master weight; the
weight's state is updated there, not by the dots. Where the compiler emulates FP8 matmuls in
float32 (XLA:CPU: `emulated`, set by make_model for a CPU mesh without ZeRO-3) the copy is the
E4M3 value as float32, converted there once instead of at every use.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.linen import fp8_ops
from jax import lax

from parallax.config import Fp8Config
from parallax.model.layers import ParamUse, QuantizedWeight, dot_grad_lhs, dot_grad_rhs, match_varying
from parallax.model.logical import vary, varying_axes

FP8_COLLECTION = "fp8_meta"
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPES = ("delayed", "current")
# State name prefix -> telemetry kind; the prefixes are Flax's variable names.
TENSORS = {"input": "inputs", "kernel": "weights", "output_grad": "gradients"}
QDTYPES = {"input": E4M3, "kernel": E4M3, "output_grad": E5M2}  # what each tensor is cast to
# A tensor's state as stored: `{t}_scale` [1], `{t}_amax_history` [H], `{t}_stats` [2]; as one
# train step's dots read it (step_state): one `{t}_step` [4] = [scale, amax, saturated, flushed]
STORED, STEP = ("scale", "amax_history", "stats"), "step"
# The fm32 dtype: float32 whose cotangent accumulation is max (see the module docstring).
META_DTYPE = fp8_ops.fm32


def fp8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)  # E4M3: 448, E5M2: 57344


def overflow_threshold(dtype: Any) -> float:
    """Scaled magnitudes from here up would round above the FP8 max: they are saturated (clipped).
    (The amax element itself lands on the max by construction; that loses nothing.)"""
    fi = jnp.finfo(dtype)
    top_ulp = 2.0 ** np.floor(np.log2(float(fi.max))) * float(fi.eps)  # E4M3: 32, E5M2: 8192
    return float(fi.max) + top_ulp / 2


# ----------------------------------------------------------------------------------------------
# Scales, histories, quantisation


def compute_scale(amax: jax.Array, prev_scale: jax.Array, dtype_max: float, margin: float) -> jax.Array:
    """s = amax * 2^margin / max, in Flax's arithmetic; zero, tiny or non-finite amax keeps prev."""
    new = 1.0 / ((dtype_max / amax) / (2.0**margin))
    ok = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(new) & (new > 0)
    return jnp.where(ok, new, prev_scale)


def push_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """Newest amax at index 0, oldest dropped (Flax's roll-and-set, so histories compare equal).
    history [..., H], amax [..., 1] (a stack of tensors: one history per leading index)."""
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0).astype(history.dtype)
    return jnp.roll(history, shift=-1, axis=-1).at[..., :1].set(amax)


class _Static(NamedTuple):
    """Hashable, non-differentiable arguments of the FP8 dot."""

    dims: Any  # lax.dot_general dimension numbers, as nested tuples
    recipe: str
    margin: float
    amax_axes: tuple[str, ...]
    out_dtype: Any
    x_dtype: Any
    w_dtype: Any
    # Set when the kernel comes in as its master weight (layers.param_matmul): cast (and, ZeRO-3,
    # gathered) inside the forward pass, its gradient emitted and reduced in param.grad_dtype.
    param: ParamUse | None = None
    # The manual axes the telemetry's fractions are averaged over; None: amax_axes. Differs where
    # the caller combines the amaxes itself, once per step (combined_over: the pipeline, delayed)
    stat_axes: tuple[str, ...] | None = None
    # The state comes as step_state made it: one [..., 4] per tensor, not (scale, history, stats)
    step: bool = False
    # FP8 emulated by the compiler (XLA:CPU converts FP8 matmul operands to float32): a weight
    # quantised once per step is kept as its exact float32 value (quantize_weights)
    emulated: bool = False


def _as_f32(x: jax.Array) -> jax.Array:
    return lax.convert_element_type(x, jnp.float32) if x.dtype != jnp.float32 else x


def _reduce(x: jax.Array, axes: tuple[str, ...], op: Any) -> jax.Array:
    return op(x, axes) if axes else x


NO_TELEMETRY = -1.0  # a `{t}_stats` value: not computed this step (request_telemetry), reported as NaN


def _per_tensor(x: jax.Array, lead: int) -> tuple[int, ...]:
    """The axes of one tensor of a stack (the leading `lead` dims index the tensors). Reduced over
    these axes, not over a [*S, n] reshape: merging sharded dims made the partitioner gather the
    stacked weights (compiled for h100-8)."""
    return tuple(range(lead, x.ndim))


TELEMETRY_SCOPE = "fp8_telemetry"  # the telemetry's named scope: its kernels' op_name (hlo.kernel_bytes' `scope`)


@jax.named_scope(TELEMETRY_SCOPE)
def _telemetry(x: jax.Array, scale: jax.Array, qdtype: Any, st: _Static, lead: int = 0) -> jax.Array:
    """[..., 2]: [fraction saturated at the FP8 max, fraction of nonzeros flushed to zero] of
    x / scale, per tensor: at most half the smallest subnormal rounds (to nearest even) to 0."""
    x32, axes = x.astype(jnp.float32), _per_tensor(x, lead)
    mag = jnp.abs(x32 / scale.reshape(*scale.shape[:-1], *([1] * len(axes))))  # each tensor by its scale
    saturated = jnp.mean((mag >= overflow_threshold(qdtype)).astype(jnp.float32), axis=axes)
    tiny = float(jnp.finfo(qdtype).smallest_subnormal) / 2
    flushed = jnp.mean(((mag <= tiny) & (x32 != 0)).astype(jnp.float32), axis=axes)
    return _reduce(jnp.stack([saturated, flushed], axis=-1), _stat_axes(st), lax.pmean)


def _stat_axes(st: _Static) -> tuple[str, ...]:
    return st.amax_axes if st.stat_axes is None else st.stat_axes


def quantize(x: jax.Array, meta: tuple, qdtype: Any, st: _Static, lead: int = 0) -> tuple[jax.Array, tuple]:
    """x -> (FP8 x, new (scale, history, stats)). `meta` may be float32 or fm32. The incoming
    stats ask for this step's telemetry (anything >= 0) or not (NO_TELEMETRY: request_telemetry):
    two more reductions over the tensor, measured at 11% of the emulated FP8 step on CPU, run
    only on the steps that log them. `st.step`: `meta` is step_state's (scale to use under
    `delayed`, amax slot, stats) and the new state is (scale, this use's amax, stats) (_unpack).

    `lead` > 0: x is a stack of tensors [*S, ...] (S its first `lead` dims) with a state per
    tensor (scale [*S, 1], history [*S, H], stats [*S, 2]): each quantised by its own scale, as
    `lead` = 0 quantises one (quantize_weights)."""
    scale, history, stats = (_as_f32(m) for m in meta)
    dmax = fp8_max(qdtype)
    x32 = x.astype(jnp.float32)
    # the whole tensor's amax [..., 1]
    amax = _reduce(jnp.max(jnp.abs(x32), axis=_per_tensor(x, lead))[..., None], st.amax_axes, lax.pmax)
    if st.step and st.recipe == "delayed":  # the history's scale, computed once per step (step_state)
        new_scale = scale
    else:
        basis = jnp.max(history, axis=-1, keepdims=True) if st.recipe == "delayed" else amax
        new_scale = compute_scale(basis, scale, dmax, st.margin)
    per_element = new_scale.reshape(*new_scale.shape[:-1], *([1] * (x.ndim - lead)))
    q = jnp.clip(x32 / per_element, -dmax, dmax).astype(qdtype)
    # x, not x32, enters the branch: a float32 copy as the conditional's operand would be one
    # more buffer of the tensor on every step
    # (inside shard_map both branches must vary over the same manual axes: the telemetry's mean
    # varies as x and the scale do, but over amax_axes, which its pmean reduces)
    skip_axes = sorted((varying_axes(x) | varying_axes(new_scale)) - set(_stat_axes(st)))
    asked = stats.reshape(-1)[0] >= 0  # request_telemetry asks every tensor alike
    # A stack of weights' telemetry (lead > 0: quantize_weights) reads the stack behind a
    # barrier, in a reduction of its own: XLA:GPU otherwise fused the comparisons into the weights'
    # transposing casts and wrote them out as pred masks the size of every stacked weight for a
    # separate reduction (1.58 GiB of bench_gpu's dense FP8 step compiled for h200-1, where the
    # conditional becomes a select and runs on every step: BUILD_NOTES.md). A barrier on the
    # master instead left the masks. An activation's telemetry stays where XLA puts it, in the
    # cast-and-amax fusion that reads the tensor anyway.
    seen = (lambda: lax.optimization_barrier(x)) if lead else (lambda: x)
    new_stats = lax.cond(asked, lambda: _telemetry(seen(), new_scale, qdtype, st, lead),
                         lambda: vary(jnp.full(stats.shape, NO_TELEMETRY, jnp.float32), skip_axes))
    # typed as the incoming state (a state combined_over the batch axes varies over them, while
    # the fractions, averaged over them, do not)
    # step_state's slot: this use's amax, pushed into the history once per step (overwrite), not
    # rolled here at every use (a history of 1,024 per tensor, per layer, tick and recomputation)
    recorded = jnp.where(jnp.isfinite(amax), amax, 0.0) if st.step else push_history(history, amax)
    return q, (new_scale, recorded, vary(new_stats, varying_axes(stats)))


def _restore(new: tuple, like: tuple) -> tuple:
    """New state values in the dtypes of the state that came in (fm32 stays fm32)."""
    return tuple(lax.convert_element_type(n, o.dtype) if o.dtype != n.dtype else n for n, o in zip(new, like))


def _unpack(meta: Any, st: _Static) -> tuple:
    """A tensor's state as quantize reads it: (scale, history or amax slot, stats)."""
    return split_step(meta) if st.step else meta


def split_step(packed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """step_state's [..., 4] -> scale [..., 1], amax [..., 1], stats [..., 2]."""
    return packed[..., 0:1], packed[..., 1:2], packed[..., 2:4]


def _pack(new: tuple, like: Any, st: _Static) -> Any:
    """quantize's new (scale, history or amax, stats) in the form and dtype of the state that came
    in. step_state's one array per tensor: one leaf, where three were, for the backward loops to
    stack per layer (a dynamic-update-slice kernel per leaf, layer and tick on the CPU)."""
    if not st.step:
        return _restore(new, like)
    axes = sorted(set().union(*(varying_axes(n) for n in new)))
    joined = jnp.concatenate([vary(_as_f32(n), axes) for n in new], axis=-1)
    return _restore((joined,), (like,))[0]


# ----------------------------------------------------------------------------------------------
# The FP8 dot and its VJP


def _to_bits(q: jax.Array) -> jax.Array:
    """An FP8 residual as its raw bytes (uint8; a bitcast, no copy in the compiled step).

    Why: a remat policy that *saves* a residual (ZeRO-3's `none`, transformer.remat_policy, which
    saves everything but the gathered weights) makes jax.checkpoint insert `reduce_precision(x,
    finfo(x.dtype).nexp, .nmant)` on the residual's producer (jax/_src/ad_checkpoint.py,
    `_insert_reduce_precision`, jax 0.10.2), so every use of it, the forward matmul's too, reads
    the rounded value. XLA's reduce_precision is IEEE-like: for E4M3FN (no infinities, finite up
    to 448) it turns the top binade [256, 448] into NaN and flushes the subnormals (< 2^-6) to
    zero (seen on XLA:CPU). Delayed scaling puts the amax on 448: a NaN loss from the second
    step on; at the first step's scale of 1 small weights are subnormal: a wrong loss already.
    An integer residual is left alone (tests/test_fp8.py, the ZeRO-3 remat `none` test)."""
    return lax.bitcast_convert_type(q, jnp.uint8)


def _from_bits(b: jax.Array, dtype: Any) -> jax.Array:
    """The FP8 operand from its raw bytes; an emulated weight's float32 value as it is."""
    return b if b.dtype == jnp.float32 else lax.bitcast_convert_type(b, dtype)


def _weight_bits(q: jax.Array) -> jax.Array:
    """A residual FP8 weight as _to_bits stores it; an emulated weight's float32 value as it is."""
    return q if q.dtype == jnp.float32 else _to_bits(q)


def _operand(q: jax.Array, other: jax.Array) -> jax.Array:
    """An FP8 operand in the float32 of an emulated weight it meets (lax.dot_general takes one
    operand type): the value the compiler would convert it to anyway."""
    return q.astype(jnp.float32) if other.dtype == jnp.float32 else q


def _rescaled(product: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """An FP8 GEMM's product times its operands' scales (`scale` [1]), in `dtype`.

    Multiplied by a scalar on the accelerators: multiplied by jnp.broadcast_to(scale, shape),
    XLA:GPU computed that float32 broadcast for every layer in a loop before the pipeline's tick
    loop and read it at every use, 4 bytes per element of every product (31.6 MiB of the
    fp8_cost layout's step compiled for h100-8, 4.7% of it; v5e-8: 371.2 -> 354.3 MiB). XLA:CPU
    materialises the broadcast too, and the scalar removes it there as well, but the CPU step then
    runs slower (measured on CPU, one process, interleaved: the FP8 step 420 against 358 ms; not
    explained), so on the CPU the broadcast stays."""
    scalar = lambda p, s: (p * s.reshape(())).astype(dtype)  # noqa: E731
    broadcast = lambda p, s: (p * jnp.broadcast_to(s, p.shape)).astype(dtype)  # noqa: E731
    return lax.platform_dependent(product, scale, cpu=broadcast, default=scalar)


def _dot_fwd(x, w, x_meta, w_meta, g_meta, st: _Static):
    qx, x_new = quantize(x, _unpack(x_meta, st), E4M3, st)
    if isinstance(w, QuantizedWeight):  # quantised once this step (quantize_weights): no state here
        bits = w.bits if st.param is None else st.param.placement.to_compute(w.bits)
        qw, sw, w_new = _from_bits(bits, E4M3), w.scale, ()
    else:
        if st.param is not None:
            w = st.param.weight(w)  # the compute-dtype copy, quantised from as without `param`
        qw, w_new = quantize(w, _unpack(w_meta, st), E4M3, st)
        sw, w_new = w_new[0], _pack(w_new, w_meta, st)
    sx = x_new[0]
    # The GEMM accumulates in float32 and emits the compute dtype, as Flax's fp8_ops: a float32
    # result doubled the bytes the GEMM writes in bfloat16 (compiled for h100-8, the fp8_cost
    # layout: 751.7 -> 736.1 MiB per step with dx below); the product is rounded once more
    # after the scale (<= 1 ulp of the compute dtype, far inside E4M3's 2^-4)
    y = _rescaled(lax.dot_general(_operand(qx, qw), qw, st.dims, preferred_element_type=st.out_dtype), sx * sw,
                  st.out_dtype)
    # Residuals are the FP8 operands (1 byte per element), not the high-precision ones, as raw
    # bits (_to_bits: a remat policy that saves them would otherwise corrupt them).
    res = (_to_bits(qx), _weight_bits(qw), sx, sw, _pack(x_new, x_meta, st), w_new, g_meta)
    return y, res


def _dot_bwd(st: _Static, res, g):
    bx, bw, sx, sw, x_new, w_new, g_meta = res
    qx, qw = _from_bits(bx, E4M3), _from_bits(bw, E4M3)
    qg, g_new = quantize(g, _unpack(g_meta, st), E5M2, st)
    sg = g_new[0]
    # FP8 operands kept FP8 (lax's own transpose rule would ask for an FP8 result); the input
    # gradient emitted in the input's dtype (as y above), the weight gradient in float32 (or
    # param.grad_dtype), as in Flax.
    dx = _rescaled(dot_grad_lhs(_operand(qg, qw), qw, st.dims, qx.ndim, st.x_dtype), sw * sg, st.x_dtype)
    if st.param is None:
        dw = _rescaled(dot_grad_rhs(qg, qx, st.dims, qw.ndim, jnp.float32), sx * sg, st.w_dtype)
    else:  # the partial sums leave the matmul, and are reduced, in grad_dtype; scaled after
        dw = st.param.placement.to_storage(dot_grad_rhs(qg, qx, st.dims, qw.ndim, st.param.grad_dtype))
        dw = _rescaled(dw.astype(jnp.float32), sx * sg, st.w_dtype)
    if isinstance(w_new, tuple) and not w_new:  # a QuantizedWeight: the master's gradient, nothing for its FP8 copy
        no_bits = jnp.zeros_like(bw) if bw.dtype == jnp.float32 else np.zeros(bw.shape, jax.dtypes.float0)
        dw = QuantizedWeight(dw, no_bits, jnp.zeros_like(sw))
    return dx, dw, x_new, w_new, _pack(g_new, g_meta, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def fp8_dot(x, w, x_meta, w_meta, g_meta, st: _Static):
    """x . w with FP8 operands; each *_meta is (scale [1], amax_history [H], stats [2])."""
    return _dot_fwd(x, w, x_meta, w_meta, g_meta, st)[0]


fp8_dot.defvjp(lambda x, w, xm, wm, gm, st: _dot_fwd(x, w, xm, wm, gm, st), _dot_bwd)


class Fp8DotGeneral(nn.Module):
    """Drop-in for `lax.dot_general` (lhs = activations, rhs = weights) with delayed-scaling FP8.

    `amax_axes`: the manual `shard_map` axes the operands are sharded on, when called inside a
    shard_map (expert shards, pipeline stages); empty under the partitioner.
    """

    recipe: str = "delayed"
    amax_history_length: int = 1024
    margin: float = 0.0
    amax_axes: tuple[str, ...] = ()
    stat_axes: tuple[str, ...] | None = None  # the telemetry's (None: amax_axes; _Static.stat_axes)
    emulated: bool = False  # _Static.emulated: read by quantize_weights from the factory's keywords

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 param: ParamUse | None = None):
        """`param`: rhs is a master weight to be used as `param` says (layers.param_matmul)."""
        del precision  # FP8 operands, float32 accumulation: nothing to choose
        if self.recipe not in RECIPES:
            raise ValueError(f"Fp8DotGeneral.recipe: must be one of {RECIPES}, got {self.recipe!r}")
        h = self.amax_history_length
        step = self.has_variable(FP8_COLLECTION, f"input_{STEP}")  # given as step_state made it
        metas = []
        for t in TENSORS:
            if step:
                metas.append(self.get_variable(FP8_COLLECTION, f"{t}_{STEP}"))
                continue
            scale = self.variable(FP8_COLLECTION, f"{t}_scale", jnp.ones, (1,), jnp.float32)
            history = self.variable(FP8_COLLECTION, f"{t}_amax_history", jnp.zeros, (h,), jnp.float32)
            stats = self.variable(FP8_COLLECTION, f"{t}_stats", jnp.zeros, (2,), jnp.float32)
            metas.append((scale.value, history.value, stats.value))
        master = rhs.master if isinstance(rhs, QuantizedWeight) else rhs
        if isinstance(rhs, QuantizedWeight):
            metas[1] = ()  # the weight's state was used and updated where it was quantised
        out_dtype = preferred_element_type or jnp.result_type(lhs, master)
        (xc, yc), (xb, yb) = dimension_numbers
        dims = ((tuple(xc), tuple(yc)), (tuple(xb), tuple(yb)))
        st = _Static(dims, self.recipe, float(self.margin), tuple(self.amax_axes), jnp.dtype(out_dtype),
                     jnp.dtype(lhs.dtype), jnp.dtype(master.dtype), param,
                     None if self.stat_axes is None else tuple(self.stat_axes), step)
        lhs, rhs = match_varying(lhs, rhs)  # the state stays as it came in (not psum-ed on transpose)
        return fp8_dot(lhs, rhs, *metas, st)


# ----------------------------------------------------------------------------------------------
# Wiring: factories for the model, the state's way through the train step, telemetry


def make_fp8_dot_general(cfg: Fp8Config, amax_axes: tuple[str, ...] = (), emulated: bool = False) -> Any:
    """A `DotGeneralFactory` (layers.py) building one FP8 dot with `cfg`'s recipe. `emulated`: the
    compiler emulates FP8 matmuls (XLA:CPU), _Static.emulated."""
    return functools.partial(Fp8DotGeneral, recipe=cfg.recipe, amax_history_length=cfg.amax_history_length,
                             margin=cfg.margin, amax_axes=tuple(amax_axes), emulated=emulated)


def transformer_dot_generals(cfg: Fp8Config, emulated: bool = False) -> dict[str, Any]:
    """Transformer(...) keyword arguments for `cfg`: {} when FP8 is off. The logits matmul only with
    `fp8.logits`; the embedding lookup never (a gather, vocab.Embed)."""
    if not cfg.enabled:
        return {}
    factory = make_fp8_dot_general(cfg, emulated=emulated)
    return {"dot_general": factory, "logits_dot_general": factory if cfg.logits else None}


def fp8_variables(fp8: Any) -> dict[str, Any]:
    """The `fp8_meta` collection for `model.apply`, as fm32 so that every reuse combines by max.

    Call it inside the differentiated function (the loss), before any loop over microbatches.
    """
    if not fp8:
        return {}
    return {FP8_COLLECTION: jax.tree.map(lambda x: lax.convert_element_type(x, META_DTYPE), fp8)}


def scales_each_use(factory: Any) -> bool:
    """Whether a dot made by `factory` quantises each call by that call's own amax (`current`):
    then how a batch is cut into calls changes the numbers, so a caller that may cut it
    differently per layout (the pipeline's half-microbatches) must not."""
    keywords = getattr(factory, "keywords", {})
    return getattr(factory, "func", None) is Fp8DotGeneral and keywords.get("recipe") == "current"


# ----------------------------------------------------------------------------------------------
# Weights quantised once per step


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _quantized(w: jax.Array, meta: tuple, st: _Static, dtype: Any, lead: int) -> QuantizedWeight:
    return _quantized_fwd(w, meta, st, dtype, lead)[0]


def _quantized_fwd(w, meta, st: _Static, dtype: Any, lead: int):
    q, new = quantize(w.astype(dtype), _unpack(meta, st), E4M3, st, lead)  # as the dot casts a master weight
    # emulated: the float32 value, converted here once, not at every use inside the loops (the
    # compiler would convert the FP8 operand at each); exactly the FP8 value, 4 bytes a weight
    bits = q.astype(jnp.float32) if st.emulated else _to_bits(q)
    return QuantizedWeight(w, bits, new[0]), _pack(new, meta, st)


def _quantized_bwd(st: _Static, dtype: Any, lead: int, new_meta: tuple, ct: QuantizedWeight):
    # the master's gradient straight through; the state's "gradient" is its new value (overwrite)
    return ct.master, new_meta


_quantized.defvjp(_quantized_fwd, _quantized_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def combined_over(state: Any, axes: tuple[str, ...]) -> Any:
    """An FP8 state tree (fm32 leaves) typed as varying over the manual `axes`, whose uses' new
    states are combined by one max over `axes` where it enters (the transpose: pmax, not psum).
    Under `delayed` a use's amax only enters the history, so the dots inside the loop take their
    local amaxes (`amax_axes=()`) and the state is reduced over the devices once per step here, in
    place of once per dot, per operand and per tick."""
    return jax.tree.map(lambda x: vary(x, axes), state)


def _combined_over_fwd(state: Any, axes: tuple[str, ...]) -> tuple[Any, None]:
    return combined_over(state, axes), None


def _combined_over_bwd(axes: tuple[str, ...], _: None, ct: Any) -> tuple[Any]:
    # one pmax per leaf: XLA's all-reduce combiner makes them one (compiled for h100-8; joining
    # the leaves by hand only added the concatenation's copies)
    return (jax.tree.map(lambda x: lax.convert_element_type(lax.pmax(_as_f32(x), axes), x.dtype), ct),)


combined_over.defvjp(_combined_over_fwd, _combined_over_bwd)


# The parameters an FP8 dot module may take as its weight, in the order a module makes its dots:
# Dense (and the head) `kernel`; the MoE experts `wi`, then `wo` (moe.MoE: Fp8DotGeneral_0, _1).
# Checked: a dot whose weight is not found here raises (quantize_weights).
WEIGHT_NAMES = ("kernel", "wi", "wo")


def quantize_weights(params: Any, fp8: Any, factory: Any, dtype: Any, amax_axes: Any, lead: int) -> Any:
    """`params` with every weight an FP8 dot takes replaced by a QuantizedWeight: quantised here,
    once, by its own state in `fp8` (same tree paths; the weight's amax enters the history here,
    and the dot no longer quantises it at each use: a pipeline stage's weights were quantised
    again at every tick and every remat recomputation, BUILD_NOTES.md "FP8's cost").

    Exact against quantising at each use: a weight is the same tensor at every use of one step,
    so its amax, scale and FP8 copy are too, under both recipes. `factory`: the model's FP8 dot
    factory (its recipe and margin; anything else: `params` unchanged). `dtype`: the compute
    dtype the dot casts a master weight to first. `amax_axes`: a tree of `params`' structure
    whose leaves are the manual shard_map axes each weight is sharded over (its amax is pmax-ed
    over them). `lead`: leading stack dims of every leaf (a stage's [R, Lc, ...]: 2)."""
    if getattr(factory, "func", None) is not Fp8DotGeneral or not fp8:
        return params
    flat_params = traverse_util.flatten_dict(params)
    for path, _, meta, st in _weight_dots(flat_params, fp8, factory, dtype, amax_axes):
        flat_params[path] = _quantized(flat_params[path], meta, st, jnp.dtype(dtype), lead)
    return traverse_util.unflatten_dict(flat_params)


def quantize_weights_now(params: Any, fp8: Any, factory: Any, dtype: Any, amax_axes: Any,
                         lead: int) -> tuple[Any, dict]:
    """quantize_weights for a caller that threads the FP8 state itself instead of differentiating
    through it (pipeline_1f1b's per-tick VJPs): (params with QuantizedWeights, {state path:
    the weight's new state value}, float32, for the paths of the weights' state only). The
    masters' gradients still come straight through the dots (QuantizedWeight.master)."""
    if getattr(factory, "func", None) is not Fp8DotGeneral or not fp8:
        return params, {}
    flat_params, new_state = traverse_util.flatten_dict(params), {}
    for path, dot, meta, st in _weight_dots(flat_params, fp8, factory, dtype, amax_axes):
        flat_params[path], new = _quantized_fwd(flat_params[path], meta, st, jnp.dtype(dtype), lead)
        if st.step:
            new_state[(*dot, f"kernel_{STEP}")] = _as_f32(new)
        for k, value in zip(STORED, () if st.step else new):
            new_state[(*dot, f"kernel_{k}")] = _as_f32(value)
    return traverse_util.unflatten_dict(flat_params), new_state


def _weight_dots(flat_params: dict, fp8: Any, factory: Any, dtype: Any, amax_axes: Any):
    """(weight path, its dot's state path, the weight's state (scale, history, stats), _Static)
    for every FP8 dot in `fp8`, in the order quantize_weights documents."""
    kw = factory.keywords
    flat_axes = traverse_util.flatten_dict(amax_axes)
    dots = sorted({path[:-1] for path in traverse_util.flatten_dict(fp8)})
    for dot in dots:
        module, index = dot[:-1], int(dot[-1].rsplit("_", 1)[1])
        names = [n for n in WEIGHT_NAMES if (*module, n) in flat_params]
        if index >= len(names):
            raise ValueError(f"quantize_weights: FP8 dot {'/'.join(dot)} has no weight among {WEIGHT_NAMES}")
        path = (*module, names[index])
        state = fp8
        for key in dot:
            state = state[key]
        step = f"kernel_{STEP}" in state  # as step_state made it
        meta = state[f"kernel_{STEP}"] if step else tuple(state[f"kernel_{k}"] for k in STORED)
        recipe, margin = kw.get("recipe", Fp8DotGeneral.recipe), float(kw.get("margin", Fp8DotGeneral.margin))
        st = _Static((), recipe, margin, tuple(flat_axes[path]), jnp.dtype(dtype), jnp.dtype(dtype),
                     jnp.dtype(jnp.float32), step=step, emulated=bool(kw.get("emulated", False)))
        yield path, dot, meta, st
