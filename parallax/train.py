"""`parallax train EXPERIMENT.py [--set key=value ...] [--workdir DIR] [--fresh] [--stop-at STEP] [--debug]`.

Order matters: the config is read, checked in full (every field's range, the mesh against the
device count where that is known, batch divisibility, ...) and the simulated CPU device count
chosen before JAX is imported (the XLA flag is read once, at backend start). Everything the user
can get wrong (config, mesh, data, workdir) is checked before the workdir is touched, so a bad
invocation never overwrites anything. User errors print one line and exit with status 2;
`--debug` shows the traceback.

A workdir is locked for the life of a run (WORKDIR/.parallax.lock, an OS lock that dies with the
process); a second run on it is refused. A workdir with checkpoints is resumed (metrics.jsonl is
appended to, after the records of steps past the checkpoint are dropped: the resumed run writes
them again); checkpoints are never deleted by a flag. SIGTERM/SIGINT finish the step, save and exit
0; a second one waits for that save, a third abandons it; during start-up one stops at once (nothing
was saved: no step ran). Exit 3: `train.max_bad_steps` consecutive non-finite steps stopped the run
(its last good checkpoint is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path

from parallax.config import (Config, UserError, apply_overrides, check_fields, default_workdir, devices_needed,
                             flatten, load_experiment, resolve_mesh_shape, validate)
from parallax.distributed import (StopSignals, WorkdirLock, accelerator_platform, apply_overlap_flags, error_prefix,
                                  initialize, process_spec)

EXIT_USAGE = 2
EXIT_DIVERGED = 3  # distinct from user errors: a scheduler should not blindly restart it
RUN_FILE = "run.json"  # the config a workdir's run started with: a rerun before any checkpoint is that run again


class WorkdirError(UserError):
    """The workdir cannot hold this run: it holds another one, it is in use, or it is unusable."""


class TrainingDiverged(RuntimeError):
    """`train.max_bad_steps` consecutive steps had a non-finite loss, gradient norm or update."""


def has_accelerator() -> bool:
    """Whether JAX will find a GPU/TPU, decided without importing JAX."""
    return accelerator_platform() is not None


def configure_host_devices(cfg: Config, processes: int = 1) -> str:
    """Before JAX starts: on an accelerator, add the collective-overlap XLA flags; on a CPU-only
    machine, simulate the mesh's devices, split evenly over `processes`. Returns the line(s) to print."""
    platform = accelerator_platform()
    if platform is not None:
        flags_line = apply_overlap_flags(platform)
        return "parallax: using the accelerators JAX finds" + (f"\n{flags_line}" if flags_line else "")
    # No accelerator: JAX is told so before it starts. Otherwise an installed libtpu or CUDA
    # plugin (the test extra installs libtpu for the compile-only targets) probes for its
    # hardware and prints its failure to find any on the user's screen.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return "parallax: no accelerator; using the CPU device count set in XLA_FLAGS"
    n = devices_needed(cfg.mesh)
    if n % processes:
        raise UserError(f"the mesh needs {n} devices, which {processes} processes cannot simulate in equal "
                        "shares; choose mesh sizes whose product is a multiple of --num-processes")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n // processes}".strip()
    if processes > 1:
        return f"parallax: no accelerator found; simulating {n // processes} CPU devices in each of {processes} processes"
    return f"parallax: no accelerator found; simulating {n} CPU devices for the mesh (XLA_FLAGS overrides)"


def known_device_count(cfg: Config, processes: int = 1, platform: str | None = None) -> int | None:
    """The device count JAX will see, where it is known before JAX starts: on a CPU-only machine
    the simulated count (XLA_FLAGS's, or the one `configure_host_devices` will set); None on an
    accelerator (JAX finds them)."""
    if platform is not None:
        return None
    m = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) * processes if m else devices_needed(cfg.mesh)


def preflight(cfg: Config, n_devices: int | None) -> None:
    """Everything that can be checked from the config alone, before JAX starts: every field's
    range, then, with mesh sizes known (the device count, or no -1 axis), the mesh and every rule
    of `config.validate` (a mesh of 100,000 simulated CPU devices would otherwise be created
    before its batch was found indivisible). The same checks run again on the real mesh."""
    check_fields(cfg)
    sizes = dataclasses.asdict(cfg.mesh)
    if n_devices is None:
        fixed = math.prod(v for v in sizes.values() if v > 0)
        resolved = resolve_mesh_shape(cfg.mesh, fixed)  # the checks of the sizes themselves
        if -1 in sizes.values():
            return  # an accelerator's count is JAX's to find: the rest waits for the mesh
    else:
        resolved = resolve_mesh_shape(cfg.mesh, n_devices)
    validate(cfg, resolved)


def check_workdir_path(workdir: Path) -> None:
    """A workdir that cannot be one, found before JAX starts, touching nothing: a file, a dangling
    symlink, an unwritable directory or parent, a read-only metrics.jsonl or checkpoints/ (a resume
    appends and saves there)."""
    label = f"workdir {str(workdir)!r}"
    if workdir.is_symlink() and not workdir.exists():
        raise WorkdirError(f"{label} is a dangling symlink (to {os.readlink(workdir)!r}); remove it, or create the "
                           "directory it names")
    if workdir.exists():
        if not workdir.is_dir():
            raise WorkdirError(f"{label} is a file, not a directory; choose another --workdir")
        for path in (workdir, workdir / "checkpoints", workdir / "metrics.jsonl"):
            mode = os.W_OK | (os.X_OK if path.is_dir() else 0)
            if path.exists() and not os.access(path, mode):
                what = label if path == workdir else f"{label}: {path.name}"
                raise WorkdirError(f"{what} is not writable (read-only); a run writes there: make it writable or "
                                   "choose another --workdir")
        return
    parent = workdir.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        raise WorkdirError(f"{label} cannot be created: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WorkdirError(f"{label} cannot be created: {str(parent)!r} is not writable")


def _layout_lines(cfg: Config, mesh) -> list[str]:
    from parallax.mesh import AXES, describe

    zero = {0: "", 1: "; ZeRO-1 optimizer state on embed", 3: "; ZeRO-3 params + optimizer state on embed"}
    roles = {
        "data": "batch" + zero[cfg.parallel.zero],
        "tensor": "heads, kv_heads, mlp, vocab (Megatron column/row split)",
        "pipe": f"pipeline stages; {cfg.parallel.schedule}, {cfg.parallel.microbatches} microbatches, "
                f"{cfg.parallel.repeats} chunk(s) per stage",
        "expert": f"{cfg.model.moe.num_experts} experts (all_to_all in each MoE layer); batch outside MoE layers",
    }
    lines = [f"mesh: {describe(mesh)}"]
    for a in AXES:
        role = roles[a] if mesh.shape[a] > 1 else "-"
        lines.append(f"  {a:<7}{mesh.shape[a]:>4}  {role}")
    return lines


def _params_per_device(abstract_params, shardings) -> int:
    import jax

    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape)
        total += math.prod(shard)
    return total


def _check_workdir(workdir: Path, cfg: Config, overwrite: bool, fresh: bool, steps: list[int]) -> bool:
    """Resuming is the default; no flag deletes a checkpoint. Raises before anything is written.
    True when the workdir's records are this very run's, killed before its first checkpoint: it
    starts again from step 0 (and its records are written again)."""
    from parallax.metrics import holds_records

    if steps and (fresh or overwrite):
        flag = "--fresh" if fresh else "--overwrite"
        raise WorkdirError(
            f"workdir {str(workdir)!r} holds checkpoints (latest step {steps[-1]}) that a run without "
            f"{flag} resumes from; {flag} never deletes them: move {str(workdir / 'checkpoints')!r} away "
            "or choose another --workdir"
        )
    metrics = workdir / "metrics.jsonl"
    if steps or overwrite or not holds_records(metrics):  # an empty file is a start that failed: not a run
        return False
    if not fresh and _run_file(workdir) == _fixed(cfg):
        return True
    raise WorkdirError(
        f"workdir {str(workdir)!r} already holds a run ({metrics.name}) and no checkpoint to resume from; "
        "choose another --workdir or pass --overwrite to replace it"
    )


def _fixed(cfg: Config) -> dict:
    from parallax.checkpoint import IDENTITY, STRUCTURAL

    flat = flatten(cfg)
    return {k: flat[k] for k in STRUCTURAL + IDENTITY}


def _run_file(workdir: Path) -> dict | None:
    try:
        return json.loads((workdir / RUN_FILE).read_text())["fixed"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_run_file(workdir: Path, cfg: Config) -> None:
    """WORKDIR/run.json: the fields that make a rerun the same run (checkpoint.py's STRUCTURAL and
    IDENTITY) and the config, written (atomically) when a run starts from step 0."""
    path, tmp = workdir / RUN_FILE, workdir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"fixed": _fixed(cfg), "config": flatten(cfg)}, indent=1) + "\n")
    os.replace(tmp, path)


def _any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any: a collective, so every process calls it
    at the same point (a signal may reach them at different steps; a directory listing may
    differ in time). One process: `flag` itself."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def _claim(lock: WorkdirLock, workdir: Path, lead: bool, create: bool) -> None:
    """Process 0 takes the workdir lock; every process follows its verdict (a collective). With
    `create` False only an existing lock file is tried. Another run holding it: one line, exit 2,
    nothing touched (the lock file is the holder's)."""
    got = lock.acquire(create) if lead else True
    if _any_process(got is False):
        raise WorkdirError(f"workdir {str(workdir)!r} is in use by another parallax run{lock.holder() if lead else ''}; "
                           "wait for it to end (or stop it), or choose another --workdir")


def _open_data(cfg: Config):
    from parallax.data import open_data

    try:
        return open_data(cfg)
    except OSError as e:  # unreadable (permissions, I/O error): data.py checks existence and form
        raise UserError(f"data file {cfg.data.source!r} cannot be read ({e.strerror or e})") from None


def run(cfg: Config, workdir: Path, overwrite: bool = False, fresh: bool = False,
        stop_at: int | None = None, signals: StopSignals | None = None) -> dict:
    """Train `cfg`, resuming from the newest checkpoint in `workdir`; returns the last metrics
    record ({} when there was nothing left to train). JAX is imported here, not at module load."""
    lock = WorkdirLock(workdir)
    try:
        if signals is not None:
            return _run(cfg, workdir, overwrite, fresh, stop_at, signals, lock)
        with StopSignals() as signals:
            return _run(cfg, workdir, overwrite, fresh, stop_at, signals, lock)
    finally:
        lock.release()


def _run(cfg: Config, workdir: Path, overwrite: bool, fresh: bool, stop_at: int | None, signals: StopSignals,
         lock: WorkdirLock) -> dict:
    import jax
    import numpy as np

    from parallax.checkpoint import CheckpointError, Checkpoints, make_meta
    from parallax.data import make_global_batch
    from parallax.mesh import make_mesh
    from parallax.metrics import MetricsError, MetricsWriter, NoiseScale, Progress, drop_replayed, mfu, peak_flops, \
        tflops_per_device
    from parallax.model import count_params, flops_per_token
    from parallax.train_state import init_state, make_layout
    from parallax.train_step import batch_sharding, make_eval_step, make_train_step

    mesh = make_mesh(cfg.mesh)
    validate(cfg, dict(mesh.shape))
    train_data, val_data = _open_data(cfg)
    lead = jax.process_index() == 0
    checkpoints = Checkpoints(workdir, cfg.checkpoint)
    _claim(lock, workdir, lead, create=False)  # a live run here: refused before anything is read
    saved_steps = checkpoints.steps()
    again = _check_workdir(workdir, cfg, overwrite, fresh, saved_steps)

    say = print if lead else (lambda *a, **k: None)
    for line in _layout_lines(cfg, mesh):
        say(line)
    layout = make_layout(cfg, mesh)
    n_total = count_params(cfg.model)["total"]
    n_local = _params_per_device(layout.abstract_state.params, layout.param_shardings)
    say(f"params: {n_total:,} total, {n_local:,} per device; workdir {workdir}")
    if cfg.fp8.enabled:
        emulated = mesh.devices.flat[0].platform == "cpu"
        say(f"fp8: {cfg.fp8.recipe} scaling, E4M3 inputs/weights, E5M2 gradients"
            + ("; emulated on CPU (FP8 dots run upcast): numerics only, not speed" if emulated else ""))

    # Restoring reads only; a config that does not fit the checkpoint fails here, before any write.
    restored = checkpoints.restore(cfg, layout) if saved_steps else None
    workdir.mkdir(parents=True, exist_ok=True)  # only now: every user input has been checked
    _claim(lock, workdir, lead, create=True)
    # Another run may have saved here before this one held the lock. The collective also keeps
    # process 0 from creating `checkpoints/` (in `checkpoints.open` below) before every process
    # has listed it: a process listing it later would find the new directory and open an Orbax
    # reader, whose barriers the others never join ("sync_global_devices name mismatch", seen in
    # CI with two processes).
    if _any_process(checkpoints.steps() != saved_steps):
        saved_steps = checkpoints.steps()
        restored = checkpoints.restore(cfg, layout) if saved_steps else None
    again = _check_workdir(workdir, cfg, overwrite, fresh, saved_steps)  # and its records, now under the lock
    if lead and lock.unsupported:
        print(f"parallax: warning: the filesystem of {str(workdir)!r} takes no file locks ({lock.unsupported}): "
              "a second run in this workdir would not be refused", file=sys.stderr, flush=True)
    end = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
    if lead and (restored.step if restored else 0) < end:
        lock.record()  # who holds the workdir, for the message refusing another run (a no-op run writes nothing)
    for damaged, moved_to in checkpoints.open(layout, restored.damaged if restored else []):
        print(f"parallax: warning: checkpoint step {damaged.step} is damaged or partial ({damaged.reason}); "
              f"moved it to {moved_to} and fell back to the previous checkpoint", file=sys.stderr, flush=True)
    if restored is not None:
        state, start, skipped = restored.state, restored.step, int(restored.meta.get("skipped_steps", 0))
        say(f"resuming from checkpoint step {start} in {checkpoints.directory} "
            f"(written on {restored.meta.get('mesh', '?')})")
    else:
        state, start, skipped = init_state(cfg, layout), 0, 0
    if start >= end:
        checkpoints.close()
        say(f"nothing to train: the checkpoint is at step {start} and the run ends at step {end}")
        return {}
    # metrics.jsonl, before compiling: an unwritable file is found now, and the records of steps
    # past the checkpoint (a kill or a failed save since) go: the run writes them again.
    resuming = restored is not None or again
    if lead and resuming:
        dropped, last = drop_replayed(workdir / "metrics.jsonl", start)
        if dropped:
            say(f"metrics.jsonl: dropped {dropped} records of steps after {start} (repeated now)")
    if lead and restored is None:
        _write_run_file(workdir, cfg)
    writer = MetricsWriter(workdir, enabled=lead, mode="a" if resuming else "w",
                           purge_step=start + 1 if resuming else None)
    if restored is not None:  # records a full disk kept out of metrics.jsonl, saved with the checkpoint
        for rec in restored.meta.get("unwritten_records", []):
            if lead and rec["step"] > last:
                writer.write(rec)
    bsh = batch_sharding(mesh)
    train_step, eval_step = make_train_step(cfg, layout), make_eval_step(layout)
    t = cfg.train
    tokens_per_step = t.global_batch * t.seq_len
    flops_per_step = flops_per_token(cfg.model, t.seq_len) * tokens_per_step
    peak = peak_flops(mesh.devices.flat[0].device_kind)
    peak_fp8 = peak_flops(mesh.devices.flat[0].device_kind, fp8=True)
    n_dev = mesh.devices.size
    # Gradient noise scale: per-shard (B / (data x expert) sequences) and global-batch gradient
    # norms, EMA-smoothed here; restarts on resume (the EMA is not checkpointed).
    noise = NoiseScale() if t.noise_scale else None
    shard_batch = t.global_batch // (mesh.shape["data"] * mesh.shape["expert"])

    def evaluate() -> float:
        losses = [eval_step(state.params, make_global_batch(val_data, i, bsh), state.fp8) for i in range(t.eval_batches)]
        return float(np.mean([float(x) for x in losses]))

    started = time.perf_counter()
    batch = make_global_batch(train_data, start, bsh)
    compiled = train_step.lower(state, batch).compile()
    say(f"compiled train step in {time.perf_counter() - started:.1f} s")

    def save(step: int, unwritten: list[dict]) -> None:
        meta = make_meta(cfg, step, mesh, skipped_steps=skipped, unwritten_records=unwritten)
        path = checkpoints.save(step, state, meta)
        signals.saving = f"the save of checkpoint step {step}"
        say(f"checkpoint: saving step {step} to {path} (async)", flush=True)

    record: dict = {}
    bubble = layout.schedule.bubble_fraction if layout.schedule is not None else None
    bad_run, diverged, failed, unwritten = 0, None, None, []
    signals.training = True
    # Leaving `checkpoints` waits for the last save: no exit, not even an error, abandons one.
    try:
        with writer, checkpoints, Progress(t.steps, enabled=lead) as progress:
            for step in range(start, end):
                t0 = time.perf_counter()
                state, metrics = compiled(state, batch)
                if step + 1 < end:  # build the next batch on the host while the device computes
                    batch = make_global_batch(train_data, step + 1, bsh)
                metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
                dt = time.perf_counter() - t0
                done = step + 1
                record = {
                    "step": done,
                    "loss": metrics["loss"],
                    "tokens_per_s": tokens_per_step / dt,
                    "step_time_s": dt,
                    "tflops_per_device": tflops_per_device(flops_per_step, dt, n_dev),
                    "mfu": mfu(flops_per_step, dt, n_dev, peak),
                    "lr": metrics["lr"],
                    "grad_norm": metrics["grad_norm"],
                }
                if layout.schedule is not None:  # counted from the schedule's own table, every step
                    record["pipeline_ticks"] = layout.schedule.ticks
                    record["bubble_fraction"] = bubble
                if cfg.fp8.enabled:  # MFU against the FP8 peak as well, and FP8 numerics per tensor kind
                    record["mfu_fp8"] = mfu(flops_per_step, dt, n_dev, peak_fp8)
                    record.update({k: v for k, v in metrics.items() if k.startswith("fp8_")})
                record.update({k: v for k, v in metrics.items() if k.startswith("moe_")})  # routing, per MoE layer
                if noise is not None:  # B_simple in sequences (null until defined); a skipped step does not feed it
                    small, big = metrics["grad_sq_small"], metrics["grad_sq_big"]
                    if metrics["finite"]:
                        noise.update(small, big, shard_batch, t.global_batch)
                    record.update(noise_scale=noise.value, grad_sq_small=small, grad_sq_big=big)
                # The step already left the state as it was if this was false (train_step's guard).
                bad_run = 0 if metrics["finite"] else bad_run + 1
                skipped += int(not metrics["finite"])
                record["skipped_steps"] = skipped
                if (t.eval_every > 0 and done % t.eval_every == 0) or done == t.steps:
                    record["eval_loss"] = evaluate()
                if done % t.log_every == 0 or done in (t.steps, end) or "eval_loss" in record or bad_run:
                    try:
                        writer.write(record)
                    except MetricsError as e:  # a full disk, say: save first, then one line
                        failed, unwritten = e, [record]
                progress.update(done, record)
                if bad_run >= t.max_bad_steps:
                    diverged = (f"{bad_run} consecutive steps ({done - bad_run + 1}-{done}) had a non-finite loss, "
                                f"gradient norm or update (train.max_bad_steps={t.max_bad_steps}); stopped without "
                                "saving. ")
                    break
                stopping = _any_process(signals.received is not None or failed is not None)
                periodic = cfg.checkpoint.every > 0 and done % cfg.checkpoint.every == 0 and not bad_run
                if (periodic or stopping or done == end) and checkpoints.last_saved != done:
                    save(done, unwritten)
                if stopping:
                    break
    except CheckpointError as e:
        if failed is not None:  # the save that was to keep the steps failed too
            raise WorkdirError(f"{failed}; {e}") from e
        raise
    if writer.tb_error:
        print(f"parallax: warning: TensorBoard events under {str(workdir / 'tb')!r} could not all be written "
              f"({writer.tb_error}); metrics.jsonl holds every record", file=sys.stderr, flush=True)
    if failed is not None:
        raise WorkdirError(f"{failed}; checkpoint step {done} was saved to {checkpoints.path(done)} first, with that "
                           "record: make room, then run the same command to resume")
    if diverged is not None:  # the last save has been waited for: it is finalized
        good = checkpoints.last_saved if checkpoints.last_saved is not None else start or None
        raise TrainingDiverged(diverged + (f"The last good checkpoint is step {good} in {checkpoints.directory}"
                                           if good else "No checkpoint was written"))
    if signals.received:
        say(f"parallax: {signals.received} received: stopped after step {done}; checkpoint saved to "
            f"{checkpoints.path(done)}; run the same command to resume", flush=True)
    elif done < t.steps:
        say(f"stopped at step {done} (--stop-at); checkpoint saved to {checkpoints.path(done)}")
    else:
        say(f"done: step {record['step']} loss {record['loss']:.4f} "
            f"eval_loss {record.get('eval_loss', float('nan')):.4f}")
    return record


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an experiment")
    p.add_argument("experiment", help="an experiment file defining get_config()")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--workdir", help="output directory (default runs/<experiment name>)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace metrics.jsonl of an earlier run that left no checkpoint")
    p.add_argument("--fresh", action="store_true",
                   help="start from step 0; refuse (exit 2) if the workdir holds a checkpoint")
    p.add_argument("--stop-at", type=int, metavar="STEP",
                   help="save and exit 0 after this step, as if preempted; the next run resumes")
    g = p.add_argument_group("multi-process (one process per host; SLURM, Open MPI and Cloud TPU are detected)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env PARALLAX_COORDINATOR)")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the run (env PARALLAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (env PARALLAX_PROCESS_ID)")
    g.add_argument("--heartbeat-timeout", type=int, metavar="S",
                   help="a peer silent this long counts as dead and stops the run (env PARALLAX_HEARTBEAT_TIMEOUT; "
                        "default 100)")


def train_command(args: argparse.Namespace, signals: StopSignals | None = None) -> int:
    # From here on (from the interpreter's start, when __main__ passes them) a signal gets its line.
    with contextlib.nullcontext(signals) if signals is not None else StopSignals() as signals:
        cfg = apply_overrides(load_experiment(args.experiment), args.set)
        if args.stop_at is not None and args.stop_at <= 0:
            raise UserError(f"--stop-at: must be a positive step, got {args.stop_at}")
        platform = accelerator_platform()
        spec = process_spec(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout,
                            platform=platform)
        processes = (spec and spec.num_processes) or 1
        workdir = Path(args.workdir) if args.workdir else default_workdir(cfg)
        preflight(cfg, known_device_count(cfg, processes, platform))  # before JAX starts
        check_workdir_path(workdir)
        print(configure_host_devices(cfg, processes), flush=True)
        if spec is not None:  # before JAX's first computation, after the XLA flags are final
            print(initialize(spec, platform), flush=True)
        run(cfg, workdir, overwrite=args.overwrite, fresh=args.fresh, stop_at=args.stop_at, signals=signals)
    return 0


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or ("RESOURCE_EXHAUSTED" in text and "memory" in text.lower()
                                          and "os_error_code" not in text)


# Libraries' own lines around parallax's one line (Orbax's absl errors for a failed save, its
# CheckpointHandlerRegistry advice, asyncio's "Future exception was never retrieved" for the
# writes a full disk abandoned): silenced unless --debug; for the CLI's process, to its end.
_QUIET_LOGGERS = ("absl", "asyncio")


def main(argv: list[str] | None = None, signals: StopSignals | None = None) -> int:
    """The CLI; returns the exit status. `signals`: already watching (parallax.__main__)."""
    parser = argparse.ArgumentParser(prog="parallax", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    from parallax.audit import add_audit_parser, audit_command  # neither imports JAX at module load
    from parallax.plan import add_plan_parser, plan_command

    add_audit_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    if not args.debug:
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        if args.command == "audit":  # sizes the simulated CPU devices before JAX starts, as train does
            return audit_command(args, configure_host_devices)
        if args.command == "plan":
            return plan_command(args)
        return train_command(args, signals)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"{error_prefix()}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as e:
        print(f"{error_prefix()}: error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if _out_of_memory(e) and not args.debug:  # too big for the devices: the user's to fix
            print(f"{error_prefix()}: error: out of memory ({first[:300]}); reduce train.global_batch, train.seq_len "
                  "or the model, or use more devices (`parallax plan` estimates the memory per device)", file=sys.stderr)
            return EXIT_USAGE
        if error_prefix() == "parallax":
            raise
        # Several processes: a normal exit would wait in jax.distributed's shutdown barrier (300 s)
        # while the peers wait in a collective; exiting at once stops the heartbeats, so the peers
        # are stopped within the heartbeat timeout instead.
        traceback.print_exc()
        print(f"{error_prefix()}: error: {type(e).__name__}: {first} (in a multi-process run this often means "
              "another process died first: its log has the cause)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    finally:
        if argv is not None:  # called in-process (tests): leave the loggers as they were
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
