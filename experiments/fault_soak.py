"""Fault soak: a checkpointing tiny run interrupted at random moments, resumed after each one.

    python experiments/fault_soak.py [--rounds 24] [--seed 0] [--steps 2500] [--every 25] [--out DIR]

Each round starts (or resumes) the same `parallax train` command and interrupts it at a random
moment, chosen uniformly from 0.2 s after the start to a little past when the run would end, with
one of: kill -9; SIGTERM; SIGTERM then a second SIGTERM 0-1 s later. Moments fall in start-up
(imports, restore, compile), in training, and inside saves. After the rounds one last run goes to
the end. Checked, against one uninterrupted run of the same command:
- no resume is refused, and no round ends with an error or a traceback;
- SIGTERM exits 0 with a checkpoint (or 143, one line, during start-up: nothing to save), a
  second SIGTERM never loses the save;
- metrics.jsonl holds every step exactly once, in order, and each step's loss is the
  uninterrupted run's, bit for bit (same mesh and machine);
- the final checkpoint's arrays equal the uninterrupted run's.
Prints one line per round and the figures; exits 1 if any check fails. Not a test (minutes).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.py"
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
        "train.seq_len=16", "train.global_batch=8", "train.log_every=1", "train.eval_every=0", "checkpoint.keep=3"]
KINDS = ("kill -9", "SIGTERM", "SIGTERM x2")


def overrides(args) -> list[str]:
    return [*TINY, f"train.steps={args.steps}", f"checkpoint.every={args.every}"]


def spawn(args, wd: Path, cache: Path, log) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("XLA_FLAGS", None)  # the CLI simulates the mesh's 8 devices itself
    sets = [a for o in overrides(args) for a in ("--set", o)]
    return subprocess.Popen([sys.executable, "-m", "parallax", "train", str(QUICKSTART), *sets, "--workdir", str(wd)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.PIPE, text=True)


def steps_in(wd: Path) -> list[int]:
    path = wd / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def checkpoints(wd: Path) -> list[int]:
    d = wd / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--out", type=Path, help="keep the workdirs here (default: a temporary directory, removed)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(args.out or tempfile.mkdtemp(prefix="fault_soak_"))
    root.mkdir(parents=True, exist_ok=True)
    cache, ref, wd = root / "xla_cache", root / "reference", root / "soak"
    for d in (ref, wd):
        shutil.rmtree(d, ignore_errors=True)
    problems: list[str] = []

    t0 = time.monotonic()
    with open(root / "reference.log", "w") as log:
        proc = spawn(args, ref, cache, log)
        _, err = proc.communicate()
    ref_s = time.monotonic() - t0
    if proc.returncode != 0:
        print(f"reference run failed ({proc.returncode}): {err[-2000:]}")
        return 1
    print(f"reference: {args.steps} steps in {ref_s:.1f} s (includes the first compile)")

    outcomes: collections.Counter = collections.Counter()
    lost, started_at = [], time.monotonic()
    for i in range(args.rounds):
        kind = rng.choice(KINDS)
        before_ckpt, before_steps = checkpoints(wd), steps_in(wd)
        delay = rng.uniform(0.2, 8.0)
        with open(root / f"round{i:02d}.log", "w") as log:
            proc = spawn(args, wd, cache, log)
            t = time.monotonic()
            finished = False
            while time.monotonic() - t < delay:
                if proc.poll() is not None:
                    finished = True
                    break
                time.sleep(0.005)
            at_step = steps_in(wd)[-1] if steps_in(wd) else 0
            if not finished:
                if kind == "kill -9":
                    proc.send_signal(signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGTERM)
                    if kind == "SIGTERM x2":
                        time.sleep(rng.uniform(0.0, 1.0))
                        if proc.poll() is None:
                            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate()
        rc = proc.returncode
        after = steps_in(wd)
        err_lines = [line for line in err.splitlines() if line.strip()]
        stage = "training" if at_step > (before_steps[-1] if before_steps else 0) else "start-up"
        outcome = "finished" if finished else f"{kind} in {stage}"
        outcomes[outcome] += 1
        bad = []
        if "Traceback" in err or "error:" in err:
            bad.append(f"stderr: {err_lines[-1][:300] if err_lines else ''}")
        if kind == "kill -9" and not finished and rc != -signal.SIGKILL:
            bad.append(f"exit {rc} after kill -9")
        if kind != "kill -9" and not finished and rc not in (0, 128 + signal.SIGTERM):
            bad.append(f"exit {rc} after {kind}")
        if rc == 128 + signal.SIGTERM and not (len(err_lines) == 1 and "before any step ran" in err_lines[0]):
            bad.append(f"exit 143 without the start-up line: {err_lines}")
        if rc == 0 and not finished and checkpoints(wd)[-1:] != after[-1:]:
            bad.append(f"SIGTERM exit 0 but the last checkpoint {checkpoints(wd)[-1:]} is not the last step {after[-1:]}")
        if after != list(range(1, len(after) + 1)):
            bad.append("metrics.jsonl steps are not 1..n once each")
        if kind == "kill -9" and after:
            lost.append(after[-1] - (checkpoints(wd)[-1] if checkpoints(wd) else 0))
        problems += [f"round {i}: {b}" for b in bad]
        print(f"round {i:2d}: {kind:<10} at {delay:4.1f} s -> exit {rc}, metrics to step {after[-1] if after else 0}, "
              f"checkpoints {checkpoints(wd)} (before: {before_ckpt[-1:] or 'none'})" + (f"  PROBLEM: {bad}" if bad else ""),
              flush=True)
        if finished:
            break
    soak_s = time.monotonic() - started_at

    with open(root / "final.log", "w") as log:
        proc = spawn(args, wd, cache, log)
        _, err = proc.communicate()
    if proc.returncode != 0 or "error:" in err:
        problems.append(f"final run: exit {proc.returncode}: {err[-500:]}")

    got = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    if [r["step"] for r in got] != list(range(1, args.steps + 1)):
        problems.append("final metrics.jsonl does not hold every step exactly once")
    mismatched = [r["step"] for r, w in zip(got, want) if r["loss"] != w["loss"]]
    if mismatched:
        problems.append(f"{len(mismatched)} losses differ from the uninterrupted run's (first at step {mismatched[0]})")

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    from parallax.train.build import build
    from parallax.train.checkpoint import Checkpoints
    from parallax.config import apply_overrides, load_experiment

    cfg = apply_overrides(load_experiment(QUICKSTART), overrides(args))
    layout = build(cfg).layout
    a, b = (Checkpoints(d, cfg.checkpoint).restore(cfg, layout) for d in (wd, ref))
    same = a.step == b.step and all(np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)))
    if not same:
        problems.append(f"final checkpoint (step {a.step}) differs from the uninterrupted run's (step {b.step})")

    print(f"\n{sum(outcomes.values())} rounds in {soak_s:.0f} s: " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
    if lost:
        print(f"kill -9 lost (and the resume replayed) {min(lost)}..{max(lost)} steps, mean {sum(lost) / len(lost):.1f}")
    print(f"final: {len(got)} records, steps 1..{got[-1]['step']} once each: "
          f"{[r['step'] for r in got] == list(range(1, args.steps + 1))}; losses equal to the uninterrupted run's: "
          f"{not mismatched}; final checkpoint arrays equal: {same}")
    print("OK" if not problems else "PROBLEMS:\n  " + "\n  ".join(problems))
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
