"""The `save_attn_mlp` remat policies (model/transformer.REMAT_POLICIES): what they save, that
they change memory and not the math, and the host-offload variant (refused on XLA:CPU, compiled
for a compile-only TPU v5e-8, where the saved residuals move to host memory).

Compiles: 3 CPU steps on 8 simulated devices for the memory ordering (the save_attn_mlp one is
tests/test_cost_validation.py's "d8_save_attn_mlp": one compile when both run in one session),
3 single-device and 2 sharded gradient steps, and 2 TPU compiles of about 35 s each on 2 busy cores (libtpu:
under env CI a missing libtpu fails these tests instead of skipping them).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from parallax.analysis.audit import FAST_COMPILE, compile_step
from parallax.analysis.cost import Grid, Workload, memory_parts
from parallax.analysis.plan import candidates
from parallax.config import (Config, ConfigError, MeshConfig, ModelConfig, MoEConfig, ParallelConfig, TrainConfig,
                             UserError)
from parallax.model.logical import ATTN_OUT, MLP_WI, SAVED_ACTIVATIONS
from parallax.model.transformer import Block, remat_policy
from parallax.parallel.mesh import available_devices, make_mesh
from parallax.parallelism import REMATS, SAVE_ATTN_MLP, SAVE_ATTN_MLP_OFFLOAD, Parallelism, layout_fields, legal
from parallax.train.train_state import init_state, make_layout
from test_targets import libtpu  # noqa: F401 - the fixture: a failure under CI without libtpu
from parallax.train.train_step import batch_sharding, make_grad_fn

MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=256)
MOE_MODEL = dataclasses.replace(MODEL, moe=MoEConfig(num_experts=4, top_k=2, shared_experts=1))
TRAIN = TrainConfig(global_batch=8, seq_len=16, seed=1)
# float32: the policy only moves where values come from (saved or recomputed by the same ops)
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-7


def _with(cfg: Config, **parallel) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


# ----------------------------------------------------------------------------------------------
# What is saved


def _saved(capsys, model: ModelConfig, policy) -> list[str]:
    block = Block(model)
    x = jnp.ones((2, 16, model.d_model))
    params = block.init(jax.random.PRNGKey(0), x)

    def f(p, x):
        return jnp.sum(block.apply(p, x)[0] ** 2)

    capsys.readouterr()
    print_saved_residuals(jax.checkpoint(f, policy=policy), params, x)
    return [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]


@pytest.mark.parametrize("model", [MODEL, MOE_MODEL], ids=["dense", "moe"])
def test_the_policy_saves_exactly_the_attention_output_and_the_mlp_gate_up(capsys, model):
    lines = _saved(capsys, model, remat_policy("save_attn_mlp"))
    names = sorted(line.split("named '")[1].split("'")[0] for line in lines if "named '" in line)
    # everything saved is one of the two names (nothing else, not ZeRO-3's param_compute)
    assert len(names) == len(lines), lines
    if model.moe.num_experts:  # the experts' [E, B, C, 2, F] gate/up and the shared expert's [B, T, 2, F]
        assert names == [ATTN_OUT, MLP_WI, MLP_WI], lines
        assert any("[4,2," in line and MLP_WI in line for line in lines), lines
    else:
        assert names == [ATTN_OUT, MLP_WI], lines
    d = model.d_model
    assert any(f"f32[2,16,{d}] named '{ATTN_OUT}'" in line for line in lines), lines  # after the projection
    # ZeRO-3 (`pinned`): the same policy, which cannot save a gathered weight
    assert remat_policy("save_attn_mlp", pinned=True) is remat_policy("save_attn_mlp")
    assert set(SAVED_ACTIVATIONS) == {ATTN_OUT, MLP_WI}


def test_the_offload_policy_marks_the_same_names_for_host_memory(capsys):
    lines = _saved(capsys, MODEL, remat_policy("save_attn_mlp_offload"))
    assert len(lines) == 2 and all("<host>" in line for line in lines), lines


# ----------------------------------------------------------------------------------------------
# Same loss and gradients as remat none


def _loss_and_grads(cfg: Config, n_devices: int):
    mesh = make_mesh(cfg.mesh, available_devices(n_devices))
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    rows = np.random.default_rng(0).integers(0, 256, (cfg.train.global_batch, cfg.train.seq_len + 1)).astype(np.int32)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))
    loss, grads = make_grad_fn(layout)(state.params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("case", ["1dev_dense", "1dev_moe", "d2_t4", "d4_t2_zero3_sp", "circular_d2_p2_r2"])
def test_save_attn_mlp_gives_remat_none_loss_and_gradients(case):
    model, mesh, parallel = {
        "1dev_dense": (MODEL, MeshConfig(data=1), {}),
        "1dev_moe": (MOE_MODEL, MeshConfig(data=1), {}),
        "d2_t4": (dataclasses.replace(MODEL, n_kv_heads=4), MeshConfig(data=2, tensor=4), {}),
        "d4_t2_zero3_sp": (MODEL, MeshConfig(data=4, tensor=2), {"zero": 3, "sequence_parallel": True}),
        # the pipeline's own checkpoints (pipeline.stage_fn: each unit slices its weights inside)
        "circular_d2_p2_r2": (dataclasses.replace(MODEL, n_layers=4), MeshConfig(data=2, pipe=2),
                              {"microbatches": 2, "schedule": "circular", "repeats": 2}),
    }[case]
    cfg = Config(mesh=mesh, model=model, train=TRAIN, parallel=ParallelConfig(**parallel))
    n = mesh.data * mesh.tensor * mesh.pipe
    ref_loss, ref_grads = _loss_and_grads(cfg, n)
    loss, grads = _loss_and_grads(_with(cfg, remat="save_attn_mlp"), n)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_ATOL)


# ----------------------------------------------------------------------------------------------
# Compiled memory (XLA:CPU, 8 simulated devices)

# tests/test_cost_validation.py's "d8_save_attn_mlp" layout (same Config: one compile)
ORDER_MODEL = ModelConfig(d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=192, vocab_size=320)
ORDER_CFG = Config(mesh=MeshConfig(data=8), model=ORDER_MODEL, parallel=ParallelConfig(remat="save_attn_mlp"),
                   train=TrainConfig(global_batch=16, seq_len=128))


def test_compiled_temporaries_order_none_then_save_attn_mlp_then_full():
    """Measured on CPU (2026-12-01): temporaries none 14.28, save_attn_mlp 5.80, full 4.48 MiB."""
    temp = {r: compile_step(_with(ORDER_CFG, remat=r), FAST_COMPILE).memory["temp"]
            for r in ("none", "save_attn_mlp", "full")}
    assert temp["none"] > 2 * temp["save_attn_mlp"] and temp["save_attn_mlp"] > temp["full"], temp
    # the difference to `full` is the two names of every layer (cost model), within 10%
    w, g = Workload.of(ORDER_CFG), Grid.of(ORDER_CFG, dict(data=8, tensor=1, pipe=1, expert=1))
    names = (memory_parts(w, g, "cpu")["activations"]
             - memory_parts(w, dataclasses.replace(g, remat=REMATS.index("full")), "cpu")["activations"])
    assert abs((temp["save_attn_mlp"] - temp["full"]) / names - 1) < 0.1, (temp, names)


# ----------------------------------------------------------------------------------------------
# Host offload: refused on CPU, compiled for TPU


def test_offload_is_refused_on_cpu_in_one_line_naming_the_field():
    cfg = _with(Config(mesh=MeshConfig(data=1), model=MODEL, train=TRAIN), remat="save_attn_mlp_offload")
    sizes = dict(data=1, tensor=1, pipe=1, expert=1)
    with pytest.raises(ConfigError) as err:
        Parallelism.of(cfg, sizes, "cpu")
    message = str(err.value)
    assert isinstance(err.value, UserError)  # the CLI's exit 2
    assert message.startswith("parallel.remat='save_attn_mlp_offload'") and "\n" not in message, message
    assert "XLA:CPU" in message and "save_attn_mlp" in message
    for accelerator in ("tpu", "gpu", "accelerator"):
        assert Parallelism.of(cfg, sizes, accelerator).remat == "save_attn_mlp_offload"
    with pytest.raises(ConfigError, match="parallel.remat"):  # through the build on this machine's devices
        make_layout(cfg, make_mesh(cfg.mesh, available_devices(1)))
    # the vectorised form the planner filters with: only the offload, only on CPU
    grid = {**layout_fields(cfg, sizes), "remat": np.arange(len(REMATS))}
    assert legal(cfg, grid, "cpu").tolist() == [r != "save_attn_mlp_offload" for r in REMATS]
    assert legal(cfg, grid, "tpu").all()


# Big enough that the saved residuals (160 MiB per device) cannot sit in v5e's on-chip VMEM
# (memory space S(1), which memory_analysis does not count): smaller models showed no HBM effect.
TPU_MODEL = ModelConfig(d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256, dtype="bfloat16")
TPU_CFG = Config(name="offload_tpu", mesh=MeshConfig(data=4, tensor=2), model=TPU_MODEL,
                 train=TrainConfig(global_batch=64, seq_len=1024), parallel=ParallelConfig(attention_chunk=256))


def test_offload_on_a_tpu_target_moves_the_saved_names_to_host_memory(libtpu):
    """Compiled for v5e-8, not run (libtpu 0.0.42.1, 2026-12-01): device temporaries 299.9 MiB
    (save_attn_mlp) -> 124.8 MiB (offload), 160.0 MiB in pinned host memory."""
    steps = {r: compile_step(_with(TPU_CFG, remat=r), FAST_COMPILE, target="v5e-8")
             for r in ("save_attn_mlp", "save_attn_mlp_offload")}
    kept, moved = steps["save_attn_mlp"], steps["save_attn_mlp_offload"]
    # the offloaded stacks live in memory space 5 (host), written and read by async slices
    assert "S(5)" not in kept.hlo and "S(5)" in moved.hlo
    assert "dynamic-update-slice-start" in moved.hlo and "dynamic-slice-start" in moved.hlo
    # host memory: exactly what the cost model says is offloaded; device temporaries drop by more than half of it
    w, g = Workload.of(TPU_CFG), Grid.of(_with(TPU_CFG, remat="save_attn_mlp_offload"), moved.mesh_shape)
    host = float(memory_parts(w, g)["host"])
    assert kept.memory["host_temp"] == 0 and abs(moved.memory["host_temp"] / host - 1) < 0.01, (moved.memory, host)
    assert kept.memory["temp"] - moved.memory["temp"] > 0.5 * host, (kept.memory, moved.memory)


# ----------------------------------------------------------------------------------------------
# Cost model and planner


def test_cost_model_and_planner_know_both_policies():
    deep = dataclasses.replace(MODEL, n_layers=8)  # (2 layers: offload's in-flight pair exceeds 1 layer's names)
    w = Workload(deep, 64, 512)
    g = Grid(data=2, tensor=2)
    mem = {r: memory_parts(w, dataclasses.replace(g, remat=i)) for i, r in enumerate(REMATS)}
    acts = {r: float(m["activations"]) for r, m in mem.items()}
    assert acts["none"] > acts["save_attn_mlp"] > acts["save_attn_mlp_offload"] > acts["full"]
    # the offloaded bytes are every layer's names: on the host, not in the device total (which
    # counts the names of the layer whose backward runs once, in its working set)
    per_layer = (acts["save_attn_mlp"] - acts["full"]) / (deep.n_layers - 1)
    assert float(mem["save_attn_mlp_offload"]["host"]) == pytest.approx(deep.n_layers * per_layer)
    assert acts["save_attn_mlp_offload"] - acts["full"] == pytest.approx(2 * per_layer)  # in flight
    assert float(mem["save_attn_mlp"]["host"]) == 0
    assert float(mem["save_attn_mlp_offload"]["total"]) < float(mem["save_attn_mlp"]["total"])
    grid = candidates(w, 8)
    assert {SAVE_ATTN_MLP, SAVE_ATTN_MLP_OFFLOAD} <= set(np.asarray(grid.remat).tolist())
