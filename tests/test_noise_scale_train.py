"""train.noise_scale wired through the train step, the CLI and the planner.

On 8 simulated devices (data=4 x tensor=2, ZeRO-1, a tiny model): the step with the estimator on
updates exactly as the normal step; its two squared norms equal a hand computation from per-shard
gradients computed separately (the plain gradient function on a batch made of one shard's rows
repeated: the same mean, hence the same gradient); and the compiled step adds no collective
beyond scalar-sized reductions. Then the CLI logs `noise_scale`, `plan --noise-scale-from` reads it
back, and configs where it cannot be computed are refused in one line.
"""

import collections
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from parallax.analysis.hlo import collectives
from parallax import parallelism
from parallax.config import (Config, ConfigError, Fp8Config, MeshConfig, ModelConfig, MoEConfig, OptimConfig,
                             ParallelConfig, TrainConfig)
from parallax.parallel.mesh import make_mesh
from parallax.analysis.plan import noise_scale_from
from parallax.cli import main
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_grad_fn, make_train_step

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "experiments" / "quickstart.py")
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-5  # as tests/test_equivalence.py (fp32, reduction order only)
SHARDS, B, T = 4, 8, 16

CFG = Config(
    mesh=MeshConfig(data=SHARDS, tensor=2),
    model=ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=256),
    parallel=ParallelConfig(zero=1),
    optim=OptimConfig(warmup_steps=1),  # step 0 runs at lr 0, step 1 at the full lr
    train=TrainConfig(global_batch=B, seq_len=T, lr=1e-3, seed=3),
)


def _rows(mesh, rows):
    return jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))


@pytest.fixture(scope="module")
def runs():
    """Two steps with the estimator off and on, from the same parameters on the same batch."""
    mesh = make_mesh(CFG.mesh)
    rows = np.random.default_rng(0).integers(0, 256, (B, T + 1)).astype(np.int32)
    batch = _rows(mesh, rows)
    out = {"mesh": mesh, "rows": rows}
    for on in (False, True):
        cfg = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, noise_scale=on))
        layout = make_layout(cfg, mesh)
        state = init_state(cfg, layout)
        if not on:  # the step donates the state: keep host copies of the starting parameters
            out["layout"], out["params0"] = layout, jax.tree.map(np.asarray, state.params)
        compiled = make_train_step(cfg, layout).lower(state, batch).compile()
        metrics = []
        for _ in range(2):
            state, m = compiled(state, batch)
            metrics.append({k: float(v) for k, v in m.items()})
        out[on] = {"metrics": metrics, "params": jax.tree.map(np.asarray, state.params), "hlo": compiled.as_text()}
    return out


def test_update_is_unchanged(runs):
    off, on = runs[False], runs[True]
    for a, b in zip(on["metrics"], off["metrics"]):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=LOSS_RTOL)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
        assert a["finite"] == b["finite"] == 1.0
        assert "grad_sq_small" in a and "grad_sq_small" not in b
    for (path, p), q in zip(jax.tree_util.tree_leaves_with_path(on["params"]), jax.tree.leaves(off["params"])):
        np.testing.assert_allclose(p, q, atol=PARAM_ATOL, rtol=0, err_msg=jax.tree_util.keystr(path))
    moved = max(np.abs(p - q).max() for p, q in zip(jax.tree.leaves(on["params"]), jax.tree.leaves(runs["params0"])))
    assert moved > 1e-4  # the second step really updated the parameters


def test_logged_terms_match_per_shard_gradients(runs):
    """Step 0's norms against per-shard gradients from the plain (unvmapped) gradient function."""
    mesh, rows, grad_fn = runs["mesh"], runs["rows"], make_grad_fn(runs["layout"])
    shard_grads = []
    for k in np.split(rows, SHARDS):  # shard k's rows repeated to the global batch: its own mean loss
        params = jax.device_put(runs["params0"], runs["layout"].param_shardings)
        _, g = grad_fn(params, _rows(mesh, np.tile(k, (SHARDS, 1))))
        shard_grads.append(np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)]))
    shard_grads = np.stack(shard_grads)  # [n, P]
    small = np.mean(np.sum(shard_grads**2, axis=1))
    big = np.sum(shard_grads.mean(axis=0) ** 2)
    logged = runs[True]["metrics"][0]
    assert logged["grad_sq_small"] == pytest.approx(small, rel=1e-4)
    assert logged["grad_sq_big"] == pytest.approx(big, rel=1e-4)
    assert logged["grad_norm"] ** 2 == pytest.approx(big, rel=1e-4)  # G is the update's gradient
    assert small > 1.5 * big  # B/4-row shards are noisier than the batch: the terms are not degenerate


def test_no_collective_beyond_scalar_reductions(runs):
    """Per (kind, mesh axes), bytes per step with the estimator on equal those off up to the
    per-shard norm reductions ([n] floats); the gradient reduction is not repeated."""
    shape = dict(runs["mesh"].shape)

    def totals(hlo):
        out = collections.Counter()
        for c in collectives(hlo, shape):
            out[(c.kind, c.axes)] += c.bytes_per_step
        return out

    off, on = totals(runs[False]["hlo"]), totals(runs[True]["hlo"])
    assert set(on) <= set(off), (on, off)  # no new kind of collective, no new axis
    assert off[("all-reduce", ("data",))] > 10_000  # the gradient reduction is there to compare
    for key in off:
        assert abs(on[key] - off[key]) <= 128, (key, on[key], off[key])


def test_cli_logs_noise_scale_and_plan_reads_it(tmp_path, capsys):
    wd = tmp_path / "run"
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
            "train.seq_len=32", "train.global_batch=32", "train.steps=6", "train.eval_batches=1", "train.log_every=1",
            "train.noise_scale=true"]
    assert main(["train", QUICKSTART, *[a for o in tiny for a in ("--set", o)], "--workdir", str(wd)]) == 0
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6
    for r in records:
        assert r["grad_sq_small"] > r["grad_sq_big"] > 0
        assert r["noise_scale"] is None or r["noise_scale"] > 0
    scale = records[-1]["noise_scale"]
    assert scale is not None, records
    capsys.readouterr()
    # A batch of 2^16 sequences is far beyond the estimate (about one sequence at initialisation:
    # the early gradient is mostly the direction every sequence agrees on), so it is capped, with
    # one note, but not below what 8 devices can split (the quickstart model: batch 4 on pipe 4).
    assert main(["plan", QUICKSTART, "--set", "train.global_batch=65536", "--devices", "8", "--device", "h100",
                 "--noise-scale-from", str(wd), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    notes = [n for n in out["notes"] if "wasted data parallelism" in n]
    assert len(notes) == 1 and f"scale {scale:g}" in notes[0], out["notes"]
    capped = int(notes[0].rsplit("global batch ", 1)[1].split()[0])
    if capped > 2 * scale:
        assert "smallest these devices can split" in notes[0] and capped == 4, notes[0]
    assert out["layouts"] and all(capped % (r["data"] * r["microbatches"]) == 0 for r in out["layouts"])


@pytest.mark.parametrize("setup,needles", [
    (lambda wd: None, ["--noise-scale-from", "no metrics.jsonl"]),
    (lambda wd: (wd / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "noise_scale": null}\n'),
     ["holds no noise_scale", "train.noise_scale=true"]),
])
def test_plan_noise_scale_from_bad_workdir(tmp_path, capsys, setup, needles):
    wd = tmp_path / "wd"
    wd.mkdir()
    setup(wd)
    assert main(["plan", QUICKSTART, "--devices", "8", "--device", "h100", "--noise-scale-from", str(wd)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parallax: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _sized(**mesh):
    sizes = {"data": 4, "tensor": 2, "pipe": 1, "expert": 1, **mesh}
    return sizes


@pytest.mark.parametrize("change,sizes,needle", [
    (dict(parallel=ParallelConfig(microbatches=2, schedule="1f1b")), _sized(), "pipelining"),
    (dict(parallel=ParallelConfig(microbatches=2)), _sized(data=2, pipe=2), "pipelining"),
    (dict(), _sized(data=1, tensor=2), "mesh.data x mesh.expert > 1"),
    (dict(model=dataclasses.replace(CFG.model, moe=MoEConfig(num_experts=4))), _sized(data=2, expert=2), "mesh.expert=2"),
    (dict(model=dataclasses.replace(CFG.model, moe=MoEConfig(num_experts=4, dispatch="ragged", capacity_factor=0))),
     _sized(), "dispatch='ragged'"),
    (dict(fp8=Fp8Config(enabled=True)), _sized(), "fp8.enabled"),
])
def test_config_refuses_where_it_cannot_be_computed(change, sizes, needle):
    base = dataclasses.replace(CFG, parallel=ParallelConfig(),
                               train=dataclasses.replace(CFG.train, noise_scale=True))
    parallelism.check(base, _sized())  # the tiny dense config is fine as it is
    with pytest.raises(ConfigError) as e:
        parallelism.check(dataclasses.replace(base, **change), sizes)
    message = str(e.value)
    assert message.startswith("train.noise_scale") and needle in message and "\n" not in message, message


def test_cli_refusal_is_one_line_exit_2(tmp_path, capsys):
    wd = tmp_path / "wd"
    argv = ["train", QUICKSTART, "--set", "train.noise_scale=true", "--set", "mesh.data=1", "--set", "mesh.tensor=8",
            "--set", "model.n_heads=8", "--set", "model.n_kv_heads=8", "--workdir", str(wd)]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parallax: error: train.noise_scale"), lines
    assert not wd.exists()


def test_noise_scale_from_skips_lines_that_are_not_records(tmp_path):
    """A damaged metrics.jsonl (bytes that are not UTF-8, a partial line, a non-object line) still
    gives the last value a whole record logged; before 2026-12-01 the non-UTF-8 line raised."""
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "noise_scale": 12.5}\n\xff\xfe\x00 damaged\n[1, 2]\n'
                                            b'{"step": 2, "noise_scale": 14.0}\n{"step": 3, "noise')
    assert noise_scale_from(str(tmp_path)) == 14.0
