"""train.grad_accum (issue 23): A microsteps of B/A rows in a scan inside the jitted step equal one
step on the whole batch of B rows.

float32 throughout; only the order of the floating-point sums differs (the microsteps' float32
gradient sum, then / A), so the tolerances are the layout-equivalence ones (test_equivalence.py):
loss rtol 1e-6, gradients within 1e-4 of each leaf's (per layer) largest magnitude + 1e-6, and
after one AdamW step at lr 1e-3 the parameters within 1e-5. The mesh case (data 2 x tensor 2 on
4 of the 8 CPU devices) is held to the single-device whole batch with the same bounds. Seen:
loss equal to 1e-7 relative, gradients to ~1e-6 of the leaf max. Memory: one microstep's
activations, so the compiled temporaries shrink (printed; see /work/notes/grad_accum.md).
"""

import dataclasses

import jax
import numpy as np
import pytest

from parallax.cli import main
from parallax.config import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from parallax.train.build import build
from parallax.train.train_state import init_state
from parallax.train.train_step import accumulate, make_value_and_grad
from numerics import assert_trees_close
from test_cli import QUICKSTART, TINY, _assert_one_error_line, _make_workdir, _sets, _snapshot

LOSS_RTOL = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
PARAM_ATOL = 1e-5
A, B = 4, 8  # microsteps; the global batch (2 rows per microstep on one device, 1 per shard at data 2)

BASE = Config(
    model=ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=256),
    optim=OptimConfig(warmup_steps=0),  # the first step at the full lr: the state really moves
    train=TrainConfig(global_batch=B, seq_len=16, lr=1e-3, seed=3),
)


def _config(mesh: MeshConfig, grad_accum: int, batch: int = B) -> Config:
    return dataclasses.replace(BASE, mesh=mesh, train=dataclasses.replace(BASE.train, global_batch=batch,
                                                                           grad_accum=grad_accum))


def _run(cfg: Config, devices) -> dict:
    """Loss and gradients at the initial parameters, and the state after one train step."""
    b = build(cfg, devices)
    rows = np.random.default_rng(0).integers(0, 256, (cfg.train.global_batch, cfg.train.seq_len + 1)).astype(np.int32)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, b.batch_sharding)
    state = init_state(cfg, b.layout)
    value_and_grad = make_value_and_grad(b.layout)
    if cfg.train.grad_accum > 1:
        value_and_grad = accumulate(cfg, b.layout)
    (loss, _), (grads, _) = jax.jit(value_and_grad)(state.params, batch, state.fp8)
    out = {"loss": float(loss), "grads": jax.tree.map(np.asarray, grads), "params0": jax.tree.map(np.asarray, state.params)}
    state, metrics = b.train_step()(state, batch)  # donates the state
    out.update(state=jax.tree.map(np.asarray, state), metrics=jax.tree.map(float, metrics))
    return out


@pytest.fixture(scope="module")
def whole_batch():
    return _run(_config(MeshConfig(data=1), 1), jax.devices()[:1])


def _assert_same_step(got: dict, ref: dict) -> None:
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=LOSS_RTOL)
    assert_trees_close(got["grads"], ref["grads"], GRAD_RTOL, GRAD_ATOL)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got["metrics"][key], ref["metrics"][key], rtol=1e-5, err_msg=key)
    assert got["metrics"]["finite"] == 1.0
    assert int(got["state"].step) == int(ref["state"].step) == 1
    for (path, p), r in zip(jax.tree_util.tree_leaves_with_path(got["state"].params),
                            jax.tree.leaves(ref["state"].params)):
        np.testing.assert_allclose(p, r, atol=PARAM_ATOL, rtol=0, err_msg=jax.tree_util.keystr(path))
    moments = lambda s: [x for x in jax.tree.leaves(s.opt_state) if x.ndim]  # noqa: E731  (Adam mu, nu)
    assert_trees_close(moments(got["state"]), moments(ref["state"]), GRAD_RTOL, GRAD_ATOL)
    moved = max(np.abs(p - q).max() for p, q in zip(jax.tree.leaves(ref["state"].params), jax.tree.leaves(ref["params0"])))
    assert moved > 1e-4  # the step really updated the parameters


def test_microsteps_equal_the_whole_batch_on_one_device(whole_batch):
    _assert_same_step(_run(_config(MeshConfig(data=1), A), jax.devices()[:1]), whole_batch)


def test_microsteps_on_data2_tensor2_equal_the_whole_batch_on_one_device(whole_batch):
    _assert_same_step(_run(_config(MeshConfig(data=2, tensor=2), A), jax.devices()[:4]), whole_batch)


@pytest.mark.parametrize("zero", [1, 3])
def test_microsteps_under_zero_on_data2_equal_the_whole_batch_on_one_device(whole_batch, zero):
    """ZeRO-1 accumulates each shard's gradient unreduced (one reduce-scatter after the scan);
    ZeRO-3 falls back to the partitioner's per-microstep reduction (parallelism.reduces_once)."""
    cfg = dataclasses.replace(_config(MeshConfig(data=2), A), parallel=ParallelConfig(zero=zero))
    _assert_same_step(_run(cfg, jax.devices()[:2]), whole_batch)


def _data_reductions(cfg: Config, devices) -> tuple[int, int]:
    """(executions of those over 1 KiB, bytes) per step of the compiled step's reductions over
    `data` (all-reduce or reduce-scatter), in the partitioned program. The small ones are the
    scalars (each microstep's loss, cross-entropy) and move no gradient."""
    from parallax.analysis.hlo import collectives

    b = build(cfg, devices)
    hlo = b.train_step().lower(b.abstract_state(), b.abstract_batch()).compile().as_text()
    found = [c for c in collectives(hlo, dict(b.mesh.shape))
             if c.kind in ("all-reduce", "reduce-scatter") and "data" in c.axes]
    return sum(c.executions for c in found if c.bytes >= 1024), sum(c.bytes_per_step for c in found)


@pytest.mark.parametrize("zero", [0, 1])
def test_the_data_reduction_runs_once_per_step(zero):
    """data 2 x tensor 2, A = 4: the reductions over `data` move the bytes of one step without
    accumulation (not A times them), and the gradient ones run as often. Seen: 74,372 -> 74,400
    bytes at ZeRO-0, 74,491 -> 74,535 at ZeRO-1 (the microsteps' scalars)."""
    mesh, par = MeshConfig(data=2, tensor=2), ParallelConfig(zero=zero)
    one = _data_reductions(dataclasses.replace(_config(mesh, 1), parallel=par), jax.devices()[:4])
    four = _data_reductions(dataclasses.replace(_config(mesh, A), parallel=par), jax.devices()[:4])
    print(f"zero {zero}: data reductions per step (executions, bytes): grad_accum=1 {one}, grad_accum={A} {four}")
    assert one[1] > 0
    assert four[1] <= one[1] * 1.01 and four[0] <= one[0]  # (after the scan XLA may combine them)


def test_under_zero3_the_data_reduction_runs_per_microstep():
    mesh, par = MeshConfig(data=2, tensor=2), ParallelConfig(zero=3)
    one = _data_reductions(dataclasses.replace(_config(mesh, 1), parallel=par), jax.devices()[:4])
    four = _data_reductions(dataclasses.replace(_config(mesh, A), parallel=par), jax.devices()[:4])
    print(f"zero 3: data reductions per step (executions, bytes): grad_accum=1 {one}, grad_accum={A} {four}")
    assert four[1] > 3 * one[1]  # what reduces_once's docstring says ZeRO-3 keeps


def test_fp8_delayed_microsteps_equal_the_whole_batch():
    """FP8 (delayed, history 4) on one device: each microstep differentiates loss / A, so its
    output gradients, hence their amaxes and E5M2 quantisation, are the whole batch's rows'; the
    state's amax histories and scales combine by max. The saturation/flush fractions are a max
    over microsteps, not the whole tensor's (as over pipeline microbatches, test_fp8_pipeline):
    atol 0.05 (seen 0.014)."""
    from parallax.config import Fp8Config
    from numerics import tree_errors

    cfg = dataclasses.replace(_config(MeshConfig(data=1), 1), fp8=Fp8Config(enabled=True, amax_history_length=4))
    b = build(cfg, jax.devices()[:1])
    rows = np.random.default_rng(0).integers(0, 256, (B, cfg.train.seq_len + 1)).astype(np.int32)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, b.batch_sharding)
    state = init_state(cfg, b.layout)
    (l1, _), (g1, f1) = jax.jit(make_value_and_grad(b.layout))(state.params, batch, state.fp8)
    accumulated = accumulate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=A)), b.layout)
    (l4, _), (g4, f4) = jax.jit(accumulated)(state.params, batch, state.fp8)
    np.testing.assert_allclose(float(l4), float(l1), rtol=LOSS_RTOL)
    assert_trees_close(g4, g1, GRAD_RTOL, GRAD_ATOL)
    assert not tree_errors(f4, f1, 1e-5, 1e-7, only=lambda name: "_stats" not in name)
    assert not tree_errors(f4, f1, 0.0, 0.05, only=lambda name: "_stats" in name)


def test_compiled_temporaries_are_one_microsteps():
    """Same global batch (64 x 16 on data 2 x tensor 2): the scan holds one microstep's activations."""
    temp = {}
    for accum in (1, A):
        b = build(_config(MeshConfig(data=2, tensor=2), accum, batch=64), jax.devices()[:4])
        compiled = b.train_step().lower(b.abstract_state(), b.abstract_batch()).compile()
        temp[accum] = compiled.memory_analysis().temp_size_in_bytes
    print(f"temp bytes: grad_accum=1 {temp[1]}, grad_accum={A} {temp[A]}, ratio {temp[A] / temp[1]:.3f}")
    assert temp[A] < 0.6 * temp[1]


@pytest.mark.parametrize("overrides, needles", [
    pytest.param(["train.grad_accum=3"], ["train.grad_accum=3", "must divide the per-replica batch", "8 / 4"],
                 id="not-dividing"),
    pytest.param(["train.grad_accum=0"], ["train.grad_accum", "positive"], id="zero"),
    pytest.param(["train.grad_accum=2", "parallel.microbatches=2"], ["train.grad_accum=2", "not with pipelining"],
                 id="pipelined"),
    pytest.param(["train.grad_accum=2", "train.noise_scale=True"], ["train.grad_accum=2", "train.noise_scale"],
                 id="noise-scale"),
    pytest.param(["train.grad_accum=2", "fp8.enabled=True", "fp8.recipe=current"],
                 ["train.grad_accum=2", "fp8.recipe='current'"], id="fp8-current"),
])
def test_bad_grad_accum_is_one_line_exit_2(tmp_path, capsys, overrides, needles):
    """Quickstart's data 4 x tensor 2 with TINY's global batch 8: 2 rows per replica."""
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    assert main(["train", str(QUICKSTART), *_sets(*TINY, *overrides), "--workdir", str(wd)]) == 2
    _assert_one_error_line(capsys.readouterr().err, *needles)
    assert _snapshot(tmp_path) == before


def test_rule_counts_the_expert_axis_as_replicas():
    from parallax.parallelism import check

    moe = dataclasses.replace(BASE.model, moe=dataclasses.replace(BASE.model.moe, num_experts=4))
    cfg = dataclasses.replace(_config(MeshConfig(), 2, batch=8), model=moe)
    check(cfg, dict(data=2, tensor=1, pipe=1, expert=2))  # 8 / (2 x 2) = 2 rows per replica
    with pytest.raises(ConfigError, match=r"train.grad_accum=4 must divide .* = 8 / 4"):
        check(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=4)),
              dict(data=2, tensor=1, pipe=1, expert=2))


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_cost_model_knows_accumulation(zero):
    """data 4 x tensor 2, A = 4, 64 rows: every collective family's bytes per step as compiled
    (within 0.5%; the compiled step adds a few scalars), and the peak memory within the
    validation tolerance (test_cost_validation: 15%, plus this tiny shape's constant ~0.25 MB
    the model misses at A = 1 too: 20%). Seen: exact collective bytes but 150 B of scalars, peak
    -3.7% / -12.8% / -18.8% (A = 1: -6.4% / -7.3% / -8.3%)."""
    from parallax.analysis.audit import compile_step
    from parallax.analysis.collectives import collective_terms
    from parallax.analysis.cost import Grid, Workload, memory_parts
    from parallax.analysis.hlo import collectives

    cfg = dataclasses.replace(_config(MeshConfig(data=4, tensor=2), A, batch=64), parallel=ParallelConfig(zero=zero))
    step = compile_step(cfg)
    w, g = Workload.of(cfg), Grid.of(cfg, step.mesh_shape)
    compiled, model = {}, {}
    for c in collectives(step.hlo, step.mesh_shape):
        compiled[(c.kind, c.axes)] = compiled.get((c.kind, c.axes), 0) + c.bytes_per_step
    for t in collective_terms(w, g, "cpu"):
        model[(t.kind, t.axes)] = model.get((t.kind, t.axes), 0) + float(t.bytes * t.executions)
    for key in set(compiled) | set(model):
        assert model.get(key, 0) == pytest.approx(compiled.get(key, 0), rel=5e-3), (key, model.get(key), compiled.get(key))
    peak = float(memory_parts(w, g, "cpu")["total"])
    assert peak == pytest.approx(step.memory["peak"], rel=0.2), (peak, step.memory["peak"])
