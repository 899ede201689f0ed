"""Several processes, one program: `jax.distributed` set-up, the XLA overlap flags, and the devices
JAX will find (an accelerator, or the simulated CPU devices a mesh needs).

Everything here runs before JAX starts its backend (XLA reads its flags once, and
`jax.distributed.initialize` must precede the first computation), and nothing here imports JAX at
module load. parallax uses JAX's own multi-controller runtime, never a launcher of its own: one
process per host, every process runs the same command, and process 0 hosts the coordinator.

Where the process layout comes from, first match wins:
1. flags `--coordinator HOST:PORT --num-processes N --process-id I`;
2. env `PARALLAX_COORDINATOR`, `PARALLAX_NUM_PROCESSES`, `PARALLAX_PROCESS_ID` (the coordinator
   also from JAX's own `JAX_COORDINATOR_ADDRESS`);
3. a cluster JAX detects by itself (SLURM with several tasks, Open MPI's mpirun, a Cloud TPU VM):
   `jax.distributed.initialize()` is called with the values left unset.
Otherwise, or with `--num-processes 1`, the run is one process and none of this happens.

A process that dies is noticed by JAX's coordination service: the coordinator's death at once
(the RPC fails), any other process's after `heartbeat_timeout_seconds` without heartbeats. Either
way every other process is terminated with "Terminating process because the JAX distributed
service detected fatal errors ... another task died" (SIGABRT, exit 134) instead of hanging in a
collective. `--heartbeat-timeout` sets that bound (JAX's default: 100 s).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import importlib.util
import mmap
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from parallax.config import Config, UserError, devices_needed

ENV_COORDINATOR, ENV_NUM, ENV_ID = "PARALLAX_COORDINATOR", "PARALLAX_NUM_PROCESSES", "PARALLAX_PROCESS_ID"
ENV_HEARTBEAT = "PARALLAX_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_S = 100  # jax.distributed.initialize's own default in 0.10.2


class LaunchError(UserError):
    """Inconsistent multi-process settings, or a coordinator that cannot be reached."""


@dataclass(frozen=True)
class ProcessSpec:
    """How to call `jax.distributed.initialize`; None fields are left to JAX's cluster detection."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # 'flags/env', 'SLURM', 'Open MPI', 'Cloud TPU'
    heartbeat_s: int = DEFAULT_HEARTBEAT_S


# ----------------------------------------------------------------------------------------------
# Platform and cluster detection (no JAX import)


def accelerator_platform(environ=os.environ) -> str | None:
    """'gpu', 'tpu' or None (CPU only), decided without importing JAX: JAX_PLATFORMS if set, else an
    installed CUDA plugin with /dev/nvidia*, or libtpu with a TPU device node."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        if "tpu" in platforms:
            return "tpu"
        return "gpu" if any(p in platforms for p in ("cuda", "gpu", "rocm")) else None
    cuda = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    if cuda and glob.glob("/dev/nvidia[0-9]*"):
        return "gpu"
    if importlib.util.find_spec("libtpu") and glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    return None


def detect_cluster(environ=os.environ, platform: str | None = None) -> tuple[str, int | None, int | None] | None:
    """(name, process count, process id) of a cluster whose launcher JAX's `initialize()` reads by
    itself; the same environment variables JAX 0.10.2 checks (jax/_src/clusters). A Cloud TPU VM's
    count and id come from its metadata server, so they stay None here."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in environ for v in slurm):
        return "SLURM", _int(environ, "SLURM_NTASKS"), _int(environ, "SLURM_PROCID")
    if "OMPI_MCA_orte_hnp_uri" in environ:
        return "Open MPI", _int(environ, "OMPI_COMM_WORLD_SIZE"), _int(environ, "OMPI_COMM_WORLD_RANK")
    if platform == "tpu":
        return "Cloud TPU", None, None
    return None


def _int(environ, name: str) -> int | None:
    if environ.get(name) in (None, ""):
        return None
    try:
        return int(environ[name])
    except ValueError:
        raise LaunchError(f"{name}={environ[name]!r}: expected an integer") from None


_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):(\d{1,5})$")


def process_spec(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                 heartbeat_s: int | None = None, environ=os.environ, platform: str | None = None) -> ProcessSpec | None:
    """The process layout from flags, then env, then cluster detection; None for a single process.
    Raises LaunchError (naming the flag and its env variable) for incomplete or inconsistent values."""
    coordinator = coordinator or environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _int(environ, ENV_NUM)
    if process_id is None:
        process_id = _int(environ, ENV_ID)
    if heartbeat_s is None:
        heartbeat_s = _int(environ, ENV_HEARTBEAT)
        heartbeat_s = DEFAULT_HEARTBEAT_S if heartbeat_s is None else heartbeat_s
    if heartbeat_s <= 0:
        raise LaunchError(f"--heartbeat-timeout ({ENV_HEARTBEAT}): must be a positive number of seconds, got {heartbeat_s}")
    if num_processes is not None and num_processes < 1:
        raise LaunchError(f"--num-processes ({ENV_NUM}): must be at least 1, got {num_processes}")
    if num_processes == 1:  # an explicit single process: no runtime, even inside a cluster allocation
        if process_id not in (None, 0):
            raise LaunchError(f"--process-id ({ENV_ID}): must be 0 when --num-processes is 1, got {process_id}")
        return None
    cluster = detect_cluster(environ, platform)
    explicit = (coordinator, num_processes, process_id) != (None, None, None)
    if not explicit:
        if cluster is None or (cluster[1] is not None and cluster[1] <= 1):
            return None
        return ProcessSpec(None, cluster[1], cluster[2], cluster[0], heartbeat_s)
    if coordinator is None and num_processes is not None and environ.get("JAX_COORDINATOR_ADDRESS"):
        coordinator = environ["JAX_COORDINATOR_ADDRESS"]
    if cluster is not None:  # explicit values override what JAX would detect
        num_processes = cluster[1] if num_processes is None else num_processes
        process_id = cluster[2] if process_id is None else process_id
    else:
        for value, flag, env in ((coordinator, "--coordinator", ENV_COORDINATOR),
                                 (num_processes, "--num-processes", ENV_NUM), (process_id, "--process-id", ENV_ID)):
            if value is None:
                raise LaunchError(
                    f"{flag} ({env}) is missing: a multi-process run outside SLURM, Open MPI or a Cloud TPU VM "
                    "needs --coordinator HOST:PORT, --num-processes N and --process-id I on every process")
    if coordinator is not None:
        m = _ADDRESS.match(coordinator)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise LaunchError(f"--coordinator ({ENV_COORDINATOR}): expected HOST:PORT with a port in 1-65535, "
                              f"got {coordinator!r}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise LaunchError(f"--process-id ({ENV_ID}): must be in 0..{num_processes - 1} for --num-processes "
                          f"{num_processes}, got {process_id}")
    return ProcessSpec(coordinator, num_processes, process_id, "cluster + flags/env" if cluster else "flags/env",
                       heartbeat_s)


# ----------------------------------------------------------------------------------------------
# Starting the runtime

_label = ""  # "process 1/2" once a multi-process runtime is up


def initialize(spec: ProcessSpec, platform: str | None) -> str:
    """Start `jax.distributed` (before any JAX computation). Returns the line to print."""
    global _label
    import jax

    if platform is None and not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        # CPU processes exchange data through gloo over TCP (JAX 0.10.2's default; pinned so that a
        # changed default cannot silently leave CPU collectives without a cross-process transport).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                                   heartbeat_timeout_seconds=spec.heartbeat_s)
    except ValueError as e:
        if spec.source == "Cloud TPU" and "coordinator_address" in str(e):
            return "parallax: a TPU VM without a multi-host slice: running as one process"
        raise LaunchError(f"jax.distributed.initialize ({spec.source}): {e}") from None
    except Exception as e:  # the coordinator never answered (initialization_timeout, 300 s)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LaunchError(f"could not join the run at coordinator {spec.coordinator or '(auto)'} "
                          f"as process {spec.process_id} of {spec.num_processes}: {first}") from None
    _label = f"process {jax.process_index()}/{jax.process_count()}"
    return (f"parallax: {_label} (via {spec.source}; coordinator {spec.coordinator or 'auto-detected'}); "
            f"{jax.local_device_count()} local of {jax.device_count()} devices; a dead peer stops this "
            f"process within ~{spec.heartbeat_s} s")


def error_prefix() -> str:
    """'parallax' or, in a multi-process run, 'parallax[process 1/2]' so that interleaved logs of
    several hosts say which process failed."""
    return f"parallax[{_label}]" if _label else "parallax"


# ----------------------------------------------------------------------------------------------
# One run per workdir (the lock), and the signals that stop it

LOCK_NAME = ".parallax.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class WorkdirLock:
    """An exclusive `flock` on WORKDIR/.parallax.lock, held for the life of the run.

    The kernel drops a flock when its process ends, however it ends (kill -9 included), so a lock
    is never stale and is never deleted. It reaches other hosts where the shared filesystem
    carries locks (NFS: Linux sends flock as a POSIX lock, hence the file is opened for writing;
    GPFS; Lustre mounted with `-o flock`). The processes of one multi-process run share the workdir:
    only process 0 takes the lock and the others follow its verdict (loop.py), so that run
    excludes every other run whatever its process count. The file holds the holder's pid, host
    and start time, for the message that refuses a second run."""

    def __init__(self, workdir: str | os.PathLike):
        self.path = Path(workdir) / LOCK_NAME
        self._fd: int | None = None
        self.unsupported: str | None = None  # why the filesystem took no lock (the run goes on unlocked)

    def acquire(self, create: bool) -> bool | None:
        """True: held (already, or now). False: another process holds it. None: there is no lock
        file and `create` is False. Creates nothing unless `create`."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as e:
            raise UserError(f"workdir {str(self.path.parent)!r}: cannot open its lock file {self.path.name} "
                            f"({e.strerror}); the workdir must be writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            self.unsupported = e.strerror
        self._fd = fd
        return True

    def holder(self) -> str:
        """' (pid 123 on host h since ...)' from the lock file, or '' if it says nothing yet."""
        try:
            text = self.path.read_text(errors="replace").strip()
        except OSError:
            return ""
        return f" ({text[:200]})" if text else ""

    def record(self) -> None:
        """Write who holds the lock into the file (only once every check has passed)."""
        if self._fd is None:
            return
        import socket
        import time

        text = f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)
        except OSError:
            pass  # the note is for messages only; the lock itself is what counts

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


class StopSignals:
    """SIGTERM and SIGINT, counted. During start-up (`training` False: imports, restore, compile)
    the first one ends the process at once with one line: no step ran, so nothing was saved. In
    training, the first finishes the step, saves and exits 0 (the loop reads `received`); a second
    says that the save is being finished and lets it finish; a third abandons it (exit 128+signal).

    A thread watches them through `signal.set_wakeup_fd`: the C-level handler writes the signal's
    number to a pipe at once, so a signal is answered even while the main thread is inside a long
    call into XLA (a compile), where a Python-level handler would wait for it to return.

    `restore=False` (the CLI's process, which ends after the run): leaving the block keeps the
    handlers, so a signal that arrives after the final save, before the process is gone, cannot
    turn its exit 0 into a kill; a third one still ends it at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, restore: bool = True) -> None:
        self.received: str | None = None
        self.count = 0
        self.training = False
        self.finished = False  # the block was left (restore=False): nothing is left to save
        self._restore = restore
        self.saving: str = ""  # what a second signal waits for, for its message
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():  # signal.signal's requirement
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._previous = {s: signal.signal(s, self._python_handler) for s in self.SIGNALS}
        self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="parallax-signals", daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _python_handler(signum, frame) -> None:
        """Only replaces the default action (termination, KeyboardInterrupt); `_watch` acts."""

    def _watch(self) -> None:
        while True:
            for signum in os.read(self._pipe[0], 64):
                if signum == 0:  # __exit__
                    return
                if signum in self.SIGNALS:
                    self._on_signal(signal.Signals(signum))

    def _on_signal(self, sig: signal.Signals) -> None:
        self.count += 1
        if self.finished:
            if self.count >= 3:
                self._exit(f"parallax: {sig.name} received (a third stop signal): exiting", 128 + sig)
            return
        if not self.training:
            self._exit(f"parallax: {sig.name} received during start-up, before any step ran: stopped; nothing was "
                       "saved (run the same command to start again)", 128 + sig)
        if self.count == 1:
            self.received = sig.name
        elif self.count == 2:
            print(f"parallax: {sig.name} received (a second stop signal): finishing "
                  f"{self.saving or 'the step and its checkpoint'} first; a third signal abandons it", flush=True)
        else:
            self._exit(f"parallax: {sig.name} received (a third stop signal): stopped without finishing "
                       f"{self.saving or 'the save'}; the checkpoints finalized before it are kept", 128 + sig)

    @staticmethod
    def _exit(line: str, code: int) -> None:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        os._exit(code)

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        if not self._restore:
            self.finished = True
            return
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        os.write(self._pipe[1], b"\0")
        self._thread.join()
        for fd in self._pipe:
            os.close(fd)
        self._pipe, self._previous = None, {}


# ----------------------------------------------------------------------------------------------
# XLA flags for overlapping collectives with compute

# Defaults checked in jaxlib 0.10.2 (flags that differ from the default appear in the
# `*.debug_options` file of an `--xla_dump_to` dump): the latency-hiding scheduler and pipelined
# all-gather/all-reduce are off, pipelined reduce-scatter is on. Collectives are always async on
# GPU now: the old per-collective `xla_gpu_enable_async_*` flags are gone (only reserved names in
# XLA's proto) and XLA aborts on them, so they are not set.
GPU_FLAGS = {
    # Schedule each collective's async start/done pair around independent compute (the data
    # gradient reduction behind the rest of the backward pass).
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Move collectives inside the scanned layer loop into the neighbouring iteration, so the
    # per-layer gradient all-reduce / ZeRO-3 weight all-gather overlaps another layer's compute.
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    # The pipeline's per-tick collective-permutes as send/recv pairs (the decomposer, at any size)
    # pipelined through the tick loop: XLA:GPU then issues a tick's forward send before its
    # backward pass and waits for it after (1F1B on h100-8: the activation send, half of the send
    # bytes, behind the B pass; as one collective-permute it was issued after the tick's last
    # GEMM, 0%). NVIDIA's JAX-Toolbox lists both among its pipeline-parallel flags.
    "xla_gpu_enable_pipelined_p2p": "true",
    "xla_gpu_collective_permute_decomposer_threshold": "0",
}
# libtpu flags (LIBTPU_INIT_ARGS), as MaxText sets them: fuse collectives into async ops that run
# on the TPU's DMA engines while the tensor cores compute. libtpu is not installed where this was
# written, so each one is set only if the installed libtpu defines it.
TPU_FLAGS = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
}
FLAG_ENV = {"gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}


def with_overlap_flags(current: str, platform: str | None, defined=lambda name: True) -> tuple[str, list[str]]:
    """(`current` plus the platform's overlap flags, the flags added). A flag the user already set,
    to any value, is kept as the user set it; a flag `defined` rejects is left out. CPU: nothing
    (XLA:CPU runs collectives synchronously, and unknown flags abort XLA)."""
    table = {"gpu": GPU_FLAGS, "tpu": TPU_FLAGS}.get(platform or "", {})
    present = set(re.findall(r"--([A-Za-z0-9_]+)", current))
    added = [f"--{k}={v}" for k, v in table.items() if k not in present and defined(k)]
    return " ".join([current.strip(), *added]).strip(), added


def _libraries(platform: str) -> list[Path]:
    """The shared libraries that parse the platform's flags: on GPU both JAX's own XLA (the CPU
    client also reads XLA_FLAGS) and the CUDA/ROCm plugin; on TPU, libtpu."""
    def under(pkg: str, pattern: str) -> list[Path]:
        spec = importlib.util.find_spec(pkg)
        roots = list(spec.submodule_search_locations or []) if spec else []
        return [p for r in roots for p in Path(r).glob(pattern)]

    if platform == "gpu":
        plugin = under("jax_plugins", "xla_*/*.so")
        return under("jaxlib", "libjax_common.so") + plugin if plugin else []
    # libtpu.so parses the flags; the wheel ships other libraries beside it (sdk.so) that do not
    return under("libtpu", "libtpu*.so")


def flags_defined_in(libraries: list[Path]):
    """A predicate: is this flag name a NUL-terminated string in every library? Flag tables hold
    their names as C strings; removed flags survive only inside proto descriptors (not NUL-ended)."""
    def defined(name: str) -> bool:
        if not libraries:
            return False
        for lib in libraries:
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(name.encode() + b"\0") < 0:
                    return False
        return True
    return defined


def apply_overlap_flags(platform: str | None, environ=os.environ) -> str | None:
    """Add the overlap flags for `platform` to its flag variable in `environ`; the line to print."""
    if platform not in FLAG_ENV:
        return None
    var = FLAG_ENV[platform]
    libraries = _libraries(platform)
    updated, added = with_overlap_flags(environ.get(var, ""), platform, flags_defined_in(libraries))
    if not libraries:
        return f"parallax: {var}: no {platform} XLA library found to check the overlap flags against; none set"
    if added:
        environ[var] = updated
        return f"parallax: {var} += {' '.join(added)} (collective/compute overlap; set them yourself to override)"
    return None


def overlap_options(platform: str) -> dict[str, bool]:
    """The overlap flags as compiler options (audit.compile_step for a compile-only target): the
    program compiled for a target is the one a training run on it compiles, with the flags
    `apply_overlap_flags` would set there (only those the installed library defines)."""
    table = {"gpu": GPU_FLAGS, "tpu": TPU_FLAGS}.get(platform, {})
    defined = flags_defined_in(_libraries(platform)) if table else None
    return {k: _option(v) for k, v in table.items() if defined(k)}


def _option(value: str) -> bool | int | str:
    """A flag's text as the compiler option's value: booleans and integers typed."""
    if value in ("true", "false"):
        return value == "true"
    return int(value) if value.lstrip("-").isdigit() else value


# ----------------------------------------------------------------------------------------------
# Before JAX starts: the devices it will find


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
