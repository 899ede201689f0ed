"""The vocabulary ends of the model: the embedding lookup, the output projection and the loss.

Single-device math in logical axis names, as layers.py. Two things here keep [B, T, V] buffers
out of the step (a V-sized row per token is the largest activation of a real model: 4 x 4,096 x
32,000 float32 is 2 GiB per chip):
- the lookup is a gather with a scatter-add gradient (param_take), not a one-hot matmul;
- the loss (fused_cross_entropy) projects, takes the log-sum-exp and the target's logit chunk by
  chunk of T and keeps only the [B, T] log-sum-exp; its backward recomputes each chunk's logits.
  With `vocab` sharded over `tensor` the partitioner reduces the max, the sum and the target
  logit over the vocab shards ([B, chunk] rows), as Megatron's vocab-parallel cross-entropy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from parallax.config import chunk_length
from parallax.model.layers import (DotGeneralFactory, ParamUse, weight_grad_dot, dot_grad_lhs, make_dot,
                                   match_varying, param_matmul)
from parallax.model.logical import Pin, ParamPlacer, constrain, param_placement, pin, vary, varying_axes

LOGITS = ("activation_batch", "activation_length", "activation_vocab")
ROWS = ("activation_batch", "activation_length", "activation_embed")


def cross_entropy(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy in float32; [B, T, V], [B, T] -> []. The reference the fused loss
    is tested against, and the loss of an FP8 output projection (fp8.logits). `loss_mask` [B, T]
    (packed documents): the mean over the tokens where it is nonzero (mask_mean)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if loss_mask is None:
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(loss_mask != 0, nll, 0.0)) / mask_count(loss_mask)


def mask_count(loss_mask: jax.Array) -> jax.Array:
    """The denominator of a masked mean: the tokens kept, at least 1 (an all-masked batch: 0)."""
    return jnp.maximum(jnp.sum((loss_mask != 0).astype(jnp.float32)), 1.0)


# ----------------------------------------------------------------------------------------------
# The fused projection + cross-entropy


@dataclass(frozen=True)
class VocabPins:
    """Layouts captured in the forward pass for the backward rules here (logical.Pin)."""

    logits: Pin  # LOGITS: [B, C, V] with V over tensor
    rows: Pin  # ROWS: [B, C, D], e.g. the loss's input gradient
    weight: Pin  # the weight's compute layout (V over tensor)

    @classmethod
    def here(cls, names: tuple[str, ...]) -> VocabPins:
        return cls(pin(LOGITS), pin(ROWS), pin(names))

    @property
    def shards(self) -> int:
        """Batch shards (1 inside shard_map, where the batch axes are manual)."""
        return self.rows.ways(0)

    def split(self, a: jax.Array) -> jax.Array:
        """[B, ...] -> [n, B/n, ...], n = shards: each device's row block (no data moves)."""
        return a.reshape(self.shards, a.shape[0] // self.shards, *a.shape[1:])

    def per_shard(self, dw: jax.Array) -> jax.Array:
        """[n, *W]: a weight gradient per batch shard, n over the batch axes."""
        return self.rows.stacked(0, self.weight)(dw)

    def reduce(self, dw: jax.Array, dtype: Any) -> jax.Array:
        """[n, *W] float32 -> [*W]: the batch-axes reduction, once, of partial sums in `dtype`
        (parallel.grad_reduce_dtype, as layers.param_dot's). Why per shard: a weight gradient
        accumulated over a loop (the loss's chunks), or one the partitioner must reduce right
        where a float32 op made it (a scatter-add), would otherwise be reduced in the loop
        (XLA:CPU did, once per chunk; the TPU compiler moved it out) or in float32.
        lax.reduce, since jnp.sum adds bfloat16 in float32. The sum is left unpinned: the layout
        the gradient is wanted in decides it (ZeRO-1's update slice: XLA:GPU then reduce-scatters;
        pinned to the weight's compute layout it all-reduced the whole table, twice the bytes
        over the links: 1 GiB more per step for a 1B model's tables on h100-8)."""
        return sum_shards(dw, dtype)


def sum_shards(dw: jax.Array, dtype: Any) -> jax.Array:
    """[n, *W] -> [*W] in `dtype`, one partial sum per batch shard on the leading axis, the layout
    of the sum left to its consumer (VocabPins.reduce; pipeline_1f1b's vocabulary tables).
    lax.reduce, since jnp.sum adds bfloat16 in float32."""
    dw = dw.astype(dtype)
    return lax.reduce(dw, jnp.zeros((), dtype), lax.add, (0,))


def _chunk_logits(xc: jax.Array, wc: jax.Array, dims: Any, dtype: Any, pins: VocabPins) -> jax.Array:
    # [B, C, D] x W -> [B, C, V] float32, rounded through the compute dtype as the unfused head is
    return pins.logits(lax.dot_general(xc, wc, dims, preferred_element_type=dtype)).astype(jnp.float32)


def _is_target(lg: jax.Array, tc: jax.Array) -> jax.Array:
    # [B, C, V] bool; an iota compare, so that a vocab-sharded row needs no gather of the target
    return lax.broadcasted_iota(jnp.int32, lg.shape, 2) == tc[..., None]


def _slice(a: jax.Array, i: jax.Array, chunk: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def fused_cross_entropy(x: jax.Array, w: jax.Array, targets: jax.Array, dims: Any, use: ParamUse, chunk: int,
                        pins: VocabPins, loss_mask: jax.Array | None = None) -> jax.Array:
    """cross_entropy(x . use.weight(w), targets, loss_mask) without the [B, T, V] logits: x
    [B, T, D] in the compute dtype, w the master weight (dims: its lax.dot_general dimension
    numbers with x), targets [B, T], loss_mask [B, T] or None (every token counts); `chunk`
    positions of T at a time (T a multiple of it). The weight gradient is accumulated over
    chunks in float32 and leaves in use.grad_dtype (layers.ParamUse)."""
    return _fused_fwd(x, w, targets, dims, use, chunk, pins, loss_mask)[0]


def _fused_fwd(x: jax.Array, w: jax.Array, targets: jax.Array, dims: Any, use: ParamUse, chunk: int,
               pins: VocabPins, loss_mask: jax.Array | None = None):
    wc = use.weight(w)  # cast (ZeRO-3: gathered) once for every chunk
    b, t = targets.shape
    vma = sorted(varying_axes(x) | varying_axes(wc))  # inside shard_map: the carries' type

    def body(total: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        lg = _chunk_logits(_slice(x, i, chunk), wc, dims, use.dtype, pins)
        tc = _slice(targets, i, chunk)
        lse = jax.nn.logsumexp(lg, axis=-1)  # [B, C]
        picked = jnp.sum(jnp.where(_is_target(lg, tc), lg, 0.0), axis=-1)
        if loss_mask is None:
            return total + jnp.sum(lse - picked), lse
        return total + jnp.sum(jnp.where(_slice(loss_mask, i, chunk) != 0, lse - picked, 0.0)), lse

    total, lse = lax.scan(body, vary(jnp.zeros((), jnp.float32), vma), jnp.arange(t // chunk))
    denom = b * t if loss_mask is None else mask_count(loss_mask)
    return total / denom, (x, wc, targets, loss_mask, lse)  # lse: [T/C, B, C] float32, the only new residual


def _fused_bwd(dims: Any, use: ParamUse, chunk: int, pins: VocabPins, res: tuple, g: jax.Array):
    # A barrier so that the compiler cannot merge the recomputed logits with the forward's (it
    # did, for one chunk): that would keep [B, T, V] float32 alive from the forward to here.
    x, wc, targets, loss_mask, lse = lax.optimization_barrier(res)
    b, t = targets.shape
    scale = g / (b * t) if loss_mask is None else g / mask_count(loss_mask)
    vma = sorted(varying_axes(x) | varying_axes(wc))

    # The weight gradient is accumulated per batch shard over the chunks ([n, *W] float32) and
    # reduced once after the loop (VocabPins.reduce).
    def weight_grad(d: jax.Array, xc: jax.Array) -> jax.Array:  # -> [n, *W] float32
        dw = jax.vmap(lambda d, xc: weight_grad_dot(d, xc, dims, wc.ndim, jnp.float32))(pins.split(d), pins.split(xc))
        return pins.per_shard(dw)

    def body(carry: tuple, i: jax.Array) -> tuple[tuple, None]:
        dx, dw = carry
        xc = _slice(x, i, chunk)
        lg = _chunk_logits(xc, wc, dims, use.dtype, pins)  # recomputed: never more than one chunk's logits
        tc = _slice(targets, i, chunk)
        # d(mean CE)/d logits = (softmax - onehot) / (B T), entering the matmuls in the compute
        # dtype as autodiff through the head's cast would send it
        sc = scale if loss_mask is None else jnp.where(_slice(loss_mask, i, chunk) != 0, scale, 0.0)[..., None]
        d = ((jnp.exp(lg - lse[i][..., None]) - _is_target(lg, tc)) * sc).astype(use.dtype)
        d = pins.logits(d)
        dxc = pins.rows(dot_grad_lhs(d, wc, dims, x.ndim, x.dtype))
        dx = lax.dynamic_update_slice_in_dim(dx, dxc, i * chunk, axis=1)
        return (dx, dw + weight_grad(d, xc)), None

    init = (vary(jnp.zeros_like(x), vma), vary(pins.per_shard(jnp.zeros((pins.shards, *wc.shape), jnp.float32)), vma))
    (dx, dw), _ = lax.scan(body, init, jnp.arange(t // chunk))
    return dx, use.weight_grad(pins.reduce(dw, use.grad_dtype)), None, None


fused_cross_entropy.defvjp(_fused_fwd, _fused_bwd)


def projection_loss(x: jax.Array, w: jax.Array, targets: jax.Array, dims: Any, names: tuple[str, ...], dtype: Any,
                    grad_dtype: Any, dot: Any, placer: ParamPlacer | None, chunk: int,
                    loss_mask: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of the logits x . w ([B, T, D] -> [B, T, V]) against targets [B, T].

    Fused and chunked (fused_cross_entropy) for a plain matmul; an injected `dot` (FP8 logits)
    materialises the logits and uses cross_entropy: the FP8 dot keeps its scaling state per
    call, which the fused rule bypasses. The vocabulary ends have no plain-autodiff variant:
    `grad_dtype=None` (layers.param_matmul's reference) gives their gradients in `dtype`.
    """
    if dot is not None:
        logits = constrain(param_matmul(x, w, dims, names, dtype, grad_dtype, dot, placer), LOGITS)
        return cross_entropy(logits, targets, loss_mask)
    use = ParamUse(param_placement(placer, names), jnp.dtype(dtype), jnp.dtype(grad_dtype or dtype), jnp.dtype(w.dtype))
    x, w = match_varying(x.astype(dtype), w)
    return fused_cross_entropy(x, w, targets, dims, use, chunk_length(chunk, targets.shape[1]),
                               VocabPins.here(names), loss_mask)


# ----------------------------------------------------------------------------------------------
# The embedding lookup and the output projection


def _take(w: jax.Array, tokens: jax.Array, use: ParamUse) -> jax.Array:
    return use.weight(w).at[tokens].get(mode="promise_in_bounds")  # ids checked by the data path


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def param_take(w: jax.Array, tokens: jax.Array, use: ParamUse, shape: tuple[int, int], pins: VocabPins) -> jax.Array:
    """Rows `tokens` [B, T] of the master table w (`shape` [V, D] in its compute layout) in
    use.dtype: [B, T, D].

    The gradient is a scatter-add of the output cotangent into float32 zeros [V, D] per batch
    shard, reduced in use.grad_dtype only then (VocabPins.reduce): adding a frequent token's rows
    in bfloat16 would round at every add, where the one-hot matmul this replaced accumulated in
    float32 inside the dot.
    """
    return _take(w, tokens, use)


def _take_fwd(w: jax.Array, tokens: jax.Array, use: ParamUse, shape: tuple[int, int], pins: VocabPins):
    return _take(w, tokens, use), tokens


def _take_bwd(use: ParamUse, shape: tuple[int, int], pins: VocabPins, tokens: jax.Array, g: jax.Array):
    def scatter(tokens: jax.Array, g: jax.Array) -> jax.Array:
        return jnp.zeros(shape, jnp.float32).at[tokens].add(g.astype(jnp.float32), mode="promise_in_bounds")

    # Per batch shard, in the table's compute layout (vocab over tensor), so that the batch-axes
    # reduction is the one all-reduce (ZeRO-3: reduce-scatter) every weight gradient has. Left
    # free, the partitioner split the scatter over the ZeRO-1 moments' D shards instead: an
    # all-to-all of the cotangent rows, fewer bytes for a large vocab, but a choice it made per layout.
    dw = pins.per_shard(jax.vmap(scatter)(pins.split(tokens), pins.split(g)))
    return use.weight_grad(pins.reduce(dw, use.grad_dtype)), None


param_take.defvjp(_take_fwd, _take_bwd)


class Embed(nn.Module):
    """Token embedding [V, D]; `attend` and `loss` reuse it as the tied output projection.

    `dot_general` serves `attend` only: the lookup selects rows exactly, and an FP8 (or any
    approximate) matmul there would only round the table itself.
    """

    vocab_size: int
    d_model: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None
    grad_dtype: Any = "float32"  # the table gradient's dtype (param_matmul); None: plain autodiff
    placer: ParamPlacer | None = None  # ZeRO-3 (logical.ParamPlacer); None: the table is only cast

    NAMES = ("vocab", "embed")
    ATTEND = (((2,), (1,)), ((), ()))  # [B, T, D] x [V, D] -> [B, T, V]

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.NAMES),
            (self.vocab_size, self.d_model),
            jnp.float32,
        )
        self.attend_dot_general = make_dot(self.dot_general)  # a submodule must be made in setup

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # [B, T] -> [B, T, D]: a gather, and its gradient a scatter-add (param_take). With `vocab`
        # sharded over `tensor` the partitioner gathers each device's rows locally, masks the
        # rest and all-reduces [B, T, D] (Megatron's vocab-parallel embedding), as the one-hot
        # matmul it replaced did, without that matmul's [B, T, V] one-hot input.
        use = ParamUse(param_placement(self.placer, self.NAMES), jnp.dtype(self.dtype),
                       jnp.dtype(self.grad_dtype or self.dtype), jnp.dtype(jnp.float32))
        return param_take(self.embedding, tokens, use, (self.vocab_size, self.d_model), VocabPins.here(self.NAMES))

    def attend(self, x: jax.Array) -> jax.Array:
        # [B, T, D] x [V, D] -> [B, T, V]
        return param_matmul(x, self.embedding, self.ATTEND, self.NAMES, self.dtype, self.grad_dtype,
                            self.attend_dot_general, self.placer)

    def loss(self, x: jax.Array, targets: jax.Array, chunk: int, loss_mask: jax.Array | None = None) -> jax.Array:
        """Mean cross-entropy of the tied logits of x [B, T, D] against targets [B, T] (loss.py)."""
        return projection_loss(x, self.embedding, targets, self.ATTEND, self.NAMES, self.dtype, self.grad_dtype,
                               self.attend_dot_general, self.placer, chunk, loss_mask)


class Head(nn.Module):
    """The untied output projection [D, V] (params `kernel`, as a Dense would name it)."""

    vocab_size: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None
    grad_dtype: Any = "float32"
    placer: ParamPlacer | None = None

    NAMES = ("embed", "vocab")
    DIMS = (((2,), (0,)), ((), ()))  # [B, T, D] x [D, V] -> [B, T, V]

    @nn.compact
    def __call__(self, x: jax.Array, targets: jax.Array | None = None, chunk: int = 0,
                 loss_mask: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] in `dtype`; with `targets` [B, T], their mean cross-entropy instead."""
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.NAMES),
                            (x.shape[-1], self.vocab_size), jnp.float32)
        dot = make_dot(self.dot_general)
        if targets is None:
            return param_matmul(x, kernel, self.DIMS, self.NAMES, self.dtype, self.grad_dtype, dot, self.placer)
        return projection_loss(x, kernel, targets, self.DIMS, self.NAMES, self.dtype, self.grad_dtype, dot,
                               self.placer, chunk, loss_mask)
