"""Checkpoints and fault tolerance: exact resume, kill -9, SIGTERM, restore onto other meshes,
damaged checkpoints, structural changes, the NaN/inf guard.

One uninterrupted CLI run (`reference`, in-process on the 8 simulated devices, data=4 x tensor=2)
is the yardstick: every interrupted run of the same config must end on bit-identical parameters
and log bit-identical losses (same mesh, same machine). Real process kills run the CLI in a
subprocess; everything else calls `parallax.cli.main` in-process to save interpreter start-ups.
"""

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from parallax.train.checkpoint import DAMAGED_DIR, Checkpoints, make_meta
from parallax.config import (CheckpointConfig, Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig,
                             TrainConfig, apply_overrides, load_experiment)
from parallax.parallel.mesh import available_devices, make_mesh
from parallax.parallel.pipeline import to_layer_major
from parallax.cli import main
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_train_step
from test_equivalence import LOSS_RTOL, PARAM_ATOL

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.py"
STEPS, EVERY = 40, 4
TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "train.seq_len=16", "train.global_batch=8", f"train.steps={STEPS}", "train.log_every=1",
    "train.eval_every=0", f"checkpoint.every={EVERY}", "checkpoint.keep=3",
]


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _argv(wd: Path, *extra: str) -> list[str]:
    return ["train", str(QUICKSTART), *_sets(*TINY), "--workdir", str(wd), *extra]


def _records(wd: Path) -> dict[int, dict]:
    """step -> record; a step run twice (after a kill) keeps its later record."""
    return {r["step"]: r for r in map(json.loads, (wd / "metrics.jsonl").read_text().splitlines())}


def _params(wd: Path, step: int) -> list[np.ndarray]:
    cfg = apply_overrides(load_experiment(QUICKSTART), TINY)
    ckpt = Checkpoints(wd, cfg.checkpoint)
    restored = ckpt.restore(cfg, make_layout(cfg, make_mesh(cfg.mesh)))
    assert restored.step == step, (restored.step, step)
    return [np.asarray(x) for x in jax.tree.leaves(restored.state.params)]


def _assert_same_params(wd: Path, reference: dict) -> None:
    for a, b in zip(_params(wd, STEPS), reference["params"]):
        np.testing.assert_array_equal(a, b)


def _assert_same_losses(wd: Path, reference: dict, steps) -> None:
    got = _records(wd)
    for s in steps:
        assert got[s]["loss"] == reference["records"][s]["loss"], (s, got[s]["loss"], reference["records"][s]["loss"])


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _copy(reference: dict, tmp_path: Path) -> Path:
    wd = tmp_path / "run"
    shutil.copytree(reference["wd"], wd)
    return wd


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    wd = tmp_path_factory.mktemp("reference") / "run"
    assert main(_argv(wd)) == 0
    assert Checkpoints(wd).steps() == [STEPS - 2 * EVERY, STEPS - EVERY, STEPS]  # keep=3
    return {"wd": wd, "records": _records(wd), "params": _params(wd, STEPS)}


# ----------------------------------------------------------------------------------------------
# Exact resume, in-process


def test_stop_and_resume_is_bit_identical(reference, tmp_path, capsys):
    wd = tmp_path / "run"
    assert main(_argv(wd, "--stop-at", "10")) == 0
    assert "stopped at step 10" in capsys.readouterr().out
    assert Checkpoints(wd).steps() == [4, 8, 10]
    assert max(_records(wd)) == 10
    assert main(_argv(wd)) == 0
    assert "resuming from checkpoint step 10" in capsys.readouterr().out
    lines = [json.loads(x)["step"] for x in (wd / "metrics.jsonl").read_text().splitlines()]
    assert lines == list(range(1, STEPS + 1))  # appended, nothing lost, nothing repeated
    _assert_same_losses(wd, reference, range(1, STEPS + 1))
    assert _records(wd)[STEPS]["eval_loss"] == reference["records"][STEPS]["eval_loss"]
    _assert_same_params(wd, reference)


# ----------------------------------------------------------------------------------------------
# Real signals: one chain of CLI subprocesses (XLA_FLAGS from conftest gives them the same 8
# devices; a persistent compilation cache lets the later ones skip compiling)
#   A: kill -9 at a seeded random step;  B: resume, SIGTERM;  C: resume, kill -9 right after it
#   reports an async save;  D: resume in-process to the end.


def _spawn(wd: Path, cache: Path, stdout) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return subprocess.Popen([sys.executable, "-m", "parallax", *_argv(wd)], cwd=REPO, env=env,
                            stdout=stdout, stderr=subprocess.STDOUT, text=True)


def _last_step(wd: Path) -> int:
    metrics = wd / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def _wait_for_step(proc: subprocess.Popen, wd: Path, step: int, timeout: float = 120) -> None:
    """Poll metrics.jsonl (flushed every step) until its last record reaches `step`."""
    deadline = time.monotonic() + timeout
    while _last_step(wd) < step:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    wd, cache, out = root / "run", root / "xla_cache", {}
    # A. From step 2*EVERY+1 on, the first checkpoint is final: the save at 2*EVERY waited for it.
    target = random.Random(6).randrange(2 * EVERY + 1, STEPS // 2)
    with open(root / "a.log", "w") as log:
        proc = _spawn(wd, cache, log)
        _wait_for_step(proc, wd, target)
        proc.send_signal(signal.SIGKILL)
        out["a_rc"], out["a_steps"] = proc.wait(60), Checkpoints(wd).steps()
    # B. Past every step A may have reached, then SIGTERM.
    with open(root / "b.log", "w") as log:
        proc = _spawn(wd, cache, log)
        _wait_for_step(proc, wd, _last_step(wd) + 2)
        proc.send_signal(signal.SIGTERM)
        out["b_rc"] = proc.wait(120)
    out["b_log"], out["b_last"], out["b_steps"] = (root / "b.log").read_text(), _last_step(wd), Checkpoints(wd).steps()
    # C. Kill during the first save past the resume point, once Orbax's temporary directory
    # exists (the loop is told "saving" when the snapshot is taken; the writer thread starts
    # Orbax's save just after).
    proc = _spawn(wd, cache, subprocess.PIPE)
    for line in proc.stdout:
        if line.startswith("resuming from checkpoint step"):
            out["c_resumed"] = int(line.split()[4])
        if line.startswith("checkpoint: saving step") and "c_resumed" in out:
            k = int(line.split()[3])
            deadline = time.monotonic() + 30
            while not list((wd / "checkpoints").glob(f"{k}.orbax-checkpoint-tmp*")) and time.monotonic() < deadline:
                time.sleep(0.0005)
            proc.send_signal(signal.SIGKILL)
            out["c_killed_saving"] = k
            break
    out["c_rc"] = proc.wait(60)
    out["c_tmp"] = sorted(p.name for p in (wd / "checkpoints").glob("*orbax-checkpoint-tmp*"))
    out["c_steps"] = Checkpoints(wd).steps()
    return {"wd": wd, **out}


def test_sigterm_finishes_the_step_saves_and_exits_0(interrupted):
    r, wd = interrupted, interrupted["wd"]
    assert r["b_rc"] == 0, r["b_log"][-2000:]
    stopped = r["b_last"]
    assert stopped < STEPS
    assert (f"SIGTERM received: stopped after step {stopped}; checkpoint saved to "
            f"{wd.absolute()}/checkpoints/{stopped}; run the same command to resume") in r["b_log"]
    assert r["b_steps"][-1] == stopped
    assert r["c_resumed"] == stopped  # the next run continued from it


def test_sigkill_at_a_random_step_and_during_a_save(interrupted, reference, capsys):
    r, wd = interrupted, interrupted["wd"]
    assert r["a_rc"] == -signal.SIGKILL and r["a_steps"], "A was killed after its first checkpoint"
    assert r["c_rc"] == -signal.SIGKILL and "c_killed_saving" in r, "C never reported a save to interrupt"
    # C's save was in flight: Orbax's temporary directory, not a listed (restorable) checkpoint.
    k = r["c_killed_saving"]
    assert f"{k}.orbax-checkpoint-tmp" in " ".join(r["c_tmp"]) and k not in r["c_steps"], (k, r["c_tmp"], r["c_steps"])
    assert main(_argv(wd)) == 0
    assert f"resuming from checkpoint step {r['c_steps'][-1]}" in capsys.readouterr().out
    _assert_same_losses(wd, reference, range(1, STEPS + 1))
    _assert_same_params(wd, reference)
    assert not list((wd / "checkpoints").glob("*orbax-checkpoint-tmp*"))  # the interrupted save was cleaned up
    # The records of the steps each kill lost were dropped at the resume: every step once, in order.
    assert [json.loads(x)["step"] for x in (wd / "metrics.jsonl").read_text().splitlines()] == list(range(1, STEPS + 1))


# ----------------------------------------------------------------------------------------------
# Damaged checkpoints, structural changes, flags: clear message, nothing deleted


def _truncate_newest(wd: Path) -> Path:
    files = [p for p in (wd / "checkpoints" / str(STEPS) / "state").rglob("*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim


def test_truncated_checkpoint_falls_back_to_the_previous_one(reference, tmp_path, capsys):
    """--stop-at the fallback's step: a restore-only run (training on from a restored checkpoint
    is what the exact-resume tests check)."""
    wd = _copy(reference, tmp_path)
    victim = _truncate_newest(wd)
    damaged = victim.read_bytes()
    before = {k: v for k, v in _snapshot(wd).items() if not k.startswith(f"checkpoints/{STEPS}")}

    assert main(_argv(wd, "--stop-at", str(STEPS - EVERY))) == 0
    out, err = capsys.readouterr()
    moved = wd / DAMAGED_DIR / str(STEPS)
    assert f"checkpoint step {STEPS} is damaged or partial" in err and f"moved it to {moved} and fell back" in err
    assert f"resuming from checkpoint step {STEPS - EVERY}" in out
    assert (moved / victim.relative_to(wd / "checkpoints" / str(STEPS))).read_bytes() == damaged  # kept
    after = _snapshot(wd)
    assert all(after.get(k) == v for k, v in before.items())  # every other file untouched
    assert Checkpoints(wd).steps() == [STEPS - 2 * EVERY, STEPS - EVERY]


def test_a_damaged_checkpoint_is_one_line_on_the_stderr_of_a_real_run(reference, tmp_path):
    """In a plain process (no pytest hooks) the failed read's leftovers, Orbax's abandoned read
    coroutines, reached stderr through the garbage collector: 27,000 lines of TensorStore specs
    under the one warning, for this tiny model."""
    wd = _copy(reference, tmp_path)
    _truncate_newest(wd)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "parallax", *_argv(wd, "--stop-at", str(STEPS - EVERY))], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and len(err) == 1, (proc.returncode, len(err), proc.stderr[:2000])
    assert err[0].startswith("parallax: warning: checkpoint step") and "is damaged or partial" in err[0]


# TensorStore's own report of a full disk (as a 16 MB tmpfs gave it): RESOURCE_EXHAUSTED, which
# is not running out of memory.
TENSORSTORE_FULL = ('RESOURCE_EXHAUSTED: Error writing local file "{d}/_sharding": Failed writing: '
                    '"{d}/_sharding.__lock": Failed to write 14743 bytes to file 8: No space left on device '
                    "[os_error_code='28']")


@pytest.mark.parametrize("kind", ["oserror", "tensorstore"])
def test_a_failed_save_is_one_line_exit_2_and_keeps_the_earlier_checkpoints(tmp_path, capsys, monkeypatch, kind):
    """A full disk at the second save (step 2*EVERY), which runs on the writer thread: the run
    stops at its next save with one line naming that step's directory, exit 2, and the first
    checkpoint stays restorable."""
    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.save
    failed = (tmp_path / "run").absolute() / "checkpoints" / str(2 * EVERY)

    def save(self, step, *args, **kwargs):
        if step > EVERY:
            if kind == "oserror":
                raise OSError(28, "No space left on device")
            raise ValueError(TENSORSTORE_FULL.format(d=f"{failed}.orbax-checkpoint-tmp/state"))
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    wd = tmp_path / "run"
    assert main(_argv(wd, "--set", f"train.steps={3 * EVERY}")) == 2
    cause = ("OSError: [Errno 28] No space left on device" if kind == "oserror" else
             f"No space left on device, writing {failed}.orbax-checkpoint-tmp/state/_sharding")
    assert capsys.readouterr().err.strip().splitlines() == [
        f"parallax: error: saving checkpoint {str(failed)!r} failed ({cause}); "
        "the checkpoints finalized before it are kept"]
    assert Checkpoints(wd).steps() == [EVERY]


def test_a_failed_metrics_write_saves_first_and_the_rerun_loses_nothing(reference, tmp_path, capsys, monkeypatch):
    """A full disk while writing step 6's record: half the line reached the file. It is cut back
    (no partial JSON line), the state is saved with that record, and one line says so (exit 2);
    the same command then resumes, writes the saved record, and ends as the reference run did,
    each step once in metrics.jsonl."""
    import parallax.train.metrics as metrics

    real = metrics._write_all

    def write_all(fd, data):
        if b'{"step": 6,' in data:
            real(fd, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(metrics, "_write_all", write_all)
    wd = tmp_path / "run"
    assert main(_argv(wd)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"parallax: error: writing step 6 to {str(wd / 'metrics.jsonl')!r} "
                                               "failed (No space left on device); checkpoint step 6 was saved"), err
    text = (wd / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["step"] for x in text.splitlines()] == [1, 2, 3, 4, 5]
    assert Checkpoints(wd).steps() == [4, 6]
    monkeypatch.undo()
    assert main(_argv(wd)) == 0
    assert [json.loads(x)["step"] for x in (wd / "metrics.jsonl").read_text().splitlines()] == list(range(1, STEPS + 1))
    _assert_same_losses(wd, reference, range(1, STEPS + 1))
    _assert_same_params(wd, reference)


@pytest.mark.parametrize("override, needles", [
    ("model.d_model=64", ["model.d_model=64", "model.d_model=32"]),
    ("model.n_layers=2", ["model.n_layers=2", "model.n_layers=1"]),
    ("model.vocab_size=512", ["model.vocab_size=512", "model.vocab_size=256"]),
    ("model.n_heads=4", ["model.n_heads=4", "model.n_heads=2"]),
    ("model.d_ff=128", ["model.d_ff=128", "model.d_ff=64"]),
    ("train.seed=1", ["train.seed=1", "train.seed=0"]),
    ("model.moe.num_experts=4", ["model.moe.num_experts=4", "model.moe.num_experts=0"]),  # dense -> MoE
    ("optim.clip_norm=0.0", ["does not fit this config", "opt_state/"]),  # caught by the shape check
])
def test_structural_change_is_refused_and_touches_nothing(reference, tmp_path, capsys, override, needles):
    wd = _copy(reference, tmp_path)
    before = _snapshot(tmp_path)
    assert main([*_argv(wd), "--set", override]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("parallax: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("flag", ["--fresh", "--overwrite"])
def test_fresh_refuses_a_workdir_with_checkpoints(reference, tmp_path, capsys, flag):
    wd = _copy(reference, tmp_path)
    before = _snapshot(tmp_path)
    assert main(_argv(wd, flag)) == 2
    err = capsys.readouterr().err
    assert err.startswith("parallax: error: ") and flag in err and f"latest step {STEPS}" in err, err
    assert _snapshot(tmp_path) == before


def test_non_structural_changes_are_allowed(reference, tmp_path, capsys):
    """More steps (a longer schedule) and another mesh restore the same checkpoint; --stop-at at
    the checkpoint's step makes it a restore-only run (no compile)."""
    wd = _copy(reference, tmp_path)
    changed = _sets(f"train.steps={STEPS * 2}", "mesh.data=8", "mesh.tensor=1", "optim.warmup_steps=5")
    assert main([*_argv(wd), *changed, "--stop-at", str(STEPS)]) == 0
    out = capsys.readouterr().out
    assert f"resuming from checkpoint step {STEPS}" in out and "data=4 x tensor=2" in out
    assert "mesh: data=8 x tensor=1" in out and "nothing to train" in out


# ----------------------------------------------------------------------------------------------
# NaN/inf guard


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, capsys):
    """lr 1e30 from step 2 on: step 2's update leaves finite but huge weights, whose gradients
    overflow from step 3. Steps 3-5 are skipped and the third stops the run (exit 3)."""
    wd = tmp_path / "run"
    extra = ["train.lr=1e30", "optim.warmup_steps=1", "checkpoint.every=1", "train.max_bad_steps=3"]
    assert main(["train", str(QUICKSTART), *_sets(*TINY, *extra), "--workdir", str(wd)]) == 3
    err = capsys.readouterr().err
    assert "3 consecutive steps (3-5)" in err and "train.max_bad_steps=3" in err
    assert f"last good checkpoint is step 2 in {wd.absolute() / 'checkpoints'}" in err
    records = _records(wd)
    assert [records[s]["skipped_steps"] for s in (1, 2, 3, 4, 5)] == [0, 0, 1, 2, 3]
    assert max(records) == 5 and Checkpoints(wd).steps() == [1, 2]


def test_an_update_that_overflows_is_skipped_and_never_saved(tmp_path, capsys):
    """lr 3.4e38 (finite, in float32 too) and weight decay 1000: step 1 runs at lr 0 (warmup),
    step 2's loss and gradients are finite but its update overflows the parameters. The guard
    judges the new state, so steps 2-3 are skipped and stop the run (exit 3), and the checkpoint
    the message calls the last good one is finite. (Before: step 2 was applied and saved, inf.)"""
    wd = tmp_path / "run"
    extra = ["train.lr=3.4e38", "optim.weight_decay=1000.0", "optim.warmup_steps=1", "checkpoint.every=1",
             "train.max_bad_steps=2"]
    assert main(["train", str(QUICKSTART), *_sets(*TINY, *extra), "--workdir", str(wd)]) == 3
    err = capsys.readouterr().err
    assert "2 consecutive steps (2-3)" in err and f"last good checkpoint is step 1 in {wd.absolute() / 'checkpoints'}" in err
    records = _records(wd)
    assert [records[s]["skipped_steps"] for s in (1, 2, 3)] == [0, 1, 2]
    assert all(np.isfinite(records[s]["loss"]) for s in (1, 2, 3))  # the loss alone would not have caught it
    assert Checkpoints(wd).steps() == [1]
    cfg = apply_overrides(load_experiment(QUICKSTART), [*TINY, *extra])
    state = Checkpoints(wd, cfg.checkpoint).restore(cfg, make_layout(cfg, make_mesh(cfg.mesh))).state
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


# ----------------------------------------------------------------------------------------------
# Uneven pipeline stages: the stack is padded in memory, saved without the padding, and L is not
# a multiple of `pipe` on disk (make_snapshot failed with IndivisibleError at the first save)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_stages_save_and_resume_exactly(tmp_path, schedule):
    """3 layers on 2 stages: two steps, a save, two more steps; then the checkpoint restored (equal
    to what was saved) and the same two steps again give the same losses and parameters."""
    cfg = Config(mesh=MeshConfig(data=4, pipe=2), parallel=ParallelConfig(microbatches=2, schedule=schedule),
                 model=dataclasses.replace(RESHARD_MODEL, n_layers=3), optim=OptimConfig(warmup_steps=1),
                 train=TrainConfig(global_batch=8, seq_len=16, lr=1e-3, seed=3))
    mesh = make_mesh(cfg.mesh)
    layout = make_layout(cfg, mesh)
    assert layout.schedule.padding == 1
    state, step = init_state(cfg, layout), make_train_step(cfg, layout)
    for i in range(2):
        state, _ = step(state, _batch(mesh, i))
    saved = [np.array(x) for x in jax.tree.leaves(state)]
    with Checkpoints(tmp_path, cfg.checkpoint) as ckpt:
        ckpt.open(layout)
        ckpt.save(2, state, make_meta(cfg, 2, mesh))
        losses = []
        for i in (2, 3):
            state, metrics = step(state, _batch(mesh, i))
            losses.append(float(metrics["loss"]))
    after = [np.array(x) for x in jax.tree.leaves(state)]
    restored = Checkpoints(tmp_path, cfg.checkpoint).restore(cfg, layout)
    assert restored.step == 2
    for a, b in zip(jax.tree.leaves(restored.state), saved):
        np.testing.assert_array_equal(np.asarray(a), b)
    state = restored.state
    for i, want in zip((2, 3), losses):
        state, metrics = step(state, _batch(mesh, i))
        assert float(metrics["loss"]) == want
    for a, b in zip(jax.tree.leaves(state), after):
        np.testing.assert_array_equal(np.asarray(a), b)


# ----------------------------------------------------------------------------------------------
# Restore onto other meshes: each array lands directly in the new layout's sharding

RESHARD_MODEL = ModelConfig(d_model=32, n_layers=4, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=256)
SOURCE = (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(zero=1, microbatches=2))
TARGETS = {
    "data4_tensor2_zero3": (MeshConfig(data=4, tensor=2), ParallelConfig(zero=3)),
    "data8": (MeshConfig(data=8), ParallelConfig()),
    "one_device": (MeshConfig(data=1), ParallelConfig()),
    "data4_pipe2": (MeshConfig(data=4, pipe=2), ParallelConfig(microbatches=2)),
    "data2_pipe4": (MeshConfig(data=2, pipe=4), ParallelConfig(microbatches=4)),  # pipe 2 -> 4
    # uneven stages: 4 layers in 2 x 3 chunks, the stack padded by 2 identity slots in memory only
    "data4_pipe2_circular3": (MeshConfig(data=4, pipe=2), ParallelConfig(microbatches=2, schedule="circular", repeats=3)),
}


def _reshard_config(mesh: MeshConfig, parallel: ParallelConfig) -> Config:
    return Config(mesh=mesh, model=RESHARD_MODEL, parallel=parallel, optim=OptimConfig(warmup_steps=1),
                  train=TrainConfig(global_batch=8, seq_len=16, lr=1e-3, seed=3))


def _batch(mesh, step: int):
    rows = np.random.default_rng(step).integers(0, 256, (8, 17)).astype(np.int32)
    return jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))


def _layer_major(params, layout) -> list[np.ndarray]:
    if layout.schedule is not None:
        params = {**params, "layers": to_layer_major(params["layers"], layout.schedule.units)}
    return [np.array(x) for x in jax.tree.leaves(params)]  # copies: a view of a CPU buffer blocks its donation


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two steps on data=2 x tensor=2 x pipe=2 (ZeRO-1, GPipe), a save, then the third step.

    The third step runs while the save is in flight and donates the state it was given: the
    restores below, which must equal `saved` exactly, show that the snapshot was taken first."""
    wd = tmp_path_factory.mktemp("reshard")
    cfg = _reshard_config(*SOURCE)
    mesh = make_mesh(cfg.mesh)
    layout = make_layout(cfg, mesh)
    state, step = init_state(cfg, layout), make_train_step(cfg, layout)
    for i in range(2):
        state, _ = step(state, _batch(mesh, i))
    saved = _layer_major(state.params, layout)
    with Checkpoints(wd, cfg.checkpoint) as ckpt:
        ckpt.open(layout)
        ckpt.save(2, state, make_meta(cfg, 2, mesh))
        donated = state
        state, metrics = step(state, _batch(mesh, 2))
        assert all(x.is_deleted() for x in jax.tree.leaves(donated.params))  # the step did donate
    return {"wd": wd, "saved": saved, "loss": float(metrics["loss"]), "params3": _layer_major(state.params, layout)}


_TARGET_CACHE: dict = {}


def _target(name: str):
    """(cfg, mesh, layout, jitted train step) per target, built once: compiles are the cost here."""
    if name not in _TARGET_CACHE:
        cfg = _reshard_config(*TARGETS[name])
        mesh = make_mesh(cfg.mesh, available_devices(1) if name == "one_device" else None)
        layout = make_layout(cfg, mesh)
        _TARGET_CACHE[name] = cfg, mesh, layout, make_train_step(cfg, layout)
    return _TARGET_CACHE[name]


@pytest.mark.parametrize("target", list(TARGETS))
def test_restore_onto_another_mesh(source, target):
    cfg, mesh, layout, step = _target(target)
    restored = Checkpoints(source["wd"], cfg.checkpoint).restore(cfg, layout)
    assert restored.step == 2 and int(restored.state.step) == 2
    for leaf, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(layout.state_shardings)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)
    for a, b in zip(_layer_major(restored.state.params, layout), source["saved"]):
        np.testing.assert_array_equal(a, b)  # restoring is exact; only the placement changed
    state, metrics = step(restored.state, _batch(mesh, 2))
    np.testing.assert_allclose(float(metrics["loss"]), source["loss"], rtol=LOSS_RTOL)
    for a, b in zip(_layer_major(state.params, layout), source["params3"]):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL, rtol=0)


def test_guard_leaves_the_state_unchanged(source):
    """A non-finite loss (one NaN weight) skips the update inside the jitted step: every array of
    the state comes back bit-identical, only the step counter moves (the batch is consumed)."""
    cfg, mesh, layout, step = _target("one_device")
    state = Checkpoints(source["wd"], cfg.checkpoint).restore(cfg, layout).state
    scale = state.params["final_norm"]["scale"]
    state = state.replace(params={**state.params, "final_norm": {"scale": scale.at[0].set(np.nan)}})
    before = jax.tree.map(lambda x: np.array(x, copy=True), state)  # the step donates `state`
    after, metrics = step(state, _batch(mesh, 2))
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
    assert int(after.step) == int(before.step) + 1
    for a, b in zip(jax.tree.leaves(after.replace(step=before.step)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)  # NaN == NaN here


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread priorities are read through /proc (Linux)")
@pytest.mark.parametrize("nice", [19, 0])
def test_a_save_runs_its_background_threads_at_checkpoint_background_nice(tmp_path, monkeypatch, nice):
    """The writer thread and the threads a save starts (Orbax's, tensorstore's pool) run at
    checkpoint.background_nice, so that the write takes idle host cycles rather than the step's."""
    import parallax.train.checkpoint as checkpoint

    cfg = dataclasses.replace(_reshard_config(MeshConfig(data=1), ParallelConfig()),
                              checkpoint=CheckpointConfig(background_nice=nice))
    mesh = make_mesh(cfg.mesh, available_devices(1))
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    lowered = []
    real = checkpoint._lower_priority

    def record(threads, value):
        real(threads, value)
        lowered.append({tid: _nice_of(tid) for tid in threads})

    monkeypatch.setattr(checkpoint, "_lower_priority", record)
    with Checkpoints(tmp_path, cfg.checkpoint) as ckpt:
        ckpt.open(layout)
        ckpt.save(1, state, make_meta(cfg, 1, mesh))
    assert Checkpoints(tmp_path, cfg.checkpoint).steps() == [1]
    if nice == 0:
        assert not lowered  # left at the process's priority
        return
    seen = {tid: n for call in lowered for tid, n in call.items()}
    alive = {tid: n for tid, n in seen.items() if n is not None}
    assert alive and set(alive.values()) == {nice}, seen  # the writer and the save's threads, all lowered
    assert threading.get_native_id() not in seen
    assert _nice_of(threading.get_native_id()) == 0  # never the training thread itself


def _nice_of(tid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # the thread has already exited
        return None


def test_a_snapshot_is_in_host_memory_and_holds_each_element_once():
    """ZeRO-1 on data=4 x tensor=2 replicates the parameters over data: on the devices they take
    4x their size. The snapshot a save takes is in pinned host memory and holds every element
    once (each replica keeps a different piece), and its values are the state's."""
    from parallax.train.checkpoint import DiskForm, make_snapshot

    cfg = _reshard_config(MeshConfig(data=4, tensor=2), ParallelConfig(zero=1))
    layout = make_layout(cfg, make_mesh(cfg.mesh))
    state = init_state(cfg, layout)
    snapshot = make_snapshot(layout, DiskForm(layout))(state)

    def held(tree) -> int:  # bytes on all devices (or host memories) together
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)

    logical = sum(x.nbytes for x in jax.tree.leaves(state))
    scalars = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 0)  # step and optimizer counts
    assert held(state.params) >= 3.5 * sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(snapshot)} == {"pinned_host"}
    # what no dimension divides stays replicated: here only the scalars, on all 8 devices
    assert held(snapshot) == logical + 7 * scalars, (held(snapshot), logical, scalars)
    for a, b in zip(jax.tree.leaves(snapshot), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_error_in_the_writer_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    """Orbax's save runs on the writer thread: its failure (a full disk, say) must not vanish
    there. `save` returns (having compiled nothing: `open` did); the next `wait` (or save, or
    close) raises it as one line naming the step's directory and the cause (exit 2 through the
    CLI, as every CheckpointError)."""
    from jax._src.dispatch import BACKEND_COMPILE_EVENT  # "/jax/core/compile/backend_compile_duration"

    from parallax.train.checkpoint import CheckpointError

    cfg = _reshard_config(MeshConfig(data=1), ParallelConfig())
    mesh = make_mesh(cfg.mesh, available_devices(1))
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    ckpt = Checkpoints(tmp_path, cfg.checkpoint)
    ckpt.open(layout)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt._manager, "save", fail)
    compiles = []

    def listener(event: str, secs: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        ckpt.save(1, state, make_meta(cfg, 1, mesh))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiles  # the snapshot was compiled by `open`, not inside the first save
    with pytest.raises(CheckpointError) as failed:
        ckpt.wait()
    assert str(failed.value) == (f"saving checkpoint {str(tmp_path.absolute() / 'checkpoints' / '1')!r} failed "
                                 "(OSError: [Errno 28] No space left on device); "
                                 "the checkpoints finalized before it are kept")
    monkeypatch.undo()
    ckpt.save(2, state, make_meta(cfg, 2, mesh))  # the writer is still usable
    ckpt.close()
    assert Checkpoints(tmp_path, cfg.checkpoint).steps() == [2]
