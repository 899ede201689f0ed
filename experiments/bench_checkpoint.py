"""Benchmark: checkpoint size, save and restore time, and how much an async save stalls the loop.

    python experiments/bench_checkpoint.py                 # quickstart model, ~1-2 minutes on a 2-core CPU
    python experiments/bench_checkpoint.py --tiny          # seconds: a smoke run
    python experiments/bench_checkpoint.py --json out.json # also write the figures as JSON

A script, not a timed test: it prints figures and PASS/FAIL against the target and exits 0 either
way. The model, mesh and batch are `experiments/quickstart.py`'s (1.05M parameters, data=4 x
tensor=2, ZeRO-1, 16 x 128 tokens per step) on 8 simulated CPU devices when there is no
accelerator; the state saved is params + AdamW moments + step, the same `Checkpoints.save` the
CLI calls.

[1] Size: bytes of one finalized step directory (state + meta + Orbax metadata).
[2] Save: the blocking part of `save` (what the loop waits for: the dispatch of the snapshot into
    host memory, and the previous save if it is still running), the time until the checkpoint is
    finalized (written, renamed into place) and the CPU time all of it takes (background threads
    included). Median of `--saves` saves.
[3] Stall (target: <= 10% of a step). Rounds of `--round-steps` train steps, alternating a round
    with no save and a round with one save issued after its first step (as the loop does), each
    round blocking at its end (and waiting for the save). Stall per save = median over pairs of
    (round with save - adjacent round without), compared to the median step time, with a 95%
    bootstrap interval for that median: PASS when the whole interval is within the target, FAIL
    when all of it is above, INCONCLUSIVE otherwise. The rounds are long enough for the save's
    background writing to finish inside them, so its competition for the CPU is counted too.
    Second opinions: the blocking part alone over a step, and the extra process CPU time per save
    over a step's CPU time. Simulated devices on a 2-core CPU make single steps move by 10%:
    many short rounds (e.g. --rounds 100 --round-steps 4) narrow the interval.
[4] Restore: onto the same mesh, and onto data=8 (a different layout), median of 3.

--spare-core: the threads that exist before the first save (XLA's, the training loop's) are
confined to all cores but the last, and the threads the first save starts (the checkpoint
writer, Orbax's, tensorstore's; later ones inherit) to the last. That is the situation of an
accelerator host, where the step computes on the device and host cores are free for the writer;
on a CPU-only host the step is slower for the lost core, and [3] then measures what the loop
itself pays for a save (the dispatch, the GIL, memory traffic) rather than the write's
competition with the step for the same cores. Linux only (sched_setaffinity).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "jax" not in sys.modules and not any(p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu", "tpu")):
    # Before JAX starts: 8 simulated CPU devices, as the CLI does on a machine without accelerators.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from parallax.train.build import build  # noqa: E402
from parallax.train.checkpoint import Checkpoints, make_meta  # noqa: E402
from parallax.config import CheckpointConfig, MeshConfig, ModelConfig, load_experiment  # noqa: E402
from parallax.train.data import make_global_batch, open_data  # noqa: E402
from parallax.parallel.mesh import describe  # noqa: E402
from parallax.model.transformer import count_params  # noqa: E402
from parallax.train.train_state import init_state  # noqa: E402

STALL_TARGET = 0.10
QUICKSTART = Path(__file__).resolve().parent / "quickstart.py"


def make_config(tiny: bool, nice: int = CheckpointConfig.background_nice):
    cfg = load_experiment(QUICKSTART)
    if tiny:
        cfg = dataclasses.replace(cfg, model=ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64),
                                  train=dataclasses.replace(cfg.train, seq_len=16, global_batch=8))
    return dataclasses.replace(cfg, checkpoint=CheckpointConfig(every=1, keep=2, background_nice=nice))


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model: a seconds-long smoke run")
    ap.add_argument("--saves", type=int, default=None, help="saves timed for [2] (default 5; tiny 2)")
    ap.add_argument("--rounds", type=int, default=None, help="round pairs for [3] (default 6; tiny 2)")
    ap.add_argument("--round-steps", type=int, default=None, help="steps per round (default 8; tiny 4)")
    ap.add_argument("--dir", help="where to write checkpoints (default: a temporary directory)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--spare-core", action="store_true",
                    help="confine the step to all cores but the last and the save's threads to the last (see above)")
    ap.add_argument("--nice", type=int, default=CheckpointConfig.background_nice,
                    help="checkpoint.background_nice for the saves (default %(default)s; 0: the process's priority)")
    args = ap.parse_args(argv)
    saves = args.saves or (2 if args.tiny else 5)
    rounds = args.rounds or (2 if args.tiny else 6)
    round_steps = args.round_steps or (4 if args.tiny else 8)

    cfg = make_config(args.tiny, args.nice)
    built = build(cfg)
    mesh, layout = built.mesh, built.layout
    state = init_state(cfg, layout)
    train_data, _ = open_data(cfg)
    bsh = built.batch_sharding
    batches = [make_global_batch(train_data, i, bsh) for i in range(4)]
    step_fn = built.train_step()
    print(f"model: {count_params(cfg.model)['total']:,} params; mesh {describe(mesh)}; ZeRO-{cfg.parallel.zero}")

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    shutil.rmtree(root / "checkpoints", ignore_errors=True)
    ckpt = Checkpoints(root, cfg.checkpoint)
    ckpt.open(layout)
    n = 0

    def run_steps(k: int) -> None:
        nonlocal state, n
        for _ in range(k):
            state, metrics = step_fn(state, batches[n % len(batches)])
            float(metrics["loss"])  # the loop syncs on the metrics every step
            n += 1

    def save() -> float:
        t0 = time.perf_counter()
        ckpt.save(n, state, make_meta(cfg, n, mesh))
        return time.perf_counter() - t0

    run_steps(3)  # compile and warm up
    if args.spare_core:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            ap.error("--spare-core needs at least 2 cores")
        step_threads = _threads()
        for tid in step_threads:
            os.sched_setaffinity(tid, cores[:-1])
    save()
    ckpt.wait()  # the first save starts the writer's, Orbax's and tensorstore's threads
    if args.spare_core:
        save_threads = _threads() - step_threads
        for tid in save_threads:
            os.sched_setaffinity(tid, cores[-1:])
        print(f"--spare-core: {len(step_threads)} threads on cores {cores[:-1]}, {len(save_threads)} save threads on core {cores[-1]}")

    # [1] + [2]
    blocking, finalized, save_cpu = [], [], []
    for _ in range(saves):
        run_steps(1)
        t0, c0 = time.perf_counter(), time.process_time()
        blocking.append(save())
        ckpt.wait()
        finalized.append(time.perf_counter() - t0)
        save_cpu.append(time.process_time() - c0)  # every thread of this process, background too
    size = dir_bytes(ckpt.path(n))

    # [3]
    plain, with_save, step_times = [], [], []
    cpu_plain, cpu_save = [], []
    for r in range(rounds):
        for kind in (("plain", "save") if r % 2 == 0 else ("save", "plain")):
            ckpt.wait()  # outside the timing: each round starts with no save in flight
            t0, c0 = time.perf_counter(), time.process_time()
            run_steps(1)
            if kind == "save":
                save()
            run_steps(round_steps - 1)
            ckpt.wait()  # normally already done (the rounds are long enough); counted if not
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            (with_save if kind == "save" else plain).append(dt)
            (cpu_save if kind == "save" else cpu_plain).append(dc)
            if kind == "plain":
                step_times.append(dt / round_steps)
    ckpt.close()
    step_s = statistics.median(step_times)
    diffs = np.array([s - p for s, p in zip(with_save, plain)])
    stall = float(np.median(diffs))
    # 95% interval of the median pair difference: resample the pairs (the rounds of one pair
    # are adjacent and share the machine's state; different pairs are treated as independent).
    boot = np.median(np.random.default_rng(0).choice(diffs, (2000, len(diffs))), axis=1)
    stall_lo, stall_hi = (float(q) for q in np.quantile(boot, [0.025, 0.975]))
    # Second opinion, less disturbed by other processes on a shared machine: the extra CPU time
    # (all threads of this process) a save costs, over the CPU time of a step.
    cpu_stall = statistics.median(s - p for s, p in zip(cpu_save, cpu_plain)) / (statistics.median(cpu_plain) / round_steps)

    # [4]
    restore = {}
    for name, mesh_cfg in (("same_mesh", cfg.mesh), ("data8", MeshConfig(data=8))):
        target_cfg = dataclasses.replace(cfg, mesh=mesh_cfg)
        target_layout = build(target_cfg).layout
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(Checkpoints(root, cfg.checkpoint).restore(target_cfg, target_layout).state)
            times.append(time.perf_counter() - t0)
        restore[name] = statistics.median(times)

    figures = {
        "checkpoint_bytes": size,
        "state_bytes": sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(layout.abstract_state)),
        "save_blocking_ms": 1e3 * statistics.median(blocking),
        "save_finalized_ms": 1e3 * statistics.median(finalized),
        "save_cpu_ms": 1e3 * statistics.median(save_cpu),
        "step_ms": 1e3 * step_s,
        "stall_ms_per_save": 1e3 * stall,
        "stall_fraction": stall / step_s,
        "stall_fraction_95": [stall_lo / step_s, stall_hi / step_s],
        "blocking_fraction": statistics.median(blocking) / step_s,
        "cpu_stall_fraction": cpu_stall,
        "restore_same_mesh_ms": 1e3 * restore["same_mesh"],
        "restore_data8_ms": 1e3 * restore["data8"],
        "spare_core": args.spare_core,
        "rounds_plain_s": plain,
        "rounds_save_s": with_save,
    }
    print(f"[1] checkpoint size: {size / 2**20:.2f} MiB on disk for {figures['state_bytes'] / 2**20:.2f} MiB of state")
    print(f"[2] save: {figures['save_blocking_ms']:.1f} ms blocking, {figures['save_finalized_ms']:.1f} ms until finalized, "
          f"{figures['save_cpu_ms']:.1f} ms of CPU time in all")
    print(f"[3] step {figures['step_ms']:.1f} ms; stall per async save {figures['stall_ms_per_save']:.1f} ms "
          f"(95% interval {1e3 * stall_lo:.1f} to {1e3 * stall_hi:.1f} ms) over {len(diffs)} round pairs "
          f"(blocking part alone: {figures['blocking_fraction']:.1%} of a step; extra CPU time per save: "
          f"{figures['cpu_stall_fraction']:.1%} of a step's)")
    print(f"[4] restore: {figures['restore_same_mesh_ms']:.1f} ms same mesh, {figures['restore_data8_ms']:.1f} ms onto data=8")
    lo, hi = figures["stall_fraction_95"]
    verdict = "PASS" if hi <= STALL_TARGET else "FAIL" if lo > STALL_TARGET else "INCONCLUSIVE"
    print(f"RESULT stall_fraction {figures['stall_fraction']:.4f} (95% {lo:.4f} to {hi:.4f})  target <= {STALL_TARGET}  {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
