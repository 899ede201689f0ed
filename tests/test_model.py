"""Model math: analytic counts match the built tree; remat and bf16 keep the numbers."""

import dataclasses

import jax
import numpy as np
import pytest

from parallax.config import Config, MeshConfig, ModelConfig, TrainConfig
from parallax.parallel.mesh import available_devices, make_mesh
from parallax.model.transformer import count_params, flops_per_token
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_grad_fn

MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=256)
CFG = Config(mesh=MeshConfig(data=1), model=MODEL, train=TrainConfig(global_batch=4, seq_len=16, seed=1))


@pytest.mark.parametrize("tie", [False, True])
def test_count_params_matches_the_tree(tie):
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(MODEL, tie_embeddings=tie))
    layout = make_layout(cfg, make_mesh(cfg.mesh, available_devices(1)))
    built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(layout.abstract_state.params))
    assert count_params(cfg.model)["total"] == built
    assert ("logits" in layout.abstract_state.params) == (not tie)


def test_flops_per_token_by_hand():
    # D=64, N=4, K=2, H=16, F=96, V=256, L=2, T=16
    attn = 64 * 16 * (2 * 4 + 2 * 2)  # q + out (N*H*D each), k + v (K*H*D each)
    mlp = 3 * 64 * 96
    n_matmul = 2 * (attn + mlp) + 64 * 256  # blocks + output projection
    assert flops_per_token(MODEL, 16) == 6 * n_matmul + 6 * 2 * 4 * 16 * 16


def _loss_and_grads(cfg):
    mesh = make_mesh(cfg.mesh, available_devices(1))
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    rows = np.random.default_rng(0).integers(0, 256, (4, 17)).astype(np.int32)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))
    loss, grads = make_grad_fn(layout)(state.params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def fp32_reference():
    return _loss_and_grads(CFG)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_memory_not_math(fp32_reference, remat):
    loss, grads = _loss_and_grads(dataclasses.replace(CFG, parallel=dataclasses.replace(CFG.parallel, remat=remat)))
    ref_loss, ref_grads = fp32_reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_bf16_compute_tracks_fp32(fp32_reference):
    loss, grads = _loss_and_grads(dataclasses.replace(CFG, model=dataclasses.replace(MODEL, dtype="bfloat16")))
    ref_loss, ref_grads = fp32_reference
    assert abs(loss - ref_loss) < 2e-2 * ref_loss  # bf16 has an 8-bit mantissa
    cos = [
        float(np.vdot(g, r) / (np.linalg.norm(g) * np.linalg.norm(r) + 1e-30))
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
    ]
    assert min(cos) > 0.99, cos
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))  # fp32 master weights
