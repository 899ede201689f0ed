"""Fused causal attention kernels on one device's block of heads: cuDNN flash attention (GPU) and
Pallas splash attention (TPU). Same contract as attention.causal_attention: q [B, T, N, H], k
and v [B, T, K, H] (grouped-query: query head i reads kv head i // (N / K)), `segment_ids`
[B, T] or None -> [B, T, N, H]. Neither keeps the [B, N, T, T] scores: the forward keeps one
float32 log-sum-exp per head and query, the backward recomputes the scores block by block.

Single-device math: no mesh axis is named here. Which kernel runs, and the shard_map that hands
each device its block (batch rows, heads), are parallel/fused_attention.py's.

- splash (jax.experimental.pallas.ops.tpu.splash_attention): the MHA kernel takes k and v as
  [K, T, H] and maps query head i to kv head i // (N / K) itself (no repeated kv heads); it runs
  per row (vmap over B) with the causal mask of every head as a static MultiHeadMask, and packed
  documents as its SegmentIds (q = kv = the row's segment ids: causal within a document, never
  across). It does not scale the logits: q is scaled by 1/sqrt(H) first, as MaxText does.
  `interpret`: Pallas' interpreter, which runs the kernel's program with XLA ops (the CPU tests).
- cudnn (jax.nn.dot_product_attention(implementation="cudnn")): the BTNH layout as the model
  has it, GQA native. Unpacked rows are its CAUSAL mask type (the masked half is never computed).
  Packed rows: jax 0.10.2's public call takes no segment ids; it takes per-row lengths
  (padding, not documents) and a boolean `mask`, which it turns into an additive bias. So
  packed documents go in as causal plus a [B, 1, T, T] same-document mask: cuDNN reads it as a
  bias broadcast over heads (one [T, T] per row, in the compute dtype, N times smaller than XLA's
  float32 scores per head and never differentiated), still with CAUSAL so the upper half is
  skipped. The lower-level packed layout (jax._src.cudnn's q_offsets / kv_offsets with [B, M]
  document lengths) is not used: it needs a static maximum document count M per row, and jax
  refuses it unless the process's default backend is a Hopper GPU, which a compile-only target
  on a CPU machine is not (BUILD_NOTES.md, "Fused attention").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def splash_block(t: int, h: int) -> int:
    """Query and key block of the splash kernel, forward and backward: the largest of 512, 256,
    128 that divides T (parallelism.SPLASH_MIN_BLOCK: T is a multiple of 128), at most 256 when
    H > 128 (a block's q, k, v tiles are [block, H] and its scores [block, block] float32 in
    VMEM: 512 x 512 x 4 = 1 MiB of scores beside 3 x 512 x 128 x 2 of tiles at H = 128).
    512 is MaxText's default block for its splash kernel (sa_block_q, sa_block_kv ...)."""
    cap = 512 if h <= 128 else 256
    for block in (512, 256, 128):
        if block <= cap and t % block == 0:
            return block
    raise ValueError(f"splash attention: T={t} is not a multiple of 128")  # parallelism.RULES refuses it first


def splash_block_sizes(t: int, h: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

    b = splash_block(t, h)
    return BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                      block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                     interpret: bool = False) -> jax.Array:
    """q [B, T, N, H], k, v [B, T, K, H], segment ids [B, T] or None -> [B, T, N, H]."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, n, h = q.shape
    mask = splash.MultiHeadMask([splash.CausalMask((t, t)) for _ in range(n)])
    kernel = splash.make_splash_mha(mask, block_sizes=splash_block_sizes(t, h), head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
    qh = (q * jnp.asarray(1 / math.sqrt(h), q.dtype)).swapaxes(1, 2)  # [B, T, N, H] -> [B, N, T, H]
    kh, vh = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, T, K, H] -> [B, K, T, H]
    if segment_ids is None:
        out = jax.vmap(lambda q_, k_, v_: kernel(q_, k_, v_))(qh, kh, vh)
    else:
        seg = segment_ids.astype(jnp.int32)
        out = jax.vmap(lambda q_, k_, v_, s: kernel(q_, k_, v_, segment_ids=splash.SegmentIds(s, s)))(qh, kh, vh, seg)
    return out.swapaxes(1, 2)  # [B, N, T, H] -> [B, T, N, H]


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """q [B, T, N, H], k, v [B, T, K, H] (bfloat16), segment ids [B, T] or None -> [B, T, N, H]."""
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]: same document
    return jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=True, implementation="cudnn")


KERNELS = {"splash": splash_attention, "cudnn": cudnn_attention}
