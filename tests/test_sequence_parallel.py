"""Megatron sequence parallelism (`parallel.sequence_parallel`): the residual stream [B, T, D] is
sharded over `tensor` on T between the tensor-parallel regions.

- Layout never changes the math: loss and gradients with sequence parallelism equal one device
  and the same mesh without it (dense, tensor 2 and 4, GPipe, 1F1B, ZeRO-3 with remat, MoE, FP8).
- The compiled step: per block 2 all-gathers of the norm outputs before the column-parallel
  matmuls, and each row-parallel partial sum reduced at full T then sliced to this device's T
  shard (XLA:CPU has no reduce-scatter creator; GPU/TPU fuse the pair into a reduce-scatter);
  pipeline sends carry 1/t of the bytes; remat=full keeps 1/t block inputs.
- The cost model explains every collective of SP layouts and their memory (tolerances as
  tests/test_cost_validation.py); on accelerators its tensor terms are reduce-scatter + all-gather.
- Bad settings are one-line config errors naming the field.
"""

import dataclasses
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from parallax.analysis.audit import FAST_COMPILE, audit, compile_step

from parallax.analysis.hlo import collectives
from parallax import parallelism
from parallax.config import (Config, ConfigError, Fp8Config, MeshConfig, ModelConfig, MoEConfig, OptimConfig,
                             ParallelConfig, TrainConfig)
from parallax.analysis.collectives import collective_terms
from parallax.analysis.cost import Grid, Workload
from parallax.parallel.mesh import available_devices, make_mesh
from parallax.parallel.pipeline import to_layer_major
from parallax.analysis.plan import candidates
from parallax.parallel.sharding import DEFAULT_RULES, compute_rules
from parallax.cli import main
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_grad_fn, make_train_step
from numerics import assert_trees_close

# Same tolerances as tests/test_equivalence.py (BUILD_NOTES.md): fp32, reduction order differs.
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-4, 1e-6
COLLECTIVE_TOL, MEMORY_TOL = 0.005, 0.15  # as tests/test_cost_validation.py

MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256)
B, T = 16, 32
BASE = Config(model=MODEL, optim=OptimConfig(warmup_steps=1), train=TrainConfig(global_batch=B, seq_len=T, lr=1e-3, seed=5))
SP = ParallelConfig(sequence_parallel=True)


def _batch(mesh, seq_len=T):
    rows = np.random.default_rng(0).integers(0, 256, (B, seq_len + 1)).astype(np.int32)
    return jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))


def _loss_grads(cfg, devices=None):
    mesh = make_mesh(cfg.mesh, devices)
    parallelism.check(cfg, dict(mesh.shape))
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    loss, grads = make_grad_fn(layout)(state.params, _batch(mesh, cfg.train.seq_len))
    grads = dict(grads)
    if layout.schedule is not None:
        grads["layers"] = to_layer_major(grads["layers"], layout.schedule.units)
    return float(loss), jax.tree.map(np.asarray, grads)


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=LOSS_RTOL)
    assert_trees_close(got[1], want[1], GRAD_RTOL, GRAD_ATOL)


# ----------------------------------------------------------------------------------------------
# Equivalence


@pytest.fixture(scope="module")
def reference():
    return _loss_grads(dataclasses.replace(BASE, mesh=MeshConfig(data=1)), available_devices(1))


CASES = {
    "data2_tensor4": (MeshConfig(data=2, tensor=4), SP),
    "gpipe_data2_tensor2_pipe2": (MeshConfig(data=2, tensor=2, pipe=2), dataclasses.replace(SP, microbatches=4)),
    "1f1b_data2_tensor2_pipe2": (MeshConfig(data=2, tensor=2, pipe=2),
                                 dataclasses.replace(SP, microbatches=4, schedule="1f1b")),
    "data4_tensor2_zero3_full": (MeshConfig(data=4, tensor=2), dataclasses.replace(SP, zero=3, remat="full")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_matches_one_device(reference, case):
    mesh, parallel = CASES[case]
    _assert_same(_loss_grads(dataclasses.replace(BASE, mesh=mesh, parallel=parallel)), reference)


# parallel.sequence_parallel_dim='embed': the residual stream's D over tensor, for a T that is no
# multiple of it (T 30 on tensor 4), against one device at the same T; with 1F1B the D-sharded
# residual is what the stages send
SP_EMBED = dataclasses.replace(SP, sequence_parallel_dim="embed")
EMBED_CASES = {
    "data2_tensor4": (MeshConfig(data=2, tensor=4), SP_EMBED),
    "1f1b_data2_tensor2_pipe2_zero3": (MeshConfig(data=2, tensor=2, pipe=2),
                                       dataclasses.replace(SP_EMBED, microbatches=4, schedule="1f1b", zero=3)),
}
T_ODD = 30


@pytest.fixture(scope="module")
def reference_odd_t():
    cfg = dataclasses.replace(BASE, mesh=MeshConfig(data=1), train=dataclasses.replace(BASE.train, seq_len=T_ODD))
    return _loss_grads(cfg, available_devices(1))


@pytest.mark.parametrize("case", list(EMBED_CASES))
def test_sequence_parallel_on_embed_matches_one_device_where_t_is_no_multiple_of_tensor(reference_odd_t, case):
    mesh, parallel = EMBED_CASES[case]
    cfg = dataclasses.replace(BASE, mesh=mesh, parallel=parallel, train=dataclasses.replace(BASE.train, seq_len=T_ODD))
    _assert_same(_loss_grads(cfg), reference_odd_t)


@pytest.mark.parametrize("dim", ["length", "embed"])
def test_moe_routing_and_gradients_match_one_device(dim):
    """The MoE layer reads the gathered (full-T, full-D) norm output: routing is per sequence, so
    which tokens drop (capacity factor 1.0) and every gradient are one device's."""
    moe = dataclasses.replace(MODEL, moe=MoEConfig(num_experts=4, top_k=2, every=2, capacity_factor=1.0, shared_experts=1))
    cfg = dataclasses.replace(BASE, model=moe)
    got = _loss_grads(dataclasses.replace(cfg, mesh=MeshConfig(data=2, tensor=2, expert=2),
                                          parallel=dataclasses.replace(SP, sequence_parallel_dim=dim)))
    _assert_same(got, _loss_grads(dataclasses.replace(cfg, mesh=MeshConfig(data=1)), available_devices(1)))


def test_fp8_zero1_steps_match_one_device():
    """FP8 amaxes are global maxima whatever the layout: after 3 steps with ZeRO-1 (non-zero amax
    histories, scales off 1) the losses, parameters and every FP8 scale and history equal one
    device's. Adam's eps is 1e-2 as in tests/test_fp8_pipeline.py, so that reduction-order
    differences in near-zero gradients are not normalised up to +-lr."""
    cfg = dataclasses.replace(BASE, fp8=Fp8Config(enabled=True, amax_history_length=4),
                              optim=dataclasses.replace(BASE.optim, eps=1e-2))
    out = []
    for mesh_cfg, parallel in ((MeshConfig(data=1), ParallelConfig()), (MeshConfig(data=4, tensor=2), dataclasses.replace(SP, zero=1))):
        c = dataclasses.replace(cfg, mesh=mesh_cfg, parallel=parallel)
        mesh = make_mesh(c.mesh, available_devices(mesh_cfg.data * mesh_cfg.tensor))
        layout = make_layout(c, mesh)
        state, step, losses = init_state(c, layout), make_train_step(c, layout), []
        for _ in range(3):
            state, metrics = step(state, _batch(mesh))
            losses.append(float(metrics["loss"]))
        out.append((losses, jax.tree.map(np.asarray, (state.params, state.fp8))))
    np.testing.assert_allclose(out[1][0], out[0][0], rtol=LOSS_RTOL)
    assert_trees_close(out[1][1], out[0][1], 1e-5, 1e-7)
    scales = [x for p, x in jax.tree_util.tree_leaves_with_path(out[1][1][1]) if "_scale" in jax.tree_util.keystr(p)]
    assert scales and all(np.all(s < 0.5) for s in scales)  # not the initial 1: the comparison bites


# ----------------------------------------------------------------------------------------------
# The compiled step (tests/test_audit.py's model and mesh, data=4 x tensor=2)

AUDIT_MODEL = ModelConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256)
AUDIT_B, DATA, TENSOR = 8, 4, 2
ACT = (AUDIT_B // DATA) * T * AUDIT_MODEL.d_model * 4  # one [B/data, T, D] fp32 buffer
# tests/test_cost_validation.py's pipelined model and mesh
PIPE_MODEL = ModelConfig(d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=192, vocab_size=320)

LAYOUTS = {
    "sp_d4_t2": Config(mesh=MeshConfig(data=DATA, tensor=TENSOR), model=AUDIT_MODEL, parallel=SP,
                       train=TrainConfig(global_batch=AUDIT_B, seq_len=T)),
    "sp_gpipe_d2_t2_p2": Config(mesh=MeshConfig(data=2, tensor=2, pipe=2), model=PIPE_MODEL,
                                parallel=dataclasses.replace(SP, microbatches=4), train=TrainConfig(global_batch=16, seq_len=T)),
    # D sharded, at a T (30) tensor 4 does not divide
    "sp_embed_d2_t4": Config(mesh=MeshConfig(data=2, tensor=4), model=dataclasses.replace(AUDIT_MODEL, n_kv_heads=4),
                             parallel=SP_EMBED,
                             train=TrainConfig(global_batch=AUDIT_B, seq_len=T_ODD)),
}


def _forward_loop(found):
    return [c for c in found if c.in_loop and "transpose(" not in c.op_name and c.axes == ("tensor",)]


def _backward_loop(found):
    return [c for c in found if c.in_loop and "transpose(" in c.op_name and c.axes == ("tensor",)]


@pytest.fixture(scope="module")
def sp_step():
    step = compile_step(LAYOUTS["sp_d4_t2"], FAST_COMPILE)  # shared with the cost-model test below
    return step, collectives(step.hlo, step.mesh_shape)


def _consumer_shapes(hlo: str, name: str) -> list[str]:
    """Result shapes of the instructions that take `%name` as an operand."""
    uses = re.compile(rf"%{re.escape(name)}[,)]")
    return [m.group(1) for line in hlo.splitlines() if uses.search(line) and not line.strip().startswith(f"%{name} ")
            for m in [re.match(r"\s*(?:ROOT )?%\S+ = (\w+\[[\d,]*\])", line)] if m]


def test_per_block_two_gathers_and_two_sliced_reductions_each_way(sp_step):
    step, found = sp_step
    layers = AUDIT_MODEL.n_layers
    shard = f"f32[{AUDIT_B // DATA},{T // TENSOR},{AUDIT_MODEL.d_model}]"
    for loop in (_forward_loop(found), _backward_loop(found)):
        big = [c for c in loop if c.bytes == ACT]
        assert sorted(c.kind for c in big) == ["all-gather"] * 2 + ["all-reduce"] * 2, loop
        assert all(c.executions == layers for c in big), big
        # The reduce-scatter pattern: no consumer of a reduced partial sum sees more than this
        # device's [B/d, T/t, D] slice (fused slices; the norm scale's [D] gradient sums over it).
        for c in big:
            if c.kind == "all-reduce":
                shapes = _consumer_shapes(step.hlo, c.name)
                assert shard in shapes and set(shapes) <= {shard, f"f32[{AUDIT_MODEL.d_model}]"}, (c.name, shapes)
        # nothing else of activation size; the norm scales' partial sums (2 D floats) backward only
        small = [c for c in loop if c.bytes != ACT]
        assert all(c.kind == "all-reduce" and c.bytes <= 2 * AUDIT_MODEL.d_model * 4 for c in small), small
    assert [c.bytes for c in _backward_loop(found) if c.bytes != ACT] == [2 * AUDIT_MODEL.d_model * 4]
    # the loss head gathers the final norm's output; the embedding's table gradient its cotangent
    outside = [c for c in found if not c.in_loop and c.axes == ("tensor",) and c.kind == "all-gather"]
    assert sorted(c.bytes for c in outside) == [ACT, ACT], outside


def _block_terms(grid: Grid, kind: str) -> list:
    """The model's per-block tensor collectives of `kind` that run (accelerator platform)."""
    names = ("block forward", "block backward", "sequence-parallel norm gathers", "sequence-parallel cotangent")
    return [x for x in collective_terms(Workload(AUDIT_MODEL, AUDIT_B, T), grid)
            if x.what.startswith(names) and x.kind == kind and float(np.sum(x.executions)) > 0]


def _ring_bytes(terms: list, factor: float) -> float:
    return sum(float(x.bytes * x.executions) * factor for x in terms)


def test_the_accelerator_model_reduce_scatters_with_the_same_wire_bytes():
    """On GPU/TPU the all-reduce + slice becomes a reduce-scatter (result 1/t): per block the
    Megatron all-reduces are gone and the ring traffic, (t-1)/t S each for the reduce-scatter and
    the all-gather, equals the all-reduce's 2(t-1)/t S."""
    on, t = Grid(data=DATA, tensor=TENSOR, sequence=1), TENSOR
    rs, ag = _block_terms(on, "reduce-scatter"), _block_terms(on, "all-gather")
    assert not _block_terms(on, "all-reduce")
    assert all(float(x.bytes) == ACT / t for x in rs) and all(float(x.bytes) == ACT for x in ag)
    assert sum(float(x.executions) for x in rs) == sum(float(x.executions) for x in ag) == 4 * AUDIT_MODEL.n_layers
    off = _block_terms(Grid(data=DATA, tensor=TENSOR), "all-reduce")
    assert _ring_bytes(rs, t - 1) + _ring_bytes(ag, (t - 1) / t) == pytest.approx(_ring_bytes(off, 2 * (t - 1) / t))


def test_pipeline_sends_carry_a_tensor_shard():
    step = compile_step(LAYOUTS["sp_gpipe_d2_t2_p2"], FAST_COMPILE)
    found = collectives(step.hlo, step.mesh_shape)
    permutes = [c for c in found if c.kind == "collective-permute"]
    half_micro = (16 // 2 // 4 // 2) * T * PIPE_MODEL.d_model * 4  # [B/(data M 2), T, D] fp32
    # T/tensor of it, sent along GPipe's chain: 1 of the 2 stages sends (bytes averaged over the devices)
    assert len(permutes) == 4 and all(c.axes == ("pipe",) and c.bytes == half_micro // 4 for c in permutes), permutes


def test_remat_full_keeps_block_inputs_sharded():
    """remat=full saves only each block's input, stacked over the layers by the scan: under
    sequence parallelism that stack is [L, B/d, T/t, D], and XLA's temporaries fall."""
    full = {sp: dataclasses.replace(LAYOUTS["sp_d4_t2"], parallel=ParallelConfig(remat="full", sequence_parallel=sp))
            for sp in (False, True)}
    steps = {sp: compile_step(cfg, FAST_COMPILE) for sp, cfg in full.items()}
    b, d, n = AUDIT_B // DATA, AUDIT_MODEL.d_model, AUDIT_MODEL.n_layers
    whole, sharded = f"f32[{n},{b},{T},{d}]", f"f32[{n},{b},{T // TENSOR},{d}]"
    assert whole in steps[False].hlo and whole not in steps[True].hlo and sharded in steps[True].hlo
    assert steps[True].memory["temp"] < steps[False].memory["temp"], {sp: s.memory for sp, s in steps.items()}


def test_remat_full_keeps_block_inputs_sharded_on_embed_at_any_t():
    """D-sharded sequence parallelism at T 30 on tensor 4: the saved block inputs are
    [L, B/d, T, D/t], and the temporaries are under the same layout's without it, at T 32."""
    cfg = dataclasses.replace(LAYOUTS["sp_embed_d2_t4"], parallel=dataclasses.replace(SP_EMBED, remat="full"))
    off = dataclasses.replace(cfg, parallel=ParallelConfig(remat="full"), train=dataclasses.replace(cfg.train, seq_len=T))
    on_step, off_step = compile_step(cfg, FAST_COMPILE), compile_step(off, FAST_COMPILE)
    b, d, n = AUDIT_B // 2, AUDIT_MODEL.d_model, AUDIT_MODEL.n_layers
    assert f"f32[{n},{b},{T_ODD},{d // 4}]" in on_step.hlo and f"f32[{n},{b},{T_ODD},{d}]" not in on_step.hlo
    assert f"f32[{n},{b},{T},{d}]" in off_step.hlo
    assert on_step.memory["temp"] < off_step.memory["temp"], (on_step.memory, off_step.memory)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cost_model_explains_the_compiled_step(name):
    a = audit(LAYOUTS[name], FAST_COMPILE)
    assert all(r["explained"] for r in a["collectives"]), [r for r in a["collectives"] if not r["explained"]]
    for axis, totals in a["axes"].items():
        assert totals["model_bytes"] > 0 and abs(totals["error"]) <= COLLECTIVE_TOL, (name, axis, totals)
    assert abs(a["memory"]["error"]) <= MEMORY_TOL, (name, a["memory"])


# ----------------------------------------------------------------------------------------------
# Rules, config, planner


def test_compute_rules_shard_only_the_residual_length():
    assert compute_rules(ParallelConfig()) == DEFAULT_RULES
    on = dict(compute_rules(SP))
    assert on.pop("activation_norm_length") == "tensor" and dict(DEFAULT_RULES).pop("activation_norm_length") is None
    assert on == {k: v for k, v in DEFAULT_RULES if k != "activation_norm_length"}


def test_compute_rules_on_embed_shard_only_the_residual_embed():
    on = dict(compute_rules(SP_EMBED))
    assert on.pop("activation_norm_embed") == "tensor" and dict(DEFAULT_RULES).pop("activation_norm_embed") is None
    assert on == {k: v for k, v in DEFAULT_RULES if k != "activation_norm_embed"}


def test_embed_takes_any_t_and_the_dim_is_checked():
    sizes = {"data": 2, "tensor": 4, "pipe": 1, "expert": 1}
    odd_t = dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, seq_len=30))
    parallelism.check(dataclasses.replace(odd_t, parallel=SP_EMBED), sizes)  # T 30: D 64 takes it
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: train\.seq_len=30 .*sequence_parallel_dim='embed'"):
        parallelism.check(dataclasses.replace(odd_t, parallel=SP), sizes)
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel_dim.*'seq'"):
        parallelism.check(dataclasses.replace(odd_t, parallel=dataclasses.replace(SP, sequence_parallel_dim="seq")),
                          sizes)


def test_the_planner_shards_d_where_tensor_does_not_divide_t():
    """The planner's sequence-parallel layouts shard T where tensor divides it and D elsewhere
    (layout field 2), and a planned row round-trips through layout_config."""
    from parallax.analysis.plan import _row, evaluate, layout_config
    from parallax.analysis.presets import DEVICES

    w = Workload(MODEL, 8, 30)
    g = candidates(w, 8)
    t, sp = np.asarray(g.tensor), np.asarray(g.sequence)
    assert set(sp[(t == 2) & (sp > 0)]) == {1} and set(sp[(t >= 4) & (sp > 0)]) == {2}  # 30 = 2 x 15
    i = int(np.nonzero(sp == 2)[0][0])
    row = _row(g, evaluate(w, g, DEVICES["h100"], 8), i)
    assert row["sequence_parallel"] and row["sequence_parallel_dim"] == "embed"
    cfg = layout_config(BASE, row)
    assert cfg.parallel.sequence_parallel_dim == "embed" and Grid.of(cfg, row).sequence == 2


def test_seq_len_must_divide_by_tensor_and_tensor_1_is_a_no_op():
    cfg = dataclasses.replace(BASE, parallel=SP, train=dataclasses.replace(BASE.train, seq_len=30))
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel.*train\.seq_len=30.*mesh\.tensor=4"):
        parallelism.check(cfg, {"data": 2, "tensor": 4, "pipe": 1, "expert": 1})
    parallelism.check(cfg, {"data": 8, "tensor": 1, "pipe": 1, "expert": 1})


def test_cli_bad_seq_len_is_one_line_exit_2(tmp_path, capsys):
    quickstart = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.py"
    sets = ["mesh.data=4", "mesh.tensor=2", "parallel.sequence_parallel=true", "train.seq_len=15", "model.d_model=32",
            "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64", "train.global_batch=8"]
    rc = main(["train", str(quickstart), *[a for s in sets for a in ("--set", s)], "--workdir", str(tmp_path / "wd")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("parallax: error: parallel.sequence_parallel") and "train.seq_len=15" in err, err
    assert not (tmp_path / "wd").exists()


def test_grid_reads_the_config_and_the_planner_searches_it():
    cfg = LAYOUTS["sp_d4_t2"]
    assert Grid.of(cfg, {"data": 4, "tensor": 2, "pipe": 1, "expert": 1}).sequence == 1
    assert Grid.of(dataclasses.replace(cfg, parallel=ParallelConfig()), {"data": 4, "tensor": 2, "pipe": 1, "expert": 1}).sequence == 0
    g = candidates(Workload(AUDIT_MODEL, 8, T), 8)
    t, sp = np.asarray(g.tensor), np.asarray(g.sequence)
    # every tensor > 1 layout both ways; tensor = 1 has nothing to shard
    assert sp[t > 1].sum() * 2 == (t > 1).sum() and not sp[t == 1].any()
    assert not np.any(candidates(Workload(AUDIT_MODEL, 8, T), 8, sequence=(0,)).sequence)
