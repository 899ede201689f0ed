"""`--profile-steps A:B`: a jax.profiler trace of exactly steps A..B (1-based, inclusive) in
WORKDIR/profile, and one line per traced step saying where its time went.

The trace is TensorBoard's profile-plugin layout (WORKDIR/profile/plugins/profile/<run>/<host>.xplane.pb,
plus a trace.json.gz): `tensorboard --logdir WORKDIR/profile` (tensorboard-plugin-profile) or
`xprof --logdir WORKDIR/profile` opens it. Tracing starts just before step A is dispatched and
stops once step B's outputs are ready; each step runs inside a StepTraceAnnotation("train"), so
the profile plugin's step view and the summary below both find the step boundaries.

The summary reads the trace back with jax's own parser (jax.profiler.ProfileData):
- ops: on GPU/TPU the events of each `/device:` plane's "XLA Ops" line; on XLA:CPU (simulated
  devices) there are no device planes and each op is an event on a host thread carrying
  `hlo_op` and `device_ordinal` stats;
- an op is a collective by its HLO name or category (all-reduce, all-gather, reduce-scatter,
  all-to-all, collective-permute, with their -start/-done halves); every other op is compute;
- per device: the sum over that device's ops in the step, averaged over devices (ops a device runs
  concurrently are each counted, so the sum can exceed the wall time);
- host: the step's wall time during which no device ran any op (dispatch, Python, the next batch).
On XLA:CPU a collective's time includes waiting at its rendezvous for the other simulated devices
(threads sharing the host's cores), so it measures skew as much as communication, and there is no
overlap of compute and communication to see; the line says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from parallax.config import UserError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
STEP_NAME = "train"  # the StepTraceAnnotation of each traced step
_WINDOW_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class ProfileWindow:
    first: int
    last: int

    def __contains__(self, step: int) -> bool:
        return self.first <= step <= self.last

    def check_start(self, start: int, end: int) -> None:
        """After a restore: the run executes steps start+1..end; the window must lie inside them."""
        if not (start < self.first and self.last <= end):
            raise UserError(f"--profile-steps {self.first}:{self.last}: this run executes steps {start + 1}..{end} "
                            f"(it resumes from checkpoint step {start}); choose a window inside them")


def parse_window(text: str, steps: int, stop_at: int | None) -> ProfileWindow:
    """`A:B` with 1 <= A <= B <= the last step this run reaches (train.steps, or --stop-at); one
    line naming the flag otherwise. Before JAX starts."""
    m = _WINDOW_RE.match(text)
    if not m:
        raise UserError(f"--profile-steps: expected A:B, the first and last step to trace (1-based, inclusive), "
                        f"got {text!r}")
    first, last = int(m.group(1)), int(m.group(2))
    if first > last:
        raise UserError(f"--profile-steps {first}:{last}: the first step is after the last")
    end = steps if stop_at is None else min(stop_at, steps)
    bound = f"train.steps={steps}" if end == steps else f"--stop-at {end}"
    if first < 1 or last > end:
        raise UserError(f"--profile-steps {first}:{last}: the steps must lie in 1..{end} ({bound})")
    return ProfileWindow(first, last)


def _kind(name: str) -> str:
    name = name.lower()
    if "reduce-scatter" in name or "reduce_scatter" in name:  # before all-reduce: TPU's all-reduce-scatter fusion
        return "reduce-scatter"
    for kind in KINDS:
        if kind in name or kind.replace("-", "_") in name:
            return kind
    return "compute"


@dataclass(frozen=True)
class StepBreakdown:
    step: int
    wall_s: float
    per_device: dict[str, float]  # "compute" and each of KINDS -> seconds, mean over devices
    host_s: float
    devices: int

    def line(self, cpu: bool) -> str:
        ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
        kinds = ", ".join(f"{k} {ms(self.per_device.get(k, 0.0))}" for k in KINDS)
        where = ("XLA:CPU: simulated devices are host threads, so collectives include waiting for the other devices "
                 "and nothing overlaps") if cpu else "device op time"
        return (f"profile step {self.step}: wall {ms(self.wall_s)} ms | per device (mean of {self.devices}): compute "
                f"{ms(self.per_device.get('compute', 0.0))}, {kinds} ms | host (no device op running) "
                f"{ms(self.host_s)} ms | {where}")


def _stats(event) -> dict:
    return dict(event.stats)


def _ops(data) -> tuple[list[tuple[object, int, int, str]], bool]:
    """(device, start ns, end ns, kind) of every XLA op in the trace; True when they are XLA:CPU's."""
    ops = []
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                if line.name == "XLA Ops":
                    for e in line.events:
                        st = _stats(e)
                        ops.append((plane.name, e.start_ns, e.end_ns,
                                    _kind(f"{st.get('hlo_category', '')} {st.get('hlo_op', e.name)}")))
    if ops:
        return ops, False
    for plane in data.planes:
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                for e in line.events:
                    st = _stats(e)
                    if "hlo_op" in st:
                        ops.append((st.get("device_ordinal", line.name), e.start_ns, e.end_ns, _kind(str(st["hlo_op"]))))
    return ops, True


def _steps(data) -> dict[int, tuple[int, int]]:
    found = {}
    for plane in data.planes:
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                for e in line.events:
                    if e.name == STEP_NAME:
                        st = _stats(e)
                        if "step_num" in st:
                            found[int(st["step_num"])] = (e.start_ns, e.end_ns)
    return found


def _busy(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals."""
    total, reach = 0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def summarize(data) -> tuple[list[StepBreakdown], bool]:
    """One StepBreakdown per traced step (by step number), and whether the ops are XLA:CPU's."""
    ops, cpu = _ops(data)
    out = []
    for step, (t0, t1) in sorted(_steps(data).items()):
        inside = [op for op in ops if t0 <= op[1] < t1]
        devices = sorted({op[0] for op in inside}, key=str)
        sums: dict[str, float] = {}
        for _, a, b, kind in inside:
            sums[kind] = sums.get(kind, 0.0) + (b - a) * 1e-9
        n = max(len(devices), 1)
        busy = _busy([(a, min(b, t1)) for _, a, b, _ in inside]) * 1e-9
        wall = (t1 - t0) * 1e-9
        out.append(StepBreakdown(step, wall, {k: v / n for k, v in sums.items()}, max(0.0, wall - busy), len(devices)))
    return out, cpu


class StepProfiler:
    """Starts the trace before the window's first step, annotates its steps, stops after its last
    one (blocking on that step's outputs first) and prints the summary."""

    def __init__(self, window: ProfileWindow | None, workdir: Path, say, lead: bool):
        self.window, self.directory, self.say, self.lead = window, Path(workdir) / "profile", say, lead
        self.active = False
        self.files: list[Path] = []

    def _written(self) -> set[Path]:
        return set((self.directory / "plugins" / "profile").glob("*/*.xplane.pb"))

    def annotate(self, step: int):
        """The context of step `step` (1-based): starts the trace at the window's first step."""
        import contextlib

        import jax

        if self.window is None or step not in self.window:
            return contextlib.nullcontext()
        if step == self.window.first:
            self._before = self._written()
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        return jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step)

    def after(self, step: int, outputs) -> None:
        """Step `step` has returned `outputs`; after the window's last step the trace is stopped."""
        if self.active and step == self.window.last:
            import jax

            jax.block_until_ready(outputs)
            self.stop()

    def stop(self, summary: bool = True) -> None:
        if not self.active:
            return
        import jax

        self.active = False
        jax.profiler.stop_trace()
        self.files = sorted(self._written() - self._before)
        if not (self.lead and summary):
            return
        w = self.window
        where = self.files[0].parent if self.files else self.directory
        self.say(f"profile: steps {w.first}..{w.last} traced to {where} (tensorboard --logdir {self.directory})")
        for path in self.files[:1]:
            steps, cpu = summarize(jax.profiler.ProfileData.from_file(str(path)))
            for s in steps:
                self.say(s.line(cpu))
