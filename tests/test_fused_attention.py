"""Fused attention (issue 17): model.attention resolved per platform, the splash kernel's numerics
on CPU (Pallas interpret mode) against XLA's attention, the kernels in the programs compiled for
a TPU and a GPU target, and what is refused in one line.

Numerics, float32 (interpret mode runs the kernel's own blocked program with XLA ops, so the
online softmax sums in another order than XLA's one-pass softmax): the kernel against
attention.causal_attention, grouped-query (4 query heads on 2 kv heads), with and without packed
documents, outputs rtol/atol 1e-5 and gradients within 1e-5 of each leaf's largest magnitude
(+1e-7); the train step's loss and gradients with splash injected, under the mesh (the shard_map
over the batch axes and tensor, nested in pipeline stages), against the same step with XLA's
attention: loss rtol 1e-5, gradients 1e-4 of leaf max (+1e-7). Measured errors: BUILD_NOTES.md.

Compile-only targets (one compile per layout, tiny shapes; T = 256 is twice D = 128, so a
[b, n, T, T] buffer cannot be mistaken for an activation): v5e-8 data 4 x tensor 2 with sequence
parallelism and packed documents, and data 2 x tensor 2 x pipe 2 (GPipe) packed: splash's
forward, dq and dkv kernels; h100-8 data 4 x tensor 2: cuDNN's forward and backward calls (and
the packed form with sequence parallelism). None holds a per-head [T, T] buffer.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.analysis.audit import FAST_COMPILE, audit, compile_step
from parallax.cli import main
from parallax.config import Config, ConfigError, DataConfig, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
from parallax.model.attention import causal_attention
from parallax.model.kernels import splash_attention, splash_block
from parallax.parallel.fused_attention import FusedAttention
from parallax.parallelism import Parallelism, attention_kernel
from parallax.train.build import build
from parallax.train.data import split_batch
from parallax.train.train_state import init_state, make_model
from parallax.train.train_step import make_grad_fn
from numerics import assert_trees_close
from test_cli import QUICKSTART, TINY, _assert_one_error_line, _make_workdir, _sets, _snapshot
from test_targets import _refused, cuda_plugin, experiment, libtpu  # noqa: F401 (fixtures)

OUT_TOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
STEP_LOSS_RTOL, STEP_GRAD_RTOL = 1e-5, 1e-4


# ----------------------------------------------------------------------------------------------
# model.attention: which kernel runs where


def _cfg(attention="auto", dtype="bfloat16", seq_len=256, chunk=0, d_model=128, n_heads=4):
    return Config(model=ModelConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=2, dtype=dtype, attention=attention),
                  parallel=ParallelConfig(attention_chunk=chunk), train=TrainConfig(global_batch=8, seq_len=seq_len))


@pytest.mark.parametrize("cfg, platform, kernel", [
    (_cfg(), "cpu", "xla"), (_cfg(), "gpu", "cudnn"), (_cfg(), "tpu", "splash"),
    (_cfg(dtype="float32"), "gpu", "xla"),  # cuDNN takes bf16 only: auto keeps XLA
    (_cfg(dtype="float32"), "tpu", "splash"),
    (_cfg(seq_len=64), "tpu", "xla"),  # splash's blocks are multiples of 128
    (_cfg(chunk=64), "tpu", "xla"), (_cfg(chunk=64), "gpu", "xla"),  # attention_chunk asks for XLA's blocks
    (_cfg(d_model=120), "gpu", "xla"),  # head dim 30: not a multiple of 8
    (_cfg("xla"), "tpu", "xla"), (_cfg("splash"), "tpu", "splash"), (_cfg("cudnn"), "gpu", "cudnn"),
])
def test_attention_kernel_per_platform(cfg, platform, kernel):
    assert attention_kernel(cfg, platform) == kernel
    assert Parallelism.of(cfg, {"data": 8, "tensor": 1, "pipe": 1, "expert": 1}, platform).attention == kernel


def test_quickstart_on_cpu_keeps_xlas_attention():
    """auto on CPU injects nothing: the model is the one before model.attention existed."""
    b = build(Config(train=TrainConfig(global_batch=8, seq_len=128)), jax.devices()[:1])
    assert b.parallelism.attention == "xla" and b.layout.model.attend is None


@pytest.mark.parametrize("t, h, block", [(128, 64, 128), (256, 128, 256), (768, 128, 256), (4096, 128, 512),
                                         (8192, 256, 256)])
def test_splash_block_from_t_and_head_dim(t, h, block):
    assert splash_block(t, h) == block


# ----------------------------------------------------------------------------------------------
# Splash on CPU, Pallas interpret mode, against XLA's attention

B, T, N, K, H = 2, 256, 4, 2, 32


def _qkv(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, T, K, H)),
            jax.random.normal(ks[2], (B, T, K, H)), jax.random.normal(ks[3], (B, T, N, H)))


def _segments() -> np.ndarray:
    """Row 0: documents of 100, 100 and 56 tokens (boundaries inside the kernel's 128 blocks);
    row 1: one-token documents first, then one long one."""
    seg = np.zeros((B, T), np.int32)
    seg[0, 100:200], seg[0, 200:] = 1, 2
    seg[1, 1], seg[1, 2:] = 1, 2
    return seg


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_splash_interpret_equals_xla_attention(packed):
    q, k, v, ct = _qkv()
    seg = jnp.asarray(_segments()) if packed else None

    def run(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(ct)

    got, got_g = jax.jit(lambda: run(lambda *a: splash_attention(*a, segment_ids=seg, interpret=True)))()
    want, want_g = jax.jit(lambda: run(lambda *a: causal_attention(*a, segment_ids=seg)))()
    np.testing.assert_allclose(got, want, rtol=OUT_TOL, atol=OUT_TOL)
    assert_trees_close(got_g, want_g, GRAD_RTOL, GRAD_ATOL)


def _packed_rows(t: int, v: int = 64, eod: int = 3, b: int = 8) -> np.ndarray:
    rows = np.random.default_rng(0).integers(eod + 1, v, (b, t + 1)).astype(np.int32)
    rows[0, [40, 100, 101]] = eod  # a one-token document between two others
    rows[3, 0] = eod
    rows[5, 1::37] = eod
    return rows


STEP_MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64)


@pytest.mark.parametrize("mesh, parallel", [
    (MeshConfig(data=4, tensor=2), ParallelConfig(sequence_parallel=True, remat="full")),
    (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(microbatches=2)),
], ids=["d4_t2_sp_remat_full", "gpipe_d2_t2_p2"])
def test_splash_step_under_the_mesh_equals_xla(mesh, parallel):
    """The jitted gradient step on 8 CPU devices, packed documents, with splash (interpret mode)
    injected as make_layout would inject it on a TPU: its shard_map over the batch axes and
    tensor, nested inside the pipeline's shard_map (manual over pipe and the batch axes), under
    remat. Against the same step with XLA's attention."""
    cfg = Config(mesh=mesh, model=STEP_MODEL, parallel=parallel, data=DataConfig(eod_id=3),
                 train=TrainConfig(global_batch=8, seq_len=128))
    out = []
    for attend in (None, FusedAttention("splash", interpret=True)):
        b = build(cfg, jax.devices(), model=make_model(cfg).clone(attend=attend))
        batch = jax.device_put(split_batch(_packed_rows(128), 3), b.batch_sharding)
        loss, grads = make_grad_fn(b.layout)(init_state(cfg, b.layout).params, batch)
        out.append((float(loss), jax.tree.map(np.asarray, grads)))
    (want, want_g), (got, got_g) = out
    np.testing.assert_allclose(got, want, rtol=STEP_LOSS_RTOL)
    assert_trees_close(got_g, want_g, STEP_GRAD_RTOL, GRAD_ATOL)
