"""Goodput from the run's own event log (parallax/train/goodput.py): the pure function on a log with
known numbers, a torn last line, and a real run killed -9 past a checkpoint and resumed, whose
replayed steps count as lost time."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.train.goodput import EVENTS_FILE, EventLog, goodput, read_events

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.py"

# Session 1: starts at 0, compiles 4 s (startup 6 s), steps 1-6 of 1 s, a 0.5 s save after step 4,
# then a kill -9 (no end). Session 2 resumes from checkpoint 4 at t=100: steps 5 and 6 are
# replayed (2 s lost), it compiles 3 s (startup 2 s), runs steps 5-8, evaluates 0.5 s, saves 0.25 s.
LOG = [
    {"event": "start", "t": 0.0, "step": 0},
    {"event": "compiled", "t": 10.0, "dt": 4.0},
    *[{"event": "step", "t": 10.0 + s, "step": s, "dt": 1.0, "ok": True} for s in range(1, 5)],
    {"event": "save", "t": 14.5, "step": 4, "dt": 0.5},
    *[{"event": "step", "t": 10.5 + s, "step": s, "dt": 1.0, "ok": True} for s in (5, 6)],
    {"event": "start", "t": 100.0, "step": 4},
    {"event": "compiled", "t": 105.0, "dt": 3.0},
    *[{"event": "step", "t": 101.0 + s, "step": s, "dt": 1.0, "ok": True} for s in range(5, 9)],
    {"event": "eval", "t": 109.5, "step": 8, "dt": 0.5},
    {"event": "save", "t": 109.75, "step": 8, "dt": 0.25},
    {"event": "end", "t": 110.0, "step": 8},
]


def test_goodput_of_a_log_with_known_numbers():
    g = goodput(LOG)
    assert g.sessions == 2 and g.steps == 8
    assert g.wall_s == pytest.approx(16.5 + 10.0)  # each session's start to its last event; not the gap
    assert g.productive_s == pytest.approx(8.0)
    assert g.replayed_s == pytest.approx(2.0)
    assert (g.compile_s, g.startup_s, g.eval_s, g.save_s) == pytest.approx((7.0, 8.0, 0.5, 0.75))
    assert g.other_s == pytest.approx(0.25)
    assert g.fraction == pytest.approx(8.0 / 26.5)


def test_a_restart_from_step_0_and_a_skipped_step_are_lost():
    log = [{"event": "start", "t": 0.0, "step": 0},
           {"event": "step", "t": 1.0, "step": 1, "dt": 1.0, "ok": True},
           {"event": "step", "t": 2.0, "step": 2, "dt": 1.0, "ok": False},
           {"event": "start", "t": 10.0, "step": 0},  # killed before its first checkpoint: from step 0 again
           {"event": "step", "t": 12.0, "step": 1, "dt": 2.0, "ok": True},
           {"event": "step", "t": 13.0, "step": 2, "dt": 1.0, "ok": False},
           {"event": "end", "t": 13.0, "step": 2}]
    g = goodput(log)
    assert (g.productive_s, g.replayed_s, g.skipped_s, g.steps) == pytest.approx((2.0, 2.0, 1.0, 1))
    assert g.wall_s == pytest.approx(5.0)


def test_a_torn_last_line_is_skipped_and_cut_before_appending(tmp_path):
    path = tmp_path / EVENTS_FILE
    whole = b"".join((json.dumps(e) + "\n").encode() for e in LOG[:8])
    path.write_bytes(whole + b'{"event": "step", "t": 16.5, "st')  # a kill -9 in the middle of a write
    assert read_events(path) == LOG[:8]
    log = EventLog(tmp_path)
    assert path.read_bytes() == whole
    for e in LOG[8:]:
        log.write(e["event"], **{k: v for k, v in e.items() if k != "event"})
    log.close()
    assert read_events(path) == LOG
    assert log.tally.summary() == goodput(LOG)
    EventLog(tmp_path, fresh=True).close()  # --overwrite: another run's log goes
    assert path.read_bytes() == b""


# ----------------------------------------------------------------------------------------------
# A real run: kill -9 past a checkpoint, resume


STEPS, EVERY, KILL_AT = 10, 4, 6  # killed after step 6: past checkpoint 4, before checkpoint 8
TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "train.seq_len=16", "train.global_batch=8", f"train.steps={STEPS}", "train.log_every=1",
    "train.eval_every=0", f"checkpoint.every={EVERY}", "checkpoint.keep=3",
]
# Before `main`, in the child: 0.3 s between steps (outside the step's time), and step 7 is not
# recorded before checkpoint 4 is finalized (its save is asynchronous: under load it was still in
# flight at step 6, and the resume started from scratch). The parent kills once it sees step 6
# and checkpoint 4, so the kill lands after checkpoint 4 and at least 0.6 s before step 8's record.
SLOW = f"""
import os, sys, time
import parallax.train.loop as loop
real = loop._Training.after_step
first = os.path.join(sys.argv[sys.argv.index("--workdir") + 1], "checkpoints", "{EVERY}")
def after_step(self, done, *a, **k):
    while done > {KILL_AT} and not os.path.isdir(first):
        time.sleep(0.01)
    time.sleep(0.3)
    return real(self, done, *a, **k)
loop._Training.after_step = after_step
from parallax.__main__ import main
sys.exit(main())
"""


def _spawn(wd: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    argv = [sys.executable, "-c", SLOW, "train", str(QUICKSTART), *[a for o in TINY for a in ("--set", o)],
            "--workdir", str(wd)]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(wd: Path) -> list[dict]:
    return [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


def test_a_kill_and_resume_count_the_replayed_steps_as_lost(tmp_path):
    wd, cache = tmp_path / "run", tmp_path / "xla_cache"
    proc = _spawn(wd, cache)
    try:
        deadline = time.monotonic() + 300
        while not ((wd / "checkpoints" / str(EVERY)).is_dir()
                   and any(r["step"] >= KILL_AT for r in (_records(wd) if (wd / "metrics.jsonl").exists() else []))):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step 6 and checkpoint 4 within 300 s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(60)
    before = {r["step"]: r["step_time_s"] for r in _records(wd)}  # the killed session's records
    first = read_events(wd / EVENTS_FILE)
    assert max(before) < 2 * EVERY and not any(e["event"] == "end" for e in first)

    proc = _spawn(wd, cache)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"resuming from checkpoint step {EVERY}" in out
    events = read_events(wd / EVENTS_FILE)
    assert events[:len(first)] == first  # appended, never rewritten
    g = goodput(events)
    assert g.sessions == 2 and g.steps == STEPS
    # The lost time is the killed session's time for the steps after checkpoint 4 (which the
    # resume ran again), as its own records give them.
    replayed = [s for s in before if s > EVERY]
    assert replayed and g.replayed_s == pytest.approx(sum(before[s] for s in replayed), rel=1e-9)
    # Productive time is each step once, at its last run: the final metrics.jsonl's step times.
    final = _records(wd)
    assert [r["step"] for r in final] == list(range(1, STEPS + 1))
    assert g.productive_s == pytest.approx(sum(r["step_time_s"] for r in final), rel=1e-9)
    # Goodput is below what the productive steps alone give over the same wall time less the loss.
    assert g.fraction < g.productive_s / (g.wall_s - g.replayed_s)
    assert final[-1]["goodput"] == pytest.approx(g.fraction, rel=0.2)  # the last record, before the final save's wait
    done = [line for line in out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and f"goodput {g.fraction:.1%}" in done[0] and "over 2 sessions" in done[0], out
    assert "replayed" in done[0], done[0]
