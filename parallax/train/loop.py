"""The training run: the workdir it owns, start or resume, the step loop, evaluation, saves, and
the metrics record of each step.

A workdir is locked for the life of a run (WORKDIR/.parallax.lock, an OS lock that dies with the
process); a second run on it is refused. A workdir with checkpoints is resumed (metrics.jsonl is
appended to, after the records of steps past the checkpoint are dropped: the resumed run writes
them again); checkpoints are never deleted by a flag. SIGTERM/SIGINT finish the step, save and exit
0; a second one waits for that save, a third abandons it; during start-up one stops at once (nothing
was saved: no step ran). `train.max_bad_steps` consecutive non-finite steps stop the run
(`TrainingDiverged`; its last good checkpoint is kept).

Every session appends its events (start, compile, each step's time, evaluations, save stalls,
end) to WORKDIR/events.jsonl; the goodput read from them (goodput.py) goes into each record and
the last line. `--profile-steps` traces a window of steps (profiler.py).

Does not import JAX at module load: the command line sizes the simulated devices first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.config import Config, UserError, flatten, logs_at
from parallax.train.distributed import StopSignals, WorkdirLock

RUN_FILE = "run.json"  # the config a workdir's run started with: a rerun before any checkpoint is that run again
_FIRST_RUN = [True]  # the process's first run starts at the process's start (imports count); a later one at its call


class WorkdirError(UserError):
    """The workdir cannot hold this run: it holds another one, it is in use, or it is unusable."""


class TrainingDiverged(RuntimeError):
    """`train.max_bad_steps` consecutive steps had a non-finite loss, gradient norm or update."""


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


def _check_workdir(workdir: Path, cfg: Config, overwrite: bool, fresh: bool, steps: list[int]) -> bool:
    """Resuming is the default; no flag deletes a checkpoint. Raises before anything is written.
    True when the workdir's records are this very run's, killed before its first checkpoint: it
    starts again from step 0 (and its records are written again)."""
    from parallax.train.metrics import holds_records

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
    from parallax.train.checkpoint import IDENTITY, STRUCTURAL

    flat = flatten(cfg)
    return {k: flat[k] for k in STRUCTURAL + IDENTITY}


def _run_file(workdir: Path) -> dict | None:
    try:
        return json.loads((workdir / RUN_FILE).read_text())["fixed"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_run_file(workdir: Path, cfg: Config) -> None:
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


def _open_data(cfg: Config, resolve: bool = False):
    """(train, validation) batch sources of `cfg` (input.py); `resolve`: `cfg` with the eod_id of its
    prepared directories instead (input.resolve_data)."""
    from parallax.config import data_sources
    from parallax.train.input import open_input, resolve_data

    try:
        return resolve_data(cfg) if resolve else open_input(cfg)
    except OSError as e:  # unreadable (permissions, I/O error): data.py and prepare.py check existence and form
        where = str(getattr(e, "filename", None) or ", ".join(data_sources(cfg.data)[0]))
        label = "prepared data" if Path(where).is_dir() else "data file"
        raise UserError(f"{label} {where!r} cannot be read ({e.strerror or e})") from None


def _warn(line: str) -> None:
    print(f"parallax: warning: {line}", file=sys.stderr, flush=True)


def run(cfg: Config, workdir: Path, overwrite: bool = False, fresh: bool = False,
        stop_at: int | None = None, signals: StopSignals | None = None, profile=None) -> dict:
    """Train `cfg`, resuming from the newest checkpoint in `workdir`; returns the last metrics
    record ({} when there was nothing left to train). `profile`: a profiler.ProfileWindow to trace.
    JAX is imported here, not at module load."""
    from parallax.train.goodput import process_start_time

    began = process_start_time() if _FIRST_RUN[0] else time.time()
    _FIRST_RUN[0] = False
    lock = WorkdirLock(workdir)
    opts = dict(overwrite=overwrite, fresh=fresh, stop_at=stop_at, lock=lock, profile=profile, began=began)
    try:
        if signals is not None:
            return _run(cfg, workdir, signals=signals, **opts)
        with StopSignals() as signals:
            return _run(cfg, workdir, signals=signals, **opts)
    finally:
        lock.release()


@dataclass(frozen=True)
class _Start:
    """Where a run begins: a restored checkpoint or a fresh state."""

    state: Any
    step: int
    skipped: int  # non-finite steps skipped so far (carried in the checkpoint)
    restored: Any  # checkpoint.Restored, or None when starting from step 0
    again: bool  # the workdir's records are this run's, killed before its first checkpoint

    @property
    def resuming(self) -> bool:
        return self.restored is not None or self.again


def _run(cfg: Config, workdir: Path, overwrite: bool, fresh: bool, stop_at: int | None, signals: StopSignals,
         lock: WorkdirLock, profile, began: float) -> dict:
    import jax

    from parallax.train.build import build
    from parallax.train.checkpoint import Checkpoints
    from parallax.train.goodput import EventLog
    from parallax.train.profiler import StepProfiler

    cfg = _open_data(cfg, resolve=True)  # before build: a prepared directory's eod_id shapes the step
    built = build(cfg)
    data = _open_data(cfg)
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    checkpoints = Checkpoints(workdir, cfg.checkpoint)
    end = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
    start = _begin(cfg, built, workdir, checkpoints, lock, lead, say, overwrite, fresh, end, profile)
    if start.step >= end:
        checkpoints.close()
        say(f"nothing to train: the checkpoint is at step {start.step} and the run ends at step {end}")
        return {}
    writer = _open_records(cfg, workdir, lead, say, start)
    events = EventLog(workdir, enabled=lead, fresh=overwrite)  # --overwrite replaces another run's log
    events.write("start", t=began, step=start.step, pid=os.getpid())
    training = _Training(cfg, built, start, data, checkpoints, signals, lead, say, events,
                         StepProfiler(profile, workdir, say, lead))
    training.steps(writer, end)
    return training.finish(writer, workdir, end)


def _begin(cfg: Config, built, workdir: Path, checkpoints, lock: WorkdirLock, lead: bool, say, overwrite: bool,
           fresh: bool, end: int, profile=None) -> _Start:
    """Claim the workdir, check that it can hold this run, say what runs, then restore or initialise."""
    from parallax.train.train_state import init_state

    _claim(lock, workdir, lead, create=False)  # a live run here: refused before anything is read
    saved_steps = checkpoints.steps()
    _check_workdir(workdir, cfg, overwrite, fresh, saved_steps)
    _announce(cfg, built, workdir, say)
    # Restoring reads only; a config that does not fit the checkpoint fails here, before any write.
    restored = checkpoints.restore(cfg, built.layout) if saved_steps else None
    if profile is not None:  # the steps this run executes are known now: the window must be inside them
        profile.check_start(restored.step if restored else 0, end)
    workdir.mkdir(parents=True, exist_ok=True)  # only now: every user input has been checked
    _claim(lock, workdir, lead, create=True)
    # Another run may have saved here before this one held the lock. The collective also keeps
    # process 0 from creating `checkpoints/` (in `checkpoints.open` below) before every process
    # has listed it: a process listing it later would find the new directory and open an Orbax
    # reader, whose barriers the others never join ("sync_global_devices name mismatch", seen in
    # CI with two processes).
    if _any_process(checkpoints.steps() != saved_steps):
        saved_steps = checkpoints.steps()
        restored = checkpoints.restore(cfg, built.layout) if saved_steps else None
    again = _check_workdir(workdir, cfg, overwrite, fresh, saved_steps)  # and its records, now under the lock
    if lead and lock.unsupported:
        _warn(f"the filesystem of {str(workdir)!r} takes no file locks ({lock.unsupported}): "
              "a second run in this workdir would not be refused")
    if lead and (restored.step if restored else 0) < end:
        lock.record()  # who holds the workdir, for the message refusing another run (a no-op run writes nothing)
    for damaged, moved_to in checkpoints.open(built.layout, restored.damaged if restored else []):
        _warn(f"checkpoint step {damaged.step} is damaged or partial ({damaged.reason}); "
              f"moved it to {moved_to} and fell back to the previous checkpoint")
    if restored is None:
        return _Start(init_state(cfg, built.layout), 0, 0, None, again)
    say(f"resuming from checkpoint step {restored.step} in {checkpoints.directory} "
        f"(written on {restored.meta.get('mesh', '?')})")
    return _Start(restored.state, restored.step, int(restored.meta.get("skipped_steps", 0)), restored, again)


def _announce(cfg: Config, built, workdir: Path, say) -> None:
    """The layout, the parameter counts and the FP8 recipe, printed once when a run starts."""
    from parallax.model.transformer import count_params

    for line in built.describe():
        say(line)
    n_total = count_params(cfg.model)["total"]
    say(f"params: {n_total:,} total, {built.params_per_device():,} per device; workdir {workdir}")
    if cfg.fp8.enabled:
        emulated = built.platform == "cpu"
        say(f"fp8: {cfg.fp8.recipe} scaling, E4M3 inputs/weights, E5M2 gradients"
            + ("; emulated on CPU (FP8 dots run upcast): numerics only, not speed" if emulated else ""))


def _open_records(cfg: Config, workdir: Path, lead: bool, say, start: _Start):
    """metrics.jsonl, before compiling: an unwritable file is found now, and the records of steps
    past the checkpoint (a kill or a failed save since) go: the run writes them again."""
    from parallax.train.metrics import MetricsWriter, drop_replayed

    last = 0
    if lead and start.resuming:
        dropped, last = drop_replayed(workdir / "metrics.jsonl", start.step)
        if dropped:
            say(f"metrics.jsonl: dropped {dropped} records of steps after {start.step} (repeated now)")
    if lead and start.restored is None:
        write_run_file(workdir, cfg)
    tracker = None
    if lead and cfg.metrics.wandb:  # wandb is imported only here (cli.preflight checked that it imports)
        from parallax.train.tracker import WandbTracker

        tracker = WandbTracker(cfg, workdir, start.resuming)
    writer = MetricsWriter(workdir, enabled=lead, mode="a" if start.resuming else "w",
                           purge_step=start.step + 1 if start.resuming else None, tracker=tracker)
    if start.restored is not None:  # records a full disk kept out of metrics.jsonl, saved with the checkpoint
        for rec in start.restored.meta.get("unwritten_records", []):
            if lead and rec["step"] > last:
                writer.write(rec)
    return writer


class StepRecord:
    """The metrics record of one step: throughput, MFU, the optimizer's figures, the pipeline's
    ticks and bubble, FP8 and MoE telemetry, the gradient noise scale."""

    def __init__(self, cfg: Config, built):
        from parallax.train.metrics import NoiseScale, peak_flops
        from parallax.parallel.residuals import keeps
        from parallax.schedules import COMPILED_COSTS, kept_costs
        from parallax.model.transformer import flops_per_token

        t = cfg.train
        self.fp8 = cfg.fp8.enabled
        self.global_batch = t.global_batch
        self.tokens_per_step = t.global_batch * t.seq_len
        self.flops_per_step = flops_per_token(cfg.model, t.seq_len) * self.tokens_per_step
        self.peak = peak_flops(built.device_kind)
        self.peak_fp8 = peak_flops(built.device_kind, fp8=True)
        self.n_dev = built.n_devices
        self.schedule = built.schedule
        self.bubble = self.schedule.bubble_fraction if self.schedule is not None else None
        self.ticks = self.schedule.ticks if self.schedule is not None else None
        # table schedules: the same table with its ticks in lockstep under the compiled op costs
        # (schedules.COMPILED_COSTS: ZB-H1's B and W each recompute the stage; kept_costs where
        # they start from F's residuals, for the model's attention share)
        self.bubble_compiled = None
        if self.schedule is not None and self.schedule.own_gradients:
            from parallax.model.transformer import attention_share

            model = built.layout.model
            if keeps(model, self.schedule):
                kernel = model.attend.kernel if model.attend is not None else "xla"
                costs = kept_costs(self.schedule.name, attention_share(cfg.model, t.seq_len, kernel))
            else:
                costs = COMPILED_COSTS[self.schedule.name]
            self.bubble_compiled = self.schedule.bubble_fraction_at(costs)
        # Gradient noise scale: per-shard (B / batch shards sequences) and global-batch gradient
        # norms, EMA-smoothed here; restarts on resume (the EMA is not checkpointed).
        self.noise = NoiseScale() if t.noise_scale else None
        self.shard_batch = t.global_batch // built.batch_shards

    def __call__(self, done: int, metrics: dict[str, float], dt: float, skipped: int) -> dict:
        from parallax.train.metrics import mfu, tflops_per_device

        record = {
            "step": done,
            "loss": metrics["loss"],
            "tokens_per_s": self.tokens_per_step / dt,
            "step_time_s": dt,
            "tflops_per_device": tflops_per_device(self.flops_per_step, dt, self.n_dev),
            "mfu": mfu(self.flops_per_step, dt, self.n_dev, self.peak),
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
        }
        if self.schedule is not None:  # counted from the schedule's own table, every step
            record["pipeline_ticks"] = self.ticks
            record["bubble_fraction"] = self.bubble
            if self.bubble_compiled is not None:
                record["bubble_fraction_compiled_costs"] = self.bubble_compiled
        if self.fp8:  # MFU against the FP8 peak as well, and FP8 numerics per tensor kind
            record["mfu_fp8"] = mfu(self.flops_per_step, dt, self.n_dev, self.peak_fp8)
            # the saturation/flush fractions are NaN on a step that did not compute them (config.logs_at)
            record.update({k: v for k, v in metrics.items() if k.startswith("fp8_") and v == v})
        record.update({k: v for k, v in metrics.items() if k.startswith("moe_")})  # routing, per MoE layer
        if self.noise is not None:  # B_simple in sequences (null until defined); a skipped step does not feed it
            small, big = metrics["grad_sq_small"], metrics["grad_sq_big"]
            if metrics["finite"]:
                self.noise.update(small, big, self.shard_batch, self.global_batch)
            record.update(noise_scale=self.noise.value, grad_sq_small=small, grad_sq_big=big)
        record["skipped_steps"] = skipped
        return record


class _Training:
    """The step loop of one run and what it leaves: the last record, and why it stopped."""

    def __init__(self, cfg: Config, built, start: _Start, data, checkpoints, signals: StopSignals, lead: bool, say,
                 events, profiler):
        self.cfg, self.built, self.checkpoints, self.signals, self.lead, self.say = \
            cfg, built, checkpoints, signals, lead, say
        self.events, self.profiler = events, profiler  # goodput.EventLog, profiler.StepProfiler
        self.train_data, self.val_data = data
        self.start, self.state, self.skipped = start.step, start.state, start.skipped
        self.train_step, self.eval_step = built.train_step(), built.eval_step()
        self.step_record = StepRecord(cfg, built)
        self.record: dict = {}
        self.done = start.step
        self.bad_run, self.diverged, self.failed, self.unwritten = 0, None, None, []
        self.input_wait = 0.0  # seconds this step's iteration waited for the next step's batch (input.Feed)

    def batch(self, data, step: int):
        from parallax.train.data import make_global_batch

        return make_global_batch(data, step, self.built.batch_sharding)

    def evaluate(self) -> float:
        import numpy as np

        state = self.state
        losses = [self.eval_step(state.params, self.batch(self.val_data, i), state.fp8)
                  for i in range(self.cfg.train.eval_batches)]
        return float(np.mean([float(x) for x in losses]))

    def save(self, step: int) -> None:
        from parallax.train.checkpoint import make_meta

        meta = make_meta(self.cfg, step, self.built.mesh, skipped_steps=self.skipped, unwritten_records=self.unwritten)
        path = self.checkpoints.save(step, self.state, meta)
        self.signals.saving = f"the save of checkpoint step {step}"
        self.say(f"checkpoint: saving step {step} to {path} (async)", flush=True)

    def steps(self, writer, end: int) -> None:
        """Steps from the start to `end`; leaving `checkpoints` waits for the last save: no exit,
        not even an error, abandons one."""
        from parallax.train.checkpoint import CheckpointError
        from parallax.train.input import Feed
        from parallax.train.metrics import Progress

        started = time.perf_counter()
        d = self.cfg.data
        feed = Feed(self.train_data, self.start, end, self.built.batch_sharding, d.prefetch, d.read_threads)
        try:
            batch, _ = feed.next()  # the threads keep filling the queue while the step compiles
            compiled = self.train_step.lower(self.state, batch).compile()
        except BaseException:
            feed.close()
            raise
        self.events.write("compiled", dt=time.perf_counter() - started)
        self.say(f"compiled train step in {time.perf_counter() - started:.1f} s")
        self.signals.training = True
        try:
            with writer, self.checkpoints, Progress(self.cfg.train.steps, enabled=self.lead) as progress:
                for step in range(self.start, end):
                    with self.profiler.annotate(step + 1):  # a no-op outside --profile-steps
                        t0 = time.perf_counter()
                        self.state, metrics = compiled(self.state, batch)
                        self.input_wait = 0.0
                        if step + 1 < end:  # the next batch, prepared ahead, placed while the device computes
                            batch, self.input_wait = feed.next()
                        metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
                        dt = time.perf_counter() - t0
                    self.profiler.after(step + 1, self.state)
                    if not self.after_step(step + 1, metrics, dt, writer, progress, end):
                        break
                self.profiler.stop()  # a window the loop left early (a signal): what was traced
                t0 = time.perf_counter()
                self.checkpoints.wait()  # the last save's stall is the run's, not the exit's
                self.events.write("save", sync=True, step=self.done, dt=time.perf_counter() - t0, final=True)
        except CheckpointError as e:
            if self.failed is not None:  # the save that was to keep the steps failed too
                raise WorkdirError(f"{self.failed}; {e}") from e
            raise
        finally:
            feed.close()
            self.profiler.stop(summary=False)  # an error stopped the window: keep the trace, say nothing more
            self.events.write("end", sync=True, step=self.done)
            self.events.close()

    def after_step(self, done: int, metrics: dict[str, float], dt: float, writer, progress, end: int) -> bool:
        """Record, evaluate, write, save; False when the run stops here."""
        from parallax.train.metrics import MetricsError

        t = self.cfg.train
        self.done = done
        # The step already left the state as it was if this was false (train_step's guard).
        self.bad_run = 0 if metrics["finite"] else self.bad_run + 1
        self.skipped += int(not metrics["finite"])
        record = self.record = self.step_record(done, metrics, dt, self.skipped)
        record["input_wait_s"] = self.input_wait  # of step_time_s: the host's input is the bottleneck when near it
        self.events.write("step", step=done, dt=dt, ok=bool(metrics["finite"]))
        if (t.eval_every > 0 and done % t.eval_every == 0) or done == t.steps:
            t0 = time.perf_counter()
            record["eval_loss"] = self.evaluate()
            self.events.write("eval", step=done, dt=time.perf_counter() - t0)
        record["goodput"] = self.events.summary().fraction  # of the wall time so far, every session
        if logs_at(t, done) or done == end or self.bad_run:
            try:
                writer.write(record)
            except MetricsError as e:  # a full disk, say: save first, then one line
                self.failed, self.unwritten = e, [record]
        progress.update(done, record)
        if self.bad_run >= t.max_bad_steps:
            self.diverged = (f"{self.bad_run} consecutive steps ({done - self.bad_run + 1}-{done}) had a non-finite "
                             f"loss, gradient norm or update (train.max_bad_steps={t.max_bad_steps}); stopped without "
                             "saving. ")
            return False
        stopping = _any_process(self.signals.received is not None or self.failed is not None)
        every = self.cfg.checkpoint.every
        periodic = every > 0 and done % every == 0 and not self.bad_run
        if (periodic or stopping or done == end) and self.checkpoints.last_saved != done:
            t0 = time.perf_counter()
            self.save(done)
            self.events.write("save", sync=True, step=done, dt=time.perf_counter() - t0)
        return not stopping

    def finish(self, writer, workdir: Path, end: int) -> dict:
        """The run's last lines, or the error that ends it; returns the last record."""
        done, checkpoints, record = self.done, self.checkpoints, self.record
        if writer.tb_error:
            _warn(f"TensorBoard events under {str(workdir / 'tb')!r} could not all be written "
                  f"({writer.tb_error}); metrics.jsonl holds every record")
        if self.events.error:
            _warn(f"{str(self.events.path)!r} could not all be written ({self.events.error}); the goodput misses "
                  "what it lost")
        if self.failed is not None:
            raise WorkdirError(f"{self.failed}; checkpoint step {done} was saved to {checkpoints.path(done)} first, "
                               "with that record: make room, then run the same command to resume")
        if self.diverged is not None:  # the last save has been waited for: it is finalized
            good = checkpoints.last_saved if checkpoints.last_saved is not None else self.start or None
            where = f"The last good checkpoint is step {good} in {checkpoints.directory}"
            raise TrainingDiverged(self.diverged + (where if good else "No checkpoint was written"))
        if self.signals.received:
            self.say(f"parallax: {self.signals.received} received: stopped after step {done}; checkpoint saved to "
                     f"{checkpoints.path(done)}; run the same command to resume", flush=True)
        elif done < self.cfg.train.steps:
            self.say(f"stopped at step {done} (--stop-at); checkpoint saved to {checkpoints.path(done)}")
        else:
            self.say(f"done: step {record['step']} loss {record['loss']:.4f} "
                     f"eval_loss {record.get('eval_loss', float('nan')):.4f}; {_goodput_text(self.events.tally.summary())}")
        return record


def _goodput_text(g) -> str:
    """'goodput 71.3% of 12.4 s (compile 2.1 s, ...)': the fraction, then where the rest went."""
    if g.fraction is None:
        return "goodput unknown"
    lost = [(name, v) for name, v in (("startup", g.startup_s), ("compile", g.compile_s), ("replayed", g.replayed_s),
                                      ("skipped", g.skipped_s), ("eval", g.eval_s), ("saves", g.save_s),
                                      ("other", g.other_s))
            if v >= 0.05 or (v > 0 and name in ("replayed", "skipped"))]  # a crash's loss is named, however small
    rest = ", ".join(f"{name} {v:.1f} s" if v >= 1 else f"{name} {v:.2f} s" for name, v in lost)
    return (f"goodput {g.fraction:.1%} of {g.wall_s:.1f} s over {g.sessions} session{'s' * (g.sessions != 1)}"
            + (f" ({rest})" if rest else ""))
