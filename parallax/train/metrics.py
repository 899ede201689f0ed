"""Run telemetry: peak FLOP/s per device, MFU, the metrics.jsonl/TensorBoard writer, progress.

MFU = achieved model FLOP/s / (n_devices * peak). The model FLOPs per step come from the caller
(the FLOP model lives with the model); this module only knows the hardware. Report BF16-peak MFU;
under FP8 also report FP8-peak MFU (`peak_flops(kind, fp8=True)`).

Does not import JAX: jax/numpy scalars are converted with `.item()`/`float()`, and the device
kind string is passed in (mesh.py is the only caller of `jax.devices()`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress as _RichProgress, TextColumn
from tensorboardX import SummaryWriter

from parallax.config import UserError

# Dense (no 2:4 sparsity) peak FLOP/s per device. Vendor datasheets quote the sparse figure for
# the NVIDIA 8/16-bit tensor cores; these are half of it. Sources: NVIDIA H100/H200 SXM, A100
# and DGX B200 datasheets; Google Cloud TPU system-architecture pages (v4, v5e, v5p, v6e).
# "fp8" is the 8-bit dense peak; None where the chip has no faster 8-bit matmul we can claim.
# TPU v5e has no FP8 MXU mode: its 394e12 is the int8 rate, kept as its 8-bit peak.
# H100 PCIe/NVL are slower than SXM (756e12 BF16); all H100s map to the SXM figure, so their MFU
# is understated rather than inflated.
PEAK_FLOPS: dict[str, dict[str, float | None]] = {
    "h100": {"bf16": 989e12, "fp8": 1979e12},
    "h200": {"bf16": 989e12, "fp8": 1979e12},
    "a100": {"bf16": 312e12, "fp8": None},
    "b200": {"bf16": 2250e12, "fp8": 4500e12},
    "tpu v4": {"bf16": 275e12, "fp8": None},
    "tpu v5e": {"bf16": 197e12, "fp8": 394e12},
    "tpu v5p": {"bf16": 459e12, "fp8": None},
    "tpu v6e": {"bf16": 918e12, "fp8": None},
}

# \b keeps 'NVIDIA GB200' / 'GH200' (different parts) from matching 'b200' / 'h200'.
_GPU_RE = re.compile(r"\b(h100|h200|a100|b200)\b")
_TPU_RE = re.compile(r"\btpu\s*v(\d+)\s*(lite|e|p)?")


def _normalise_device_kind(device_kind: str) -> str | None:
    """Map jax's `device.device_kind` to a PEAK_FLOPS key ('NVIDIA H100 80GB HBM3' -> 'h100')."""
    kind = device_kind.strip().lower()
    if m := _GPU_RE.search(kind):
        return m.group(1)
    if m := _TPU_RE.search(kind):
        gen, suffix = m.group(1), m.group(2) or ""
        # jax reports v5e/v6e as 'TPU v5 lite'/'TPU v6 lite' and v5p as plain 'TPU v5'.
        suffix = "e" if suffix in ("lite", "e") else suffix
        if gen == "5" and not suffix:
            suffix = "p"
        return f"tpu v{gen}{suffix}"
    return None


def peak_flops(device_kind: str, fp8: bool = False) -> float | None:
    """Dense peak FLOP/s of one device, or None for CPU / unknown chips (MFU is then unknown)."""
    key = _normalise_device_kind(device_kind)
    if key not in PEAK_FLOPS:
        return None
    return PEAK_FLOPS[key]["fp8" if fp8 else "bf16"]


def tflops_per_device(model_flops_per_step: float, step_time_s: float, n_devices: int) -> float | None:
    """Achieved model TFLOP/s per device; None when the step time is not positive."""
    if step_time_s <= 0 or n_devices <= 0:
        return None
    return model_flops_per_step / step_time_s / n_devices / 1e12


def mfu(model_flops_per_step: float, step_time_s: float, n_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the peak is unknown (CPU) or the time is bad."""
    achieved = tflops_per_device(model_flops_per_step, step_time_s, n_devices)
    if achieved is None or not peak:
        return None
    return achieved * 1e12 / peak


def _scalar(key: str, value):
    """Plain Python value for JSON: numpy/jax 0-d values via .item(); arrays are an error."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()  # np.float32, np.int64, 0-d np/jax arrays
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metrics field {key!r}: expected a scalar, got {type(value).__name__}") from None


class MetricsError(UserError):
    """metrics.jsonl cannot be opened or written (a full disk, a read-only file): one line, exit 2."""


def holds_records(path: str | Path) -> bool:
    """Whether a metrics.jsonl holds anything: an empty file (a start that failed before its
    first step) is not a run."""
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return True
    except FileNotFoundError:
        return False
    return False


def drop_replayed(path: str | Path, step: int) -> tuple[int, int]:
    """Before a resume from checkpoint `step`: drop the records of later steps (the run will
    repeat them after a kill or a failed save), the earlier copy of any step logged twice (files
    written before this rule), and a trailing partial line. Lines that are not parallax records
    are kept. Rewritten atomically (a temporary file renamed over it) when anything goes, so
    every reader sees each step once. Returns (lines dropped, the last step kept, 0 if none)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0, 0
    lines = raw.splitlines(keepends=True)
    kept: list[tuple[int | None, bytes]] = []
    for line in lines:
        if not line.endswith(b"\n"):
            continue  # a fragment of a write that did not finish
        try:
            rec = json.loads(line)
            s = rec["step"] if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None
        except ValueError:
            s = None
        if s is not None:
            kept = [(k, l) for k, l in kept if k is None or k < s]  # a replay supersedes what it repeats
            if s > step:
                continue
        kept.append((s, line))
    last = max((k for k, _ in kept if k is not None), default=0)
    if len(kept) == len(lines):
        return 0, last
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(b"".join(line for _, line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise MetricsError(f"cannot rewrite {str(path)!r} to drop the records after checkpoint step {step} "
                           f"({e.strerror})") from None
    return len(lines) - len(kept), last


def _write_all(fd: int, data: bytes) -> None:
    """Unbuffered: each line reaches the file now (a crash keeps every line written so far)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_TB_THREAD_ERRORS: list[str] = []


def _keep_tensorboard_thread_errors() -> None:
    """tensorboardX writes events from its own thread; on a full disk that thread dies with a
    traceback on stderr. Its errors are kept for MetricsWriter's one warning instead; every other
    thread's still reach the previous hook. Installed once."""
    previous = threading.excepthook
    if getattr(previous, "_parallax_keeps_tb", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__module__.startswith("tensorboardX") and isinstance(args.exc_value, OSError):
            _TB_THREAD_ERRORS.append(str(args.exc_value.strerror or args.exc_value))
        else:
            previous(args)

    hook._parallax_keeps_tb = True
    threading.excepthook = hook


class MetricsWriter:
    """One per run: WORKDIR/metrics.jsonl (one object per write) and TensorBoard under WORKDIR/tb.

    mode: 'w' starts fresh, 'a' appends (resume), 'x' refuses to overwrite an existing file.
    enabled=False (every process but 0) writes nothing and creates no files.
    Non-finite floats become null in the JSONL (NaN is not valid JSON) but reach TensorBoard.
    A write that fails (a full disk) leaves no partial line: the file is cut back to the last
    whole record and MetricsError is raised. `purge_step` (a resume) hides TensorBoard's events
    from that step on, which the resumed run writes again. `tracker` (train/tracker.py's
    WandbTracker, or None) is handed every record written, and finished at close.
    """

    def __init__(self, workdir: str | Path, *, enabled: bool = True, mode: str = "w", purge_step: int | None = None,
                 tracker=None):
        if mode not in ("w", "a", "x"):
            raise ValueError(f"MetricsWriter mode must be 'w', 'a' or 'x', got {mode!r}")
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self._file = self._tb = None
        self.tracker = tracker if enabled else None
        self.tb_error: str | None = None  # TensorBoard is best effort: its first failure, if any
        if not enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Open the JSONL first so that a refused 'x' leaves no TensorBoard directory behind.
            self._file = open(self.path, mode + "b", buffering=0)
        except OSError as e:
            if isinstance(e, FileExistsError):
                raise
            raise MetricsError(f"cannot open {str(self.path)!r} for writing ({e.strerror})") from None
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)  # its "NaN or Inf found" for every NaN
        _keep_tensorboard_thread_errors()
        del _TB_THREAD_ERRORS[:]
        try:
            self._tb = SummaryWriter(logdir=str(Path(workdir) / "tb"), flush_secs=10, purge_step=purge_step)
        except OSError as e:
            self.tb_error = f"{e.strerror or e}"

    def write(self, record: dict) -> None:
        if "step" not in record:
            raise ValueError(f"metrics record needs a 'step' field, got keys {sorted(record)}")
        if not self.enabled:
            return
        if self._file is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        values = {k: _scalar(k, v) for k, v in record.items()}
        step = int(values["step"])
        values["step"] = step
        line = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
        data = (json.dumps(line, allow_nan=False) + "\n").encode()
        fd = self._file.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            _write_all(fd, data)
        except OSError as e:
            try:
                os.ftruncate(fd, start)  # needs no space: no partial JSON line is left
            except OSError:
                pass
            raise MetricsError(f"writing step {step} to {str(self.path)!r} failed ({e.strerror})") from None
        if self.tracker is not None:
            self.tracker.log(values, step)
        if self._tb is None:
            return
        try:
            for k, v in values.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, global_step=step)
        except OSError as e:
            self.tb_error = self.tb_error or f"{e.strerror or e}"

    def close(self, failed: bool = False) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.finish(failed)
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except OSError as e:  # a full disk: the events are lost, metrics.jsonl is the record
                self.tb_error = self.tb_error or f"{e.strerror or e}"
                for w in (getattr(tb, "all_writers", None) or {}).values():  # else tensorboardX's atexit hook retries
                    getattr(w, "event_writer", w).__dict__["_closed"] = True
        if _TB_THREAD_ERRORS and self.tb_error is None:
            self.tb_error = _TB_THREAD_ERRORS[0]

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Live step/loss/throughput/MFU/ETA display for process 0.

    `step` counts completed steps (the last update has step == total_steps). Record fields read:
    'loss', 'tokens_per_s', 'step_time_s', 'mfu' (a fraction); missing or None shows '-'.
    On an interactive terminal this is a rich progress bar. Otherwise (CI logs, pipes, files) a
    live display would either spam redraws or vanish, so it prints one plain line on the first
    update, then when `log_every` steps or `log_every_s` seconds have passed, and always for the
    final step (or, on early exit, the last step seen).
    """

    def __init__(self, total_steps: int, enabled: bool, console: Console | None = None,
                 log_every: int | None = None, log_every_s: float = 10.0):
        self.total = total_steps
        self.enabled = enabled
        self.console = console or Console()
        self.log_every = log_every or max(1, total_steps // 10)
        self.log_every_s = log_every_s
        # is_interactive is False for non-TTY files and TERM=dumb; a forced terminal stays live.
        self.live = enabled and self.console.is_interactive
        self._bar = self._task = None
        self._first = None  # (step, time) of the first update: ETA excludes compile time before it
        self._last_printed = None  # (step, time)
        self._pending = None  # the last line not yet printed in plain mode

    def __enter__(self) -> Progress:
        if self.live:
            self._bar = _RichProgress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[info]}"), console=self.console, refresh_per_second=4)
            self._task = self._bar.add_task("train", total=self.total, info="")
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._pending is not None:
            self.console.print(self._pending, markup=False, highlight=False, soft_wrap=True)
            self._pending = None

    def _eta(self, step: int, now: float, step_time: float | None) -> float | None:
        remaining = max(self.total - step, 0)
        first_step, first_t = self._first
        if step > first_step and now > first_t:
            return remaining * (now - first_t) / (step - first_step)
        return remaining * step_time if step_time else None

    def _info(self, step: int, record: dict, now: float) -> str:
        def get(key):
            v = record.get(key)
            return None if v is None else float(v)

        loss, tps, st, util = (get(k) for k in ("loss", "tokens_per_s", "step_time_s", "mfu"))
        eta = self._eta(step, now, st)
        return " ".join([
            f"loss {loss:.4g}" if loss is not None else "loss -",
            f"tok/s {tps:,.0f}" if tps is not None else "tok/s -",
            f"step {st:.2f}s" if st is not None else "step -",
            f"mfu {util:.1%}" if util is not None else "mfu -",
            f"eta {_format_duration(eta)}" if eta is not None else "eta -",
        ])

    def update(self, step: int, record: dict) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        info = self._info(step, record, now)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            return
        line = f"step {step}/{self.total} {info}"
        due = (self._last_printed is None or step >= self.total
               or step - self._last_printed[0] >= self.log_every
               or now - self._last_printed[1] >= self.log_every_s)
        if due:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            self._last_printed, self._pending = (step, now), None
        else:
            self._pending = line


# ----------------------------------------------------------------------------------------------
# Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
# appendix A): how big should the global batch be? With train.noise_scale the train step returns
# the squared gradient norms of its batch shards and of their mean (train_step.py,
# make_sharded_value_and_grad) and loop.py feeds them to NoiseScale; B_simple is in sequences.


def noise_scale_terms(small_sq_norm: float, big_sq_norm: float, b_small: float, b_big: float) -> tuple[float, float]:
    """Unbiased estimates of (|G|^2, tr(Sigma)) from squared gradient norms at two batch sizes.

    E|G_B|^2 = |G|^2 + tr(Sigma) / B for a mean gradient over B examples, so two batch sizes give
    two equations. `small_sq_norm`: |G_small|^2 averaged over the small batches that make up the
    big one (per-replica or per-microbatch gradients); `big_sq_norm`: |G_big|^2 of their mean.
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small}, {b_big}")
    g2 = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    trace = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class NoiseScale:
    """B_simple = tr(Sigma) / |G|^2, smoothed over steps.

    Each term is an exponential moving average and B_simple is their ratio (McCandlish et al.):
    a single step's |G|^2 estimate is noisy and can be negative, so averaging ratios would not do.
    `update` returns the current estimate, or None while the |G|^2 average is not positive.
    """

    def __init__(self, decay: float = 0.95):
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._g2 = self._trace = 0.0

    def update(self, small_sq_norm: float, big_sq_norm: float, b_small: float, b_big: float) -> float | None:
        g2, trace = noise_scale_terms(small_sq_norm, big_sq_norm, b_small, b_big)
        self._g2 = self.decay * self._g2 + (1 - self.decay) * g2
        self._trace = self.decay * self._trace + (1 - self.decay) * trace
        return self.value

    @property
    def value(self) -> float | None:
        # The EMAs' start-up bias (1 - decay^n) is the same factor on both and cancels in the ratio.
        return self._trace / self._g2 if self._g2 > 0 else None
