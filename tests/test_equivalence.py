"""Layout never changes the math: every mesh and ZeRO stage equals the single-device reference.

Same seed -> bit-identical initial parameters on every layout; loss and gradients at those
parameters within the fp32 tolerances recorded in BUILD_NOTES.md; and two full AdamW steps land
on the same parameters.
"""

import dataclasses

import jax
import numpy as np
import pytest

from parallax.config import Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from parallax.parallel.mesh import available_devices, make_mesh
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_grad_fn, make_train_step
from numerics import assert_trees_close

# fp32 everywhere; only the order of floating-point reductions differs between layouts.
LOSS_RTOL = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6  # relative to each gradient leaf's max magnitude, see _close
# after two AdamW steps at lr 1e-3: 2% of one step (Adam normalises tiny gradients, so a near-zero
# gradient's float32 reduction order moves its update: 1.14e-5 on data 2 x tensor 4 on an AVX-512
# EPYC, 2026-12-02, where the machine that set 1e-5 stayed under it)
PARAM_ATOL = 2e-5

BASE = Config(
    model=ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256),
    optim=OptimConfig(warmup_steps=1),  # step 0 runs at lr 0, step 1 at the full lr
    train=TrainConfig(global_batch=8, seq_len=32, lr=1e-3, seed=3),
)

LAYOUTS = {
    "data8": (MeshConfig(data=8), 0),
    "data2_tensor4": (MeshConfig(data=2, tensor=4), 0),
    "data4_tensor2": (MeshConfig(data=4, tensor=2), 0),
    "data4_tensor2_zero1": (MeshConfig(data=4, tensor=2), 1),
    "data4_tensor2_zero3": (MeshConfig(data=4, tensor=2), 3),
    "data8_zero3": (MeshConfig(data=8), 3),
}


def _config(mesh: MeshConfig, zero: int) -> Config:
    return dataclasses.replace(BASE, mesh=mesh, parallel=ParallelConfig(zero=zero))


def _batch(mesh):
    rows = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    return jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))


# The optimizer step is compiled for the layouts where it differs (sharded optimizer state);
# elsewhere it is the same elementwise update on the same gradients.
STEPPED = {"data4_tensor2_zero1", "data4_tensor2_zero3", "data2_tensor4"}


def _run(cfg: Config, devices=None, steps: int = 2):
    mesh = make_mesh(cfg.mesh, devices)
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    batch = _batch(mesh)
    params0 = jax.tree.map(np.asarray, state.params)
    loss, grads = make_grad_fn(layout)(state.params, batch)
    if steps:
        step = make_train_step(cfg, layout)
        for _ in range(steps):
            state, metrics = step(state, batch)
    return {
        "params0": params0,
        "loss": float(loss),
        "grads": jax.tree.map(np.asarray, grads),
        "params2": jax.tree.map(np.asarray, state.params),
        "state": state,
        "layout": layout,
    }


@pytest.fixture(scope="module")
def reference():
    cfg = _config(MeshConfig(data=1), 0)
    return _run(cfg, available_devices(1))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def sharded(request):
    mesh, zero = LAYOUTS[request.param]
    out = _run(_config(mesh, zero), steps=2 if request.param in STEPPED else 0)
    out["stepped"] = request.param in STEPPED
    return out


def test_initial_parameters_identical(reference, sharded):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sharded["params0"]), jax.tree.leaves(reference["params0"])):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_loss_and_gradients_match(reference, sharded):
    np.testing.assert_allclose(sharded["loss"], reference["loss"], rtol=LOSS_RTOL)
    assert_trees_close(sharded["grads"], reference["grads"], GRAD_RTOL, GRAD_ATOL)


def test_two_adamw_steps_match(reference, sharded):
    if not sharded["stepped"]:
        pytest.skip("optimizer step compiled only for the layouts in STEPPED")
    for (path, p), r in zip(jax.tree_util.tree_leaves_with_path(sharded["params2"]), jax.tree.leaves(reference["params2"])):
        np.testing.assert_allclose(p, r, atol=PARAM_ATOL, rtol=0, err_msg=jax.tree_util.keystr(path))
    moved = max(np.abs(p - q).max() for p, q in zip(jax.tree.leaves(sharded["params2"]), jax.tree.leaves(sharded["params0"])))
    assert moved > 1e-4  # the steps really updated the parameters


def test_state_lives_in_its_shardings(sharded):
    layout, state = sharded["layout"], sharded["state"]
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(layout.state_shardings)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)


def test_zero3_bf16_gathers_keep_loss_and_float32_gradients():
    """bfloat16 model: ZeRO-3 casts each weight on its shard and gathers it in bfloat16
    (logical.constrain_param); cast-then-gather equals gather-then-cast, and the gradients are
    reduced in float32. So loss and gradients equal ZeRO-0 on the same mesh (float32 gradients,
    same tolerances: only the reduction order differs)."""
    bf16 = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, dtype="bfloat16"))
    got = {}
    for zero in (0, 3):
        cfg = dataclasses.replace(bf16, mesh=MeshConfig(data=4, tensor=2), parallel=ParallelConfig(zero=zero))
        got[zero] = _run(cfg, steps=0)
    np.testing.assert_allclose(got[3]["loss"], got[0]["loss"], rtol=LOSS_RTOL)
    for path, g in jax.tree_util.tree_leaves_with_path(got[3]["grads"]):
        assert g.dtype == np.float32, jax.tree_util.keystr(path)
    assert_trees_close(got[3]["grads"], got[0]["grads"], GRAD_RTOL, GRAD_ATOL)
