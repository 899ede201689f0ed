"""`parallax train EXPERIMENT.py [--set key=value ...] [--workdir DIR] [--fresh] [--stop-at STEP] [--debug]`.

Order matters: the config is read and the simulated CPU device count chosen before JAX is
imported (the XLA flag is read once, at backend start). Everything the user can get wrong (config,
mesh, data) is checked before the workdir is touched, so a bad invocation never overwrites
anything. User errors print one line and exit with status 2; `--debug` shows the traceback.

A workdir with checkpoints is resumed (metrics.jsonl is appended to); checkpoints are never deleted
by a flag. SIGTERM/SIGINT finish the step, save and exit 0. Exit 3: `train.max_bad_steps`
consecutive non-finite steps stopped the run (its last good checkpoint is kept).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from parallax.config import Config, UserError, apply_overrides, devices_needed, load_experiment
from parallax.distributed import accelerator_platform, apply_overlap_flags, error_prefix, initialize, process_spec

EXIT_USAGE = 2
EXIT_DIVERGED = 3  # distinct from user errors: a scheduler should not blindly restart it


class WorkdirError(UserError):
    """The workdir already holds a run that this one would overwrite."""


class TrainingDiverged(RuntimeError):
    """`train.max_bad_steps` consecutive steps had a non-finite loss or gradient norm."""


class StopSignals:
    """SIGTERM/SIGINT only set `received`: the loop finishes its step, saves and exits 0. The
    first signal restores the previous handlers, so a second one acts as it normally would."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal.signal's requirement
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name  # no I/O here: the loop reports it
        self.__exit__()

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


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


def _check_workdir(workdir: Path, overwrite: bool, fresh: bool, steps: list[int]) -> None:
    """Resuming is the default; no flag deletes a checkpoint. Raises before anything is written."""
    if steps and (fresh or overwrite):
        flag = "--fresh" if fresh else "--overwrite"
        raise WorkdirError(
            f"workdir {str(workdir)!r} holds checkpoints (latest step {steps[-1]}) that a run without "
            f"{flag} resumes from; {flag} never deletes them: move {str(workdir / 'checkpoints')!r} away "
            "or choose another --workdir"
        )
    metrics = workdir / "metrics.jsonl"
    if not steps and metrics.exists() and not overwrite:
        raise WorkdirError(
            f"workdir {str(workdir)!r} already holds a run ({metrics.name}) and no checkpoint to resume from; "
            "choose another --workdir or pass --overwrite to replace it"
        )


def _any_process(flag: bool) -> bool:
    """Every process must stop at the same step (a signal may reach them at different ones)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def run(cfg: Config, workdir: Path, overwrite: bool = False, fresh: bool = False,
        stop_at: int | None = None) -> dict:
    """Train `cfg`, resuming from the newest checkpoint in `workdir`; returns the last metrics
    record ({} when there was nothing left to train). JAX is imported here, not at module load."""
    import jax
    import numpy as np

    from parallax.checkpoint import Checkpoints, make_meta
    from parallax.config import validate
    from parallax.data import make_global_batch, open_data
    from parallax.mesh import make_mesh
    from parallax.metrics import MetricsWriter, NoiseScale, Progress, mfu, peak_flops, tflops_per_device
    from parallax.model import count_params, flops_per_token
    from parallax.train_state import init_state, make_layout
    from parallax.train_step import batch_sharding, make_eval_step, make_train_step

    mesh = make_mesh(cfg.mesh)
    validate(cfg, dict(mesh.shape))
    train_data, val_data = open_data(cfg)
    checkpoints = Checkpoints(workdir, cfg.checkpoint)
    saved_steps = checkpoints.steps()
    _check_workdir(workdir, overwrite, fresh, saved_steps)

    lead = jax.process_index() == 0
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
    for damaged, moved_to in checkpoints.open(layout, restored.damaged if restored else []):
        print(f"parallax: warning: checkpoint step {damaged.step} is damaged or partial ({damaged.reason}); "
              f"moved it to {moved_to} and fell back to the previous checkpoint", file=sys.stderr, flush=True)
    if restored is not None:
        state, start, skipped = restored.state, restored.step, int(restored.meta.get("skipped_steps", 0))
        say(f"resuming from checkpoint step {start} in {checkpoints.directory} "
            f"(written on {restored.meta.get('mesh', '?')})")
    else:
        state, start, skipped = init_state(cfg, layout), 0, 0
    end = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
    if start >= end:
        checkpoints.close()
        say(f"nothing to train: the checkpoint is at step {start} and the run ends at step {end}")
        return {}
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

    def save(step: int) -> None:
        meta = make_meta(cfg, step, mesh, skipped_steps=skipped)
        path = checkpoints.save(step, state, meta)
        say(f"checkpoint: saving step {step} to {path} (async)", flush=True)

    record: dict = {}
    bubble = layout.schedule.bubble_fraction if layout.schedule is not None else None
    bad_run, signals = 0, StopSignals()
    writer = MetricsWriter(workdir, enabled=lead, mode="w" if restored is None else "a")
    # Leaving `checkpoints` waits for the last save: no exit, not even an error, abandons one.
    with signals, writer, checkpoints, Progress(t.steps, enabled=lead) as progress:
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
                writer.write(record)
            progress.update(done, record)
            if bad_run >= t.max_bad_steps:
                good = checkpoints.last_saved if checkpoints.last_saved is not None else start or None
                raise TrainingDiverged(
                    f"{bad_run} consecutive steps ({done - bad_run + 1}-{done}) had a non-finite loss or gradient "
                    f"norm (train.max_bad_steps={t.max_bad_steps}); stopped without saving. "
                    + (f"The last good checkpoint is step {good} in {checkpoints.directory}" if good
                       else "No checkpoint was written")
                )
            stopping = _any_process(signals.received is not None)
            periodic = cfg.checkpoint.every > 0 and done % cfg.checkpoint.every == 0 and not bad_run
            if (periodic or stopping or done == end) and checkpoints.last_saved != done:
                save(done)
            if stopping:
                break
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


def train_command(args: argparse.Namespace) -> int:
    cfg = apply_overrides(load_experiment(args.experiment), args.set)
    if args.stop_at is not None and args.stop_at <= 0:
        raise UserError(f"--stop-at: must be a positive step, got {args.stop_at}")
    platform = accelerator_platform()
    spec = process_spec(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout,
                        platform=platform)
    print(configure_host_devices(cfg, (spec and spec.num_processes) or 1), flush=True)
    if spec is not None:  # before JAX's first computation, after the XLA flags are final
        print(initialize(spec, platform), flush=True)
    workdir = Path(args.workdir) if args.workdir else Path("runs") / cfg.name
    run(cfg, workdir, overwrite=args.overwrite, fresh=args.fresh, stop_at=args.stop_at)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parallax", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    from parallax.audit import add_audit_parser, audit_command  # neither imports JAX at module load
    from parallax.plan import add_plan_parser, plan_command

    add_audit_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "audit":  # sizes the simulated CPU devices before JAX starts, as train does
            return audit_command(args, configure_host_devices)
        if args.command == "plan":
            return plan_command(args)
        return train_command(args)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"{error_prefix()}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as e:
        print(f"{error_prefix()}: error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except Exception as e:
        if error_prefix() == "parallax":
            raise
        # Several processes: a normal exit would wait in jax.distributed's shutdown barrier (300 s)
        # while the peers wait in a collective; exiting at once stops the heartbeats, so the peers
        # are stopped within the heartbeat timeout instead.
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{error_prefix()}: error: {type(e).__name__}: {first} (in a multi-process run this often means "
              "another process died first: its log has the cause)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
