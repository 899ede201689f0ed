"""Causal self-attention with grouped-query heads and rotary positions.

Heads are the tensor-parallel dimension (column-parallel q/k/v, row-parallel output), so a block
costs one all-reduce of [B, T, D] here in the forward pass and one in the backward pass.

XLA's attention (jax.nn.dot_product_attention without `implementation=`) keeps float32 scores and
probabilities of [B, N, T, T] for the backward pass: at 4 x 4,096 tokens and 32 heads that is
8 GiB per buffer per device, more than everything else a 7B layer needs. `chunk` (parallel.
attention_chunk) runs it over blocks of query positions under a checkpoint instead, each block
against every key with the causal mask: the same arithmetic and FLOPs, one block's scores live
([B, N, chunk, T]), each block's recomputed in the backward pass.

`decode` (sampling, infer/decode.py): keys and values go into a fixed-size cache, the "cache"
collection's `key` and `value` [B, S, K, H] (sharded like any [B, T, K, H] activation: kv heads
over tensor) and `index` (positions written so far). A call on [B, T] tokens writes positions
index..index+T-1 and attends to every cached key up to each query's position: the prompt once
(prefill), then one token per call. The training path never creates the collection.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from parallax.config import chunk_length
from parallax.model.layers import Dense, DotGeneralFactory
from parallax.model.logical import ATTN_OUT, ParamPlacer, constrain


def apply_rope(x: jax.Array, theta: float, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on [B, T, N, H] (rotate-half convention), positions 0..T-1, or
    `positions` [B, T] (packed documents: restarting at each document)."""
    _, t, _, h = x.shape
    freqs = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    if positions is None:
        angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]  # [T, H/2]
        sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    else:
        angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, H/2]
        sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int = 0,
                     segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention: q [B, T, N, H], k and v [B, T, K, H] -> [B, T, N, H].
    `chunk`: query positions per block (0, or >= T: all at once). `segment_ids` [B, T] (packed
    documents): a query sees only the keys of its own segment (causal within a document, never
    across); None: one sequence per row (the program as without packing)."""
    b, t, n, h = q.shape
    chunk = chunk_length(chunk, t)
    if chunk == t:
        if segment_ids is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
        mask = same & jnp.tril(jnp.ones((t, t), bool))[None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
    keys = jnp.arange(t)

    @jax.checkpoint  # keep only the block's inputs: its scores are recomputed in the backward pass
    def block(qi: jax.Array, i: jax.Array, si: jax.Array | None) -> jax.Array:  # [B, C, N, H], index, [B, C]
        mask = ((i * chunk + jnp.arange(chunk))[:, None] >= keys[None, :])[None]  # [1, C, T]: query row >= key
        if si is not None:
            mask = mask & (si[:, :, None] == segment_ids[:, None, :])  # [B, C, T]
        return jax.nn.dot_product_attention(qi, k, v, mask=mask[:, None])

    blocks = q.reshape(b, t // chunk, chunk, n, h).swapaxes(0, 1)  # [T/C, B, C, N, H]
    seg_blocks = None if segment_ids is None else segment_ids.reshape(b, t // chunk, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda a: block(*a), (blocks, jnp.arange(t // chunk), seg_blocks))
    return out.swapaxes(0, 1).reshape(b, t, n, h)


class Attention(nn.Module):
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    init_std: float = 0.02
    out_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None
    grad_dtype: Any = "float32"  # weight gradients' dtype (layers.param_matmul)
    placer: ParamPlacer | None = None  # ZeRO-3 (logical.ParamPlacer)
    chunk: int = 0  # query positions per attention block (parallel.attention_chunk); 0: all T
    decode: bool = False  # read and extend the KV cache (module docstring); the cache's S is its init T
    # A fused kernel (parallel/fused_attention.py, injected): attend(q, k, v, segment_ids) -> out,
    # the contract of causal_attention; None: XLA's attention (causal_attention, with `chunk`).
    attend: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """[B, T, D] -> [B, T, D]; packed documents: `segment_ids` and `positions` [B, T]."""
        d_model = x.shape[-1]
        n, k, h = self.n_heads, self.n_kv_heads, self.head_dim

        g = n // k  # query heads per kv head
        # One fused projection per kv-head group: G query heads, then the key, then the value.
        # One matmul means one input-gradient matmul, hence one tensor all-reduce backward (three
        # separate projections would all-reduce three partial sums). Sharding the K dimension
        # keeps each query head with its kv head on the same tensor shard.
        qkv = Dense(
            (k, g + 2, h), ("embed", "kv_heads", None, "kv"), init_std=self.init_std, dtype=self.dtype,
            dot_general=self.dot_general, grad_dtype=self.grad_dtype, placer=self.placer, name="qkv",
        )(x)  # [B, T, D] -> [B, T, K, G+2, H]
        b, t = x.shape[:2]
        q = qkv[:, :, :, :g].reshape(b, t, n, h)  # [B, T, K, G, H] -> [B, T, N, H], head = k * G + g
        heads_names = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
        kv_names = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
        if self.decode:  # the cache's next positions, the same in every row
            index = self.variable("cache", "index", nn.with_logical_partitioning(lambda: jnp.zeros((), jnp.int32), ()))
            positions = jnp.broadcast_to(index.value + jnp.arange(t, dtype=jnp.int32), (b, t))
        q = constrain(apply_rope(q, self.rope_theta, positions), heads_names)  # [B, T, N, H]
        key = constrain(apply_rope(qkv[:, :, :, g], self.rope_theta, positions), kv_names)  # [B, T, K, H]
        value = constrain(qkv[:, :, :, g + 1], kv_names)  # [B, T, K, H]
        if segment_ids is not None:
            segment_ids = constrain(segment_ids, ("activation_batch", "activation_length"))
        # Grouped-query attention: query head i reads kv head i // (N / K). Softmax in float32.
        if self.decode:
            out = self._attend_cached(q, key, value, index, kv_names)
        elif self.attend is not None:  # a fused kernel: no [B, N, T, T] scores kept
            out = self.attend(q, key, value, segment_ids)  # [B, T, N, H]
        else:
            out = causal_attention(q, key, value, self.chunk, segment_ids)  # [B, T, N, H]
        out = constrain(out, heads_names)
        y = Dense(
            (d_model,), ("heads", "kv", "embed"), contract=2, init_std=self.out_std, dtype=self.dtype,
            dot_general=self.dot_general, grad_dtype=self.grad_dtype, placer=self.placer, name="out",
        )(out)  # [B, T, N, H] -> [B, T, D]
        # Named after the output projection, as MaxText's "out_proj": kept (remat=save_attn_mlp),
        # the backward rebuilds the residual stream with an add, without re-running this matmul
        # or its tensor all-reduce; the kernel's own output would not spare the recomputation of
        # q, k, v and the scores, which the attention's backward needs anyway.
        return checkpoint_name(y, ATTN_OUT)

    def _attend_cached(self, q: jax.Array, key: jax.Array, value: jax.Array, index: Any,
                       kv_names: tuple[str, ...]) -> jax.Array:
        """q [B, T, N, H], this call's key and value [B, T, K, H] -> [B, T, N, H] over the cache.
        At init the cache is made with this call's shape (its S is the init's T) and left empty."""
        # Boxed with logical names, so that the caller reads the cache's shardings off its init.
        init = nn.with_logical_partitioning(lambda: jnp.zeros(key.shape, key.dtype), kv_names)
        cached_key, cached_value = self.variable("cache", "key", init), self.variable("cache", "value", init)
        if self.is_initializing():
            return causal_attention(q, key, value)
        start = index.value
        t, s = q.shape[1], cached_key.value.shape[1]
        # The caller keeps start + T <= S: dynamic_update_slice would clamp the start silently.
        cached_key.value = constrain(jax.lax.dynamic_update_slice(cached_key.value, key, (0, start, 0, 0)), kv_names)
        cached_value.value = constrain(jax.lax.dynamic_update_slice(cached_value.value, value, (0, start, 0, 0)),
                                       kv_names)
        index.value = start + t
        # query i (position start + i) sees cached keys 0..start + i; later slots are empty or stale
        mask = (jnp.arange(s)[None, :] <= start + jnp.arange(t)[:, None])[None, None]  # [1, 1, T, S]
        return jax.nn.dot_product_attention(q, cached_key.value, cached_value.value, mask=mask)
