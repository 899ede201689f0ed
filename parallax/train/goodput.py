"""Goodput: the fraction of a run's wall time spent in training steps that count, from its own
event log (WORKDIR/events.jsonl), across every resume.

The loop appends one JSON object per event, stamped with the Unix time `t` (seconds):

    {"event": "start", "t": ..., "step": S, "pid": ...}   a session began (t: its process start), at step S
    {"event": "compiled", "t": ..., "dt": ...}            the train step compiled (dt: compile seconds)
    {"event": "step", "t": ..., "step": N, "dt": ..., "ok": true}   step N ended (dt: dispatch to outputs)
    {"event": "eval", "t": ..., "step": N, "dt": ...}     evaluation after step N
    {"event": "save", "t": ..., "step": N, "dt": ...}     the loop stalled dt s for a checkpoint (snapshot,
                                                           or waiting for the previous/final save)
    {"event": "end", "t": ..., "step": N}                 the session ended normally

`goodput(events)` is a pure function of that list. A session's wall time runs from its start to
its last event; time between sessions (the job not running) is not the run's to count, and a
session killed -9 ends at its last logged step (at most one step's time is unaccounted). When a
session starts at step S, every step after S that an earlier session ran is replayed: its earlier
time moves from productive to lost. A skipped (non-finite) step did not train: lost as well.

Lines are written whole with one unbuffered write (a kill -9 keeps every line written; the page
cache survives a killed process); the file is fsync'd at saves and at the end, so after a machine
crash the log is at least as complete as the newest checkpoint. A torn last line is ignored when
read and cut off before appending.
"""

from __future__ import annotations

import json
import os
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

EVENTS_FILE = "events.jsonl"


@dataclass(frozen=True)
class Goodput:
    """Where the run's wall time went, in seconds; `fraction` = productive / wall."""

    wall_s: float
    productive_s: float  # steps that count: run once (or last) and finite
    replayed_s: float  # earlier runs of steps a resume repeated (lost to a crash)
    skipped_s: float  # non-finite steps (not applied)
    compile_s: float
    startup_s: float  # process start to the compile (imports, JAX, restore)
    eval_s: float
    save_s: float  # the loop's checkpoint stalls
    sessions: int
    steps: int  # productive steps

    @property
    def fraction(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    @property
    def other_s(self) -> float:
        """Host work between steps (records, progress) and the unlogged ends of killed sessions' steps."""
        return self.wall_s - (self.productive_s + self.replayed_s + self.skipped_s + self.compile_s + self.startup_s
                              + self.eval_s + self.save_s)


class GoodputTally:
    """The fold behind `goodput`: `add` events in log order, `summary` at any point. Per-step
    times are kept (8 bytes a step) so that a resume from any kept checkpoint can be charged."""

    def __init__(self):
        self._dt = array("d")  # [step] -> its latest run's time (0: not run)
        self._ok = bytearray()  # [step] -> 1 productive, 2 skipped
        self.productive = self.replayed = self.skipped = 0.0
        self.compile = self.startup = self.eval = self.save = 0.0
        self.sessions, self.steps = 0, 0
        self._wall_closed = 0.0  # sessions before the current one
        self._session_t0 = self._last_t = None

    def _forget_after(self, step: int) -> None:
        for s in range(step + 1, len(self._dt)):
            dt, kind = self._dt[s], self._ok[s]
            if kind == 1:
                self.productive -= dt
                self.steps -= 1
            elif kind == 2:
                self.skipped -= dt
            self.replayed += dt if kind else 0.0
        del self._dt[step + 1:]
        del self._ok[step + 1:]

    def add(self, event: dict) -> None:
        kind, t = event.get("event"), float(event.get("t", 0.0))
        if kind == "start":
            if self._session_t0 is not None:
                self._wall_closed += self._last_t - self._session_t0
            self._session_t0 = self._last_t = t
            self.sessions += 1
            self._forget_after(int(event.get("step", 0)))
            return
        if self._session_t0 is None:  # events before any start (a log cut at its head): a session from here
            self._session_t0 = t
            self.sessions += 1
        self._last_t = max(self._last_t or t, t)
        dt = float(event.get("dt", 0.0))
        if kind == "step":
            step = int(event["step"])
            self._forget_after(step - 1)  # a step logged again without a start (cannot happen in the loop's logs)
            while len(self._dt) <= step:
                self._dt.append(0.0)
                self._ok.append(0)
            ok = bool(event.get("ok", True))
            self._dt[step], self._ok[step] = dt, 1 if ok else 2
            if ok:
                self.productive += dt
                self.steps += 1
            else:
                self.skipped += dt
        elif kind == "compiled":
            self.compile += dt
            self.startup += max(0.0, t - dt - self._session_t0)
        elif kind == "eval":
            self.eval += dt
        elif kind == "save":
            self.save += dt

    def summary(self, now: float | None = None) -> Goodput:
        """The tally so far; `now` extends the current session to that time (a live run)."""
        current = 0.0
        if self._session_t0 is not None:
            current = max(now or 0.0, self._last_t) - self._session_t0
        return Goodput(self._wall_closed + current, self.productive, self.replayed, self.skipped, self.compile,
                       self.startup, self.eval, self.save, self.sessions, self.steps)


def goodput(events) -> Goodput:
    """The goodput of an event log (dicts in log order; see the module docstring)."""
    tally = GoodputTally()
    for event in events:
        tally.add(event)
    return tally.summary()


def read_events(path: str | Path) -> list[dict]:
    """The events of a log; a line that is not whole JSON (the torn tail of a killed write) is skipped."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    events = []
    for line in raw.split(b"\n"):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def process_start_time() -> float:
    """When this process started (Unix time): interpreter start-up and imports are start-up time
    too. Linux's /proc; elsewhere, now."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22: clock ticks after boot
        # Against the boot clock now, not /proc/stat's btime (whole seconds: up to 1 s off).
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class EventLog:
    """WORKDIR/events.jsonl, appended (never truncated but for a torn last line, or with `fresh`
    when --overwrite replaces another run), and the tally of everything in it.
    enabled=False (every process but 0) writes and reads nothing."""

    def __init__(self, workdir: str | Path, *, enabled: bool = True, fresh: bool = False):
        self.path = Path(workdir) / EVENTS_FILE
        self.tally = GoodputTally()
        self._fd = None
        self.error: str | None = None  # the log is best effort: its first failure, if any
        if not enabled:
            return
        try:
            if fresh:
                self.path.unlink(missing_ok=True)
            for event in read_events(self.path):
                self.tally.add(event)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            size = os.fstat(self._fd).st_size
            if size:  # cut a torn last line, or the next event would be glued to it
                with open(self.path, "rb") as f:
                    f.seek(max(0, size - (1 << 20)))
                    tail = f.read()
                if not tail.endswith(b"\n"):
                    os.ftruncate(self._fd, size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        self.error = self.error or f"{e.strerror or e}"
        self.close()

    def write(self, event: str, sync: bool = False, **fields) -> dict:
        """Append one event (t: now unless given) and count it; returns it."""
        record = {"event": event, "t": fields.pop("t", None) or time.time(), **fields}
        self.tally.add(record)
        if self._fd is not None:
            try:
                data = (json.dumps(record) + "\n").encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                if sync:
                    os.fsync(self._fd)
            except OSError as e:
                self._fail(e)
        return record

    def summary(self) -> Goodput:
        return self.tally.summary(time.time())

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)
