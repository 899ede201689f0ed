"""Pipeline parallelism over `pipe`: the schedule table, the layer-major conversion, equivalence
with the single-device model (outputs and gradients), and the compiled collectives."""

import dataclasses

import jax
import numpy as np
import pytest

from parallax.analysis.hlo import collectives
from parallax import parallelism
from parallax.config import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from parallax.parallel.mesh import available_devices, make_mesh
from parallax.model.fp8_state import padding_value
from parallax.parallelism import Schedule
from parallax.parallel.pipeline import to_layer_major, to_stages, unit_mask
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_grad_fn, make_train_step
from numerics import assert_trees_close, bytes_per_device

MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256)
B, T = 16, 32
BASE = Config(model=MODEL, optim=OptimConfig(warmup_steps=1), train=TrainConfig(global_batch=B, seq_len=T, lr=1e-3, seed=5))
# Same tolerances as tests/test_equivalence.py (BUILD_NOTES.md): fp32, reduction order differs.
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-4, 1e-6


# ----------------------------------------------------------------------------------------------
# The schedule table


@pytest.mark.parametrize("p,m,r", [(2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 16, 1), (2, 4, 2), (4, 8, 2), (2, 2, 3)])
def test_schedule_runs_every_item_once_in_dependency_order(p, m, r):
    sched = Schedule(p, m, r, "circular" if r > 1 else "gpipe")
    when = {}
    for t in range(sched.ticks):
        for s in range(p):
            busy, i, rep = sched.work(t, s)
            if busy:
                assert (i, rep * p + s) not in when
                when[(i, rep * p + s)] = (t, s)
    assert len(when) == m * r * p  # every microbatch through every chunk, once
    for (i, v), (t, s) in when.items():
        if v > 0:  # chunk v-1 ran on the previous stage of the ring exactly one tick earlier
            assert when[(i, v - 1)] == (t - 1, (s - 1) % p)
    assert sched.bubble_fraction == pytest.approx(sched.formula())
    assert sched.idle_stage_ticks() == p * (p - 1)


# (the table schedules' tables: tests/test_schedules.py)


def test_stage_layout_is_a_reshape_of_the_layer_stack():
    sched = Schedule(stages=2, microbatches=4, repeats=2)
    layers = {"w": np.arange(8 * 3).reshape(8, 3)}  # L = 8 layers
    staged = to_stages(layers, sched)
    assert staged["w"].shape == (2, 2, 2, 3)  # [R, P, Lc, ...]
    # chunk v = rep * P + s holds layers v*Lc .. v*Lc + Lc - 1 and lives on stage s
    np.testing.assert_array_equal(staged["w"][1, 0], layers["w"][4:6])
    np.testing.assert_array_equal(staged["w"][0, 1], layers["w"][2:4])
    np.testing.assert_array_equal(to_layer_major(staged)["w"], layers["w"])


def test_uneven_stages_pad_the_end_of_the_stack():
    sched = Schedule(stages=2, microbatches=4, repeats=2, units=7)  # 7 layers in 4 chunks of 2
    assert (sched.chunk_units, sched.padding) == (2, 1)
    layers = {"w": np.arange(7 * 3, dtype=np.int32).reshape(7, 3) + 1}
    staged = to_stages(layers, sched)
    assert staged["w"].shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(staged["w"][1, 1, 1], 0)  # the last slot of the last chunk: padding
    np.testing.assert_array_equal(to_layer_major(staged, 7)["w"], layers["w"])
    # FP8 state pads with neutral constants (scale 1, empty history), never a copy of layer L-1's
    fp8 = {"input_scale": np.full((7, 1), 0.5, np.float32), "input_amax_history": np.ones((7, 4), np.float32)}
    staged = to_stages(fp8, sched, fill=padding_value)
    np.testing.assert_array_equal(staged["input_scale"][1, 1, 1], 1.0)
    np.testing.assert_array_equal(staged["input_amax_history"][1, 1, 1], 0.0)
    np.testing.assert_array_equal(staged["input_amax_history"][1, 1, 0], 1.0)
    masks = {(rep, s): np.asarray(unit_mask(sched, s, rep)).tolist() for rep in range(2) for s in range(2)}
    assert masks == {(0, 0): [True, True], (0, 1): [True, True], (1, 0): [True, True], (1, 1): [True, False]}
    assert unit_mask(Schedule(2, 4, 2, units=8), 1, 1) is None  # nothing padded, nothing masked


# ----------------------------------------------------------------------------------------------
# Equivalence with the single-device model


def _batch(mesh):
    rows = np.random.default_rng(0).integers(0, 256, (B, T + 1)).astype(np.int32)
    return jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))


def _loss_grads(cfg, devices=None):
    mesh = make_mesh(cfg.mesh, devices)
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    loss, grads = make_grad_fn(layout)(state.params, _batch(mesh))
    grads = dict(grads)
    if layout.schedule is not None:
        grads["layers"] = to_layer_major(grads["layers"])
    return float(loss), jax.tree.map(np.asarray, grads), layout, state


@pytest.fixture(scope="module")
def reference():
    return _loss_grads(dataclasses.replace(BASE, mesh=MeshConfig(data=1)), available_devices(1))


CASES = {
    "gpipe_d2_t2_p2": (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(microbatches=4)),
    "circular_r2_d2_t2_p2": (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(microbatches=4, schedule="circular", repeats=2)),
    "gpipe_p4_d2_zero1_remat": (MeshConfig(data=2, pipe=4), ParallelConfig(microbatches=4, zero=1, remat="full")),
    "gpipe_p2_d4_zero3": (MeshConfig(data=4, pipe=2), ParallelConfig(microbatches=2, zero=3)),
    "1f1b_d2_t2_p2": (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(microbatches=4, schedule="1f1b")),
    "1f1b_p4_d2_zero1": (MeshConfig(data=2, pipe=4), ParallelConfig(microbatches=4, schedule="1f1b", zero=1)),
    # ZeRO-3: each stage gathers its weights once per step and reduce-scatters their gradient once
    "1f1b_p2_d4_zero3": (MeshConfig(data=4, pipe=2), ParallelConfig(microbatches=2, schedule="1f1b", zero=3)),
    "1f1b_d2_t2_p2_zero3_remat": (MeshConfig(data=2, tensor=2, pipe=2),
                                  ParallelConfig(microbatches=4, schedule="1f1b", zero=3, remat="full")),
    # interleaved 1F1B with sequence parallelism (the T/t residual stream round the ring); ZB-H1
    # with ZeRO-3 (the W pass's gradients reduce-scattered once, as B's in 1F1B)
    "interleaved_r2_d2_t2_p2_sp": (MeshConfig(data=2, tensor=2, pipe=2),
                                   ParallelConfig(microbatches=2, schedule="interleaved_1f1b", repeats=2,
                                                  sequence_parallel=True)),
    "zb_h1_p2_d4_zero3": (MeshConfig(data=4, pipe=2), ParallelConfig(microbatches=2, schedule="zb_h1", zero=3)),
    # remat full: B one unit at a time (pipeline_1f1b.backward_by_unit), the chunk index dynamic
    "interleaved_r2_d4_p2_zero3_remat": (MeshConfig(data=4, pipe=2), ParallelConfig(
        microbatches=2, schedule="interleaved_1f1b", repeats=2, zero=3, remat="full")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_single_device(reference, case):
    mesh, parallel = CASES[case]
    loss, grads, layout, state = _loss_grads(dataclasses.replace(BASE, mesh=mesh, parallel=parallel))
    ref_loss, ref_grads, ref_layout, ref_state = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_trees_close(grads, ref_grads, GRAD_RTOL, GRAD_ATOL)
    # same seed, same weights: the stage layout is the plain initialisation reshaped
    np.testing.assert_array_equal(
        np.asarray(to_layer_major(state.params["layers"])["mlp"]["wo"]["kernel"]),
        np.asarray(ref_state.params["layers"]["mlp"]["wo"]["kernel"]),
    )


def test_each_stage_holds_only_its_layers(reference):
    mesh, parallel = CASES["gpipe_p4_d2_zero1_remat"]
    _, _, layout, state = _loss_grads(dataclasses.replace(BASE, mesh=mesh, parallel=parallel))
    staged, full = bytes_per_device(state.params["layers"]), bytes_per_device(reference[3].params["layers"])
    assert staged * 4 == full  # pipe = 4


# ----------------------------------------------------------------------------------------------
# The compiled step: one collective-permute per tick each way, the weight gradient reduced once


# (ZB-H1: its 3M + P - 1 unit ticks each send both ways; interleaved runs 1F1B's tick)
@pytest.fixture(scope="module", params=["gpipe", "1f1b", "zb_h1"])
def pipeline_hlo(request):
    parallel = ParallelConfig(microbatches=4, schedule=request.param)
    cfg = dataclasses.replace(BASE, mesh=MeshConfig(data=2, tensor=2, pipe=2), parallel=parallel)
    mesh = make_mesh(cfg.mesh)
    layout = make_layout(cfg, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), layout.abstract_state, layout.state_shardings)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=batch_sharding(mesh)) for k in ("inputs", "targets")}
    hlo = make_train_step(cfg, layout).lower(state, batch).compile().as_text()
    return collectives(hlo, dict(mesh.shape)), layout.schedule


def test_one_permute_per_tick_each_way(pipeline_hlo):
    found, sched = pipeline_hlo
    permutes = [c for c in found if c.kind == "collective-permute"]
    micro_bytes = (B // sched.microbatches // 2) * T * MODEL.d_model * 4  # [B/(M data), T, D] fp32
    assert all(c.axes == ("pipe",) and c.executions == sched.ticks for c in permutes), permutes
    # One chunk: along a chain, p - 1 of the p = 2 stages send (bytes averaged over the devices).
    if sched.name == "gpipe":  # two half-microbatch sends per tick, forward loop and its transpose
        assert len(permutes) == 4 and all(c.bytes == micro_bytes // 4 for c in permutes), permutes
    else:  # table schedules: activations forward and cotangents backward, both in the one loop, every tick
        assert len(permutes) == 2 and all(c.bytes == micro_bytes // 2 for c in permutes), permutes


def test_no_stage_weight_gathers_and_gradients_reduced_once(pipeline_hlo):
    found, sched = pipeline_hlo
    gathers = [c for c in found if c.kind == "all-gather"]
    if sched.name == "gpipe":
        assert not gathers, gathers
    else:  # only the table gradients, reduce-scattered over data before their sum over pipe and
        # gathered back after it for the update (pipeline_tables.reduce_table): embedding and head,
        # [V/tensor, D] float32 each, once per step
        tables = 2 * MODEL.vocab_size // 2 * MODEL.d_model * 4
        assert all(c.axes == ("data",) and not c.in_loop for c in gathers), gathers
        assert sum(c.bytes_per_step for c in gathers) == tables, gathers
        scattered = [c for c in found if c.kind == "reduce-scatter" and c.axes == ("data",)]
        assert sum(c.bytes_per_step for c in scattered) == tables // 2, scattered
    # over data: nothing inside the tick loop (it would run once per tick)
    assert not [c for c in found if "data" in c.axes and c.in_loop], [c for c in found if "data" in c.axes and c.in_loop]
    # over pipe outside the permutes: only after the loop (outputs / cotangents / head gradients)
    pipe_reduce = [c for c in found if "pipe" in c.axes and c.kind == "all-reduce"]
    assert pipe_reduce and not [c for c in pipe_reduce if c.in_loop]


def test_table_schedules_embed_per_microbatch(pipeline_hlo):
    """GPipe sums its stack output / input cotangents [B/data, T, D] over pipe; the table
    schedules embed each microbatch on stage 0 inside the tick loop, so no whole-batch activation
    is reduced over pipe (nor kept through the loop for it)."""
    found, sched = pipeline_hlo
    whole_batch = (B // 2) * T * MODEL.d_model * 4  # [B/data, T, D] fp32
    summed = [c for c in found if "pipe" in c.axes and c.kind == "all-reduce" and c.bytes == whole_batch]
    assert summed if sched.name == "gpipe" else not summed, summed


# ----------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("layers,mesh,parallel,field", [
    (6, MeshConfig(data=2, pipe=4), ParallelConfig(microbatches=4), "model.n_layers"),
    # uneven stages pad the stack, but not so far that a stage holds only padding
    (3, MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, schedule="circular", repeats=3), "model.n_layers"),
    (4, MeshConfig(data=2, pipe=4), ParallelConfig(microbatches=2), "parallel.microbatches"),
    (4, MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=3), "train.global_batch"),
    (4, MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, schedule="zigzag"), "parallel.schedule"),
    (4, MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, repeats=2), "parallel.repeats"),
    (4, MeshConfig(data=2, pipe=4), ParallelConfig(microbatches=6, schedule="circular"), "parallel.microbatches"),
    (4, MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, schedule="1f1b", repeats=2), "parallel.repeats"),
    (4, MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, schedule="zb_h1", repeats=2), "parallel.repeats"),
    # interleaved chunks visit microbatches in groups of P
    (8, MeshConfig(data=1, pipe=4), ParallelConfig(microbatches=6, schedule="interleaved_1f1b", repeats=2),
     "parallel.microbatches"),
])
def test_bad_pipeline_config_names_the_field(layers, mesh, parallel, field):
    cfg = dataclasses.replace(BASE, mesh=mesh, parallel=parallel, model=dataclasses.replace(MODEL, n_layers=layers))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parallelism.check(cfg, dataclasses.asdict(mesh))


def test_bf16_pipeline_is_refused_on_cpu():
    # XLA:CPU (jaxlib 0.10.2) aborts the whole process compiling a pipelined bf16 step (exit 134,
    # reproduced 2026-11-29); a clear refusal beats a crash.
    cfg = dataclasses.replace(
        BASE, mesh=MeshConfig(data=2, tensor=2, pipe=2), parallel=ParallelConfig(microbatches=2),
        model=dataclasses.replace(MODEL, dtype="bfloat16"),
    )
    with pytest.raises(ConfigError, match="bfloat16"):
        make_layout(cfg, make_mesh(cfg.mesh))


# ----------------------------------------------------------------------------------------------
# The grid the issue asks for: p in {2, 4}, m in {p, 2p, 4p}, r in {1, 2}, every schedule.
# A tiny model on data=1 x pipe=p keeps each compile to a few seconds.

GRID_MODEL = ModelConfig(d_model=16, n_layers=8, n_heads=2, n_kv_heads=2, d_ff=32, vocab_size=64)
GRID = dataclasses.replace(BASE, model=GRID_MODEL, train=TrainConfig(global_batch=16, seq_len=8, seed=7))


def _grid_loss_grads(cfg, devices=None, units=0):
    mesh = make_mesh(cfg.mesh, devices)
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    rows = np.random.default_rng(1).integers(0, 64, (16, 9)).astype(np.int32)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))
    loss, grads = make_grad_fn(layout)(state.params, batch)
    grads = dict(grads)
    if layout.schedule is not None:
        grads["layers"] = to_layer_major(grads["layers"], layout.schedule.units)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def grid_reference():
    return _grid_loss_grads(dataclasses.replace(GRID, mesh=MeshConfig(data=1)), available_devices(1))


@pytest.mark.parametrize("schedule,r", [("gpipe", 1), ("circular", 2), ("1f1b", 1)])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_schedule_grid_matches_single_device(grid_reference, schedule, r, p, factor):
    parallel = ParallelConfig(microbatches=factor * p, schedule=schedule, repeats=r)
    cfg = dataclasses.replace(GRID, mesh=MeshConfig(data=1, pipe=p), parallel=parallel)
    loss, grads = _grid_loss_grads(cfg, available_devices(p))
    ref_loss, ref_grads = grid_reference
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_trees_close(grads, ref_grads, GRAD_RTOL, GRAD_ATOL)


# Interleaved 1F1B (v = 2; v = 1 is the 1F1B above, the same table) and ZB-H1: p in {2, 4}, m in
# {p, 2p}, and 4p once. One compile each.
@pytest.mark.parametrize("schedule,r,p,m", [
    ("interleaved_1f1b", 2, 2, 2), ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 2, 2, 8),
    ("interleaved_1f1b", 2, 4, 4), ("interleaved_1f1b", 2, 4, 8),
    ("zb_h1", 1, 2, 2), ("zb_h1", 1, 2, 4), ("zb_h1", 1, 4, 4), ("zb_h1", 1, 4, 8),
])
def test_interleaved_and_zero_bubble_match_single_device(grid_reference, schedule, r, p, m):
    parallel = ParallelConfig(microbatches=m, schedule=schedule, repeats=r)
    cfg = dataclasses.replace(GRID, mesh=MeshConfig(data=1, pipe=p), parallel=parallel)
    _assert_matches(_grid_loss_grads(cfg, available_devices(p)), grid_reference)


def test_circular_under_remat_matches_single_device(grid_reference):
    """Each unit slices its weights inside its checkpoint (pipeline.stage_fn); `dots` takes the
    same path as `full` with another policy."""
    parallel = ParallelConfig(microbatches=4, schedule="circular", repeats=2, remat="full")
    cfg = dataclasses.replace(GRID, mesh=MeshConfig(data=1, pipe=2), parallel=parallel)
    _assert_matches(_grid_loss_grads(cfg, available_devices(2)), grid_reference)


def _assert_matches(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=LOSS_RTOL)
    assert_trees_close(got[1], ref[1], GRAD_RTOL, GRAD_ATOL)  # shapes too: padding slots dropped


# Uneven stages: 7 layers on 2 or 4 stages (or 2 x 2 chunks) pad the stack with one identity slot.
UNEVEN = dataclasses.replace(GRID, model=dataclasses.replace(GRID_MODEL, n_layers=7))


@pytest.fixture(scope="module")
def uneven_reference():
    return _grid_loss_grads(dataclasses.replace(UNEVEN, mesh=MeshConfig(data=1)), available_devices(1))


@pytest.mark.parametrize("mesh,parallel", [
    (MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=4)),
    (MeshConfig(data=1, pipe=4), ParallelConfig(microbatches=4, schedule="1f1b")),
    (MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=4, schedule="1f1b", zero=3, remat="dots")),
    (MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, schedule="circular", repeats=2, remat="full", zero=3)),
    # interleaved: 2 x 2 chunks, the last one padded (the chunk index picks the mask inside the loop)
    (MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, schedule="interleaved_1f1b", repeats=2, zero=3,
                                                remat="dots")),
    (MeshConfig(data=1, pipe=4), ParallelConfig(microbatches=4, schedule="zb_h1", zero=1, remat="full")),
])
def test_uneven_stages_match_single_device(uneven_reference, mesh, parallel):
    cfg = dataclasses.replace(UNEVEN, mesh=mesh, parallel=parallel)
    _assert_matches(_grid_loss_grads(cfg, available_devices(mesh.data * mesh.pipe)), uneven_reference)


# ----------------------------------------------------------------------------------------------
# Remat full: the table schedules' B pass adds each unit's weight gradient into the accumulator


def _cond_outputs(jaxpr, out=None, primitive="cond"):
    """The output avals of every `primitive` (a `cond`) in a jaxpr and the jaxprs inside it."""
    from jax.extend import core

    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            out += [v.aval for v in eqn.outvars]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, core.ClosedJaxpr):
                    _cond_outputs(sub.jaxpr, out, primitive)
                elif isinstance(sub, core.Jaxpr):
                    _cond_outputs(sub, out, primitive)
    return out


def _scheduled_jaxpr(parallel, layers=MODEL.n_layers):
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(MODEL, n_layers=layers), mesh=MeshConfig(data=4, pipe=2),
                              parallel=parallel)
    layout = make_layout(cfg, make_mesh(cfg.mesh))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          layout.abstract_state.params, layout.param_shardings)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=batch_sharding(layout.mesh))
             for k in ("inputs", "targets")}
    return jax.make_jaxpr(make_grad_fn(layout))(params, batch), layout


@pytest.mark.parametrize("zero", [1, 3])
def test_interleaved_ticks_slice_one_unit_never_a_whole_chunk(zero):
    """Interleaved 1F1B (v = 2 chunks per stage, remat full): F and B pick each unit's weights
    out of the stage's [v, Lc, ...] stack (pipeline_1f1b._at_unit, stage_fn's `rep`); no dynamic
    slice in the step takes a whole chunk [1, Lc, ...] of a weight. The chunk's slice was a copy of
    its weights each tick: the interleaved dense-1T row compiled for h100-16384 at 85.6 GiB (ZeRO-1)
    and 61.4 (ZeRO-3), 71.0 and 54.2 without (BUILD_NOTES.md)."""
    jaxpr, layout = _scheduled_jaxpr(ParallelConfig(microbatches=4, schedule="interleaved_1f1b", repeats=2,
                                                    zero=zero, remat="full"), layers=8)
    stage = {tuple(w.shape[2:]) for w in jax.tree.leaves(layout.abstract_state.params["layers"])}  # [Lc, ...]
    assert {s[0] for s in stage} == {2}  # 8 layers over 2 stages x 2 chunks
    chunks = {(1, *s) for s in stage}
    sliced = {tuple(a.shape) for a in _cond_outputs(jaxpr.jaxpr, primitive="dynamic_slice")}
    assert sliced and not sliced & chunks, sliced & chunks


@pytest.mark.parametrize("remat", ["full", "none"])
def test_b_pass_returns_one_units_weight_gradient_under_remat_full(remat):
    """1F1B with remat full: no conditional of the tick loop returns a whole stage's float32
    weight gradient [Lc, ...] (pipeline_1f1b.backward_by_unit: each unit's VJP sits in its own
    conditional and its gradient is added into the accumulator in place). The stage's VJP in one
    conditional returned the whole [Lc, ...] gradient, a buffer of the stage's float32 weights
    beside the accumulator: the dense-1T row compiled for h100-16384 at 80.6 GiB, 54.6 without
    (BUILD_NOTES.md "Pipelined ZeRO-3 in the compute dtype"). Remat none keeps the stage's VJP
    (by unit it would run every forward twice)."""
    cfg = dataclasses.replace(BASE, mesh=MeshConfig(data=4, pipe=2),
                              parallel=ParallelConfig(microbatches=2, schedule="1f1b", zero=3, remat=remat))
    layout = make_layout(cfg, make_mesh(cfg.mesh))
    mesh = layout.mesh
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          layout.abstract_state.params, layout.param_shardings)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=batch_sharding(mesh)) for k in ("inputs", "targets")}
    jaxpr = jax.make_jaxpr(make_grad_fn(layout))(params, batch)
    stage = {tuple(w.shape[2:]) for w in jax.tree.leaves(layout.abstract_state.params["layers"])}  # [Lc, ...]
    unit = {s[1:] for s in stage}
    assert min(s[0] for s in stage) == 2  # two layers per stage: the two shapes differ
    outputs = [(a.dtype, tuple(a.shape)) for a in _cond_outputs(jaxpr.jaxpr)]
    whole = [o for o in outputs if o[0] == np.float32 and o[1] in stage]
    one = [o for o in outputs if o[0] == np.float32 and o[1] in unit]
    if remat == "full":
        assert not whole and len({o[1] for o in one}) == len(unit), (whole, one)
    else:
        assert len({o[1] for o in whole}) == len(stage), whole


@pytest.mark.parametrize("tie", [False, True])
def test_tables_carried_in_the_compute_dtype_change_no_value_and_no_gradient(tie):
    """pipeline_tables.carried_tables: under ZeRO-3 the table schedules' vocabulary tables enter the
    tick loop cast to bf16 on their shards (a bf16 gather) and each use reads them back as float32
    (as_masters). Every use casts a table to bf16 anyway, so the loss and every gradient are
    bit-identical to the float32 masters' (checked unpipelined: XLA:CPU refuses a pipelined bf16
    step; the gather's dtype is checked on the compiled targets, test_compiled_targets.py). The
    final norm's scale, used in float32, stays float32; so does a table an FP8 head quantises."""
    from jax.sharding import PartitionSpec as P
    from parallax.parallel.pipeline_tables import as_masters, carried_tables
    from parallax.train.train_state import _init_params, make_model

    cfg = dataclasses.replace(BASE, model=dataclasses.replace(MODEL, dtype="bfloat16", tie_embeddings=tie),
                              parallel=ParallelConfig(zero=3))
    model = make_model(cfg, platform="cpu")
    params = _init_params(model, cfg, jax.random.key(0), None)
    outer = {k: v for k, v in params.items() if k != "layers"}
    specs = jax.tree.map(lambda a: P("data") if a.ndim > 1 else P(), outer)  # ZeRO-3: the tables over data
    carried = carried_tables(model, outer, specs, {"data", "expert", "pipe"})
    dtypes = {jax.tree_util.keystr(k): str(a.dtype) for k, a in jax.tree_util.tree_leaves_with_path(carried)}
    assert dtypes == {"['embed']['embedding']": "bfloat16", "['final_norm']['scale']": "float32",
                      **({} if tie else {"['logits']['kernel']": "bfloat16"})}
    replicated = carried_tables(model, outer, jax.tree.map(lambda a: P(), outer), {"data", "pipe"})
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(replicated))  # ZeRO-1: nothing gathered, nothing cast
    fp8 = dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, enabled=True, logits=True))
    head = "embed" if tie else "logits"
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(
        carried_tables(make_model(fp8, platform="cpu"), outer, specs, {"data", "pipe"})[head]))
    rows = np.random.default_rng(0).integers(0, 256, (4, T + 1)).astype(np.int32)

    def loss(o):
        return model.apply({"params": {**params, **o}}, rows[:, :-1], rows[:, 1:], method=model.loss)[0]

    want, want_grads = jax.value_and_grad(loss)(outer)
    got, got_grads = jax.value_and_grad(loss)(as_masters(carried))  # what the ticks differentiate
    assert float(got) == float(want)
    for w, g in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads)):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
