"""Multi-process runs on JAX's distributed runtime, with real processes on loopback.

Each process is a fresh `python -m parallax train ...` with 4 simulated CPU devices (CPU
collectives through gloo), so two of them make the same 8-device mesh as one process with 8. The
test process's own XLA_FLAGS (8 devices, from conftest) is not passed on: the CLI chooses each
process's device count. The pure parts (process layout, XLA flags, slice split) are tested
in-process below them.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.train import distributed as dist
from parallax import parallelism
from parallax.config import ConfigError
from parallax.parallel.mesh import dcn_shape

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.py"
# The quickstart model, tiny: 2 layers (one per pipeline stage), fp32 as quickstart computes.
MESH_222 = ["mesh.data=2", "mesh.tensor=2", "mesh.pipe=2", "parallel.microbatches=2"]
TINY = ["model.n_layers=2", "model.d_model=32", "model.d_ff=64", "train.seq_len=32", "train.global_batch=8",
        "train.steps=6", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1"]
HEARTBEAT_S = 5
RTOL = 1e-6  # the layout-equivalence tolerance of test_equivalence.py; measured: bit-identical


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CACHE: list[Path] = []  # JAX's persistent compilation cache, shared by this module's runs


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    _CACHE[:] = [tmp_path_factory.mktemp("jit_cache")]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARALLAX_", "XLA_FLAGS"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    # Compiles dominate these runs (a pipelined step: ~18 s with 3 processes on 2 cores); a run
    # that repeats an earlier program (same mesh, same process count) reads it from the cache.
    env.update(JAX_COMPILATION_CACHE_DIR=str(_CACHE[0]), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


class Procs:
    """`n` processes of one command (process i gets `argv(i)`), stdout/stderr to files."""

    def __init__(self, tmp: Path, name: str, argv, n: int, env: dict | None = None):
        self.logs = [(tmp / f"{name}.{i}.out", tmp / f"{name}.{i}.err") for i in range(n)]
        self.procs = []
        for i in range(n):
            out, err = (open(p, "w") for p in self.logs[i])
            self.procs.append(subprocess.Popen(argv(i), cwd=REPO, env={**_env(), **(env or {})},
                                               stdout=out, stderr=err))

    def wait(self, timeout: float = 300) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            for p in self.procs:  # never leave a process behind on failure
                if p.poll() is None:
                    p.kill()

    def out(self, i: int) -> str:
        return self.logs[i][0].read_text()

    def err(self, i: int) -> str:
        return self.logs[i][1].read_text()


def _train(tmp: Path, name: str, workdir: Path, sets: list[str], processes: int = 1, extra=()) -> Procs:
    port = _free_port()

    def argv(i: int) -> list[str]:
        cmd = [sys.executable, "-m", "parallax", "train", str(QUICKSTART), *[a for s in sets for a in ("--set", s)],
               "--workdir", str(workdir), *extra]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i)]
        return cmd

    return Procs(tmp, name, argv, processes)


def _losses(workdir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines}


def _check(procs: Procs, rcs: list[int]) -> None:
    assert rcs == [0] * len(rcs), "\n".join(procs.err(i)[-3000:] for i in range(len(rcs)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process on 8 devices trains the whole run (6 steps and the final evaluation: the
    reference of the periodic-save test below); two processes on 4 devices each train the same
    run to step 2 (checkpoint), concurrently; then one process resumes that checkpoint to step 4.
    Those two stop before train.steps (--stop-at), which skips the final evaluation's compile."""
    tmp = tmp_path_factory.mktemp("multihost")
    t0 = time.perf_counter()
    one = _train(tmp, "one", tmp / "one", MESH_222 + TINY)
    two = _train(tmp, "two", tmp / "two", MESH_222 + TINY, processes=2, extra=["--stop-at", "2"])
    _check(two, two.wait())
    _check(one, one.wait())
    written = {"metrics": (tmp / "two" / "metrics.jsonl").read_text(),
               "events": sorted(p.name for p in (tmp / "two" / "tb").rglob("*") if p.is_file())}
    resumed = _train(tmp, "resumed", tmp / "two", MESH_222 + TINY, extra=["--stop-at", "4"])
    _check(resumed, resumed.wait())
    print(f"multihost runs: {time.perf_counter() - t0:.1f} s")
    return {"tmp": tmp, "one": one, "two": two, "resumed": resumed, "written_by_two": written}


def test_two_processes_train_like_one(runs):
    ref = _losses(runs["tmp"] / "one")
    two = {json.loads(x)["step"]: json.loads(x)["loss"] for x in runs["written_by_two"]["metrics"].splitlines()}
    assert sorted(two) == [1, 2]
    for step, loss in two.items():
        assert loss == pytest.approx(ref[step], rel=RTOL), (step, loss, ref[step])
    assert "process 0/2" in runs["two"].out(0) and "process 1/2" in runs["two"].out(1)
    assert "4 local of 8 devices" in runs["two"].out(1)


def test_checkpoint_from_two_processes_resumes_in_one(runs):
    ref, resumed = _losses(runs["tmp"] / "one"), _losses(runs["tmp"] / "two")
    assert "resuming from checkpoint step 2" in runs["resumed"].out(0)
    assert sorted(resumed) == [1, 2, 3, 4]  # appended to the two-process run's metrics
    for step in (3, 4):
        assert resumed[step] == pytest.approx(ref[step], rel=RTOL), (step, resumed[step], ref[step])


def test_two_processes_keep_training_after_periodic_saves(runs, tmp_path):
    """Steps after periodic saves on two processes (checkpoint.every=2: saves at 2, 4 and 6, the
    next step dispatched while Orbax still works on the save). Orbax's barriers ran as device
    all-gathers on the checkpoint writer thread, interleaved with the step's collectives in a
    different order on each process: both hung at the first step after a save (notes/savehang.md)."""
    sets = MESH_222 + TINY + ["checkpoint.every=2"]
    procs = _train(tmp_path, "periodic", tmp_path / "periodic", sets, processes=2)
    try:
        rcs = procs.wait(timeout=180)  # ~30 s here (the step's compile is cached); a hang is for good
    except subprocess.TimeoutExpired:
        last = procs.out(0).strip().splitlines()[-3:]
        pytest.fail(f"two processes with periodic saves hung; process 0's last lines: {last}")
    _check(procs, rcs)
    ref, got = _losses(runs["tmp"] / "one"), _losses(tmp_path / "periodic")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=RTOL), (step, loss, ref[step])
    evals = [json.loads(x).get("eval_loss") for x in (tmp_path / "periodic" / "metrics.jsonl").read_text().splitlines()]
    ref_eval = json.loads((runs["tmp"] / "one" / "metrics.jsonl").read_text().splitlines()[-1])["eval_loss"]
    assert evals[-1] == pytest.approx(ref_eval, rel=RTOL)
    out = procs.out(0)
    assert all(f"checkpoint: saving step {s}" in out for s in (2, 4, 6)), out
    assert sorted(int(p.name) for p in (tmp_path / "periodic" / "checkpoints").iterdir()) == [2, 4, 6]


def test_only_process_0_writes_metrics_and_progress(runs):
    two, written = runs["two"], runs["written_by_two"]
    assert len(written["metrics"].splitlines()) == 2  # one line per step, not one per process
    assert len(written["events"]) == 1, written["events"]
    assert "step 2/6" in two.out(0) and "checkpoint: saving step 2" in two.out(0)
    out1 = two.out(1)
    assert "step " not in out1 and "checkpoint" not in out1 and "mesh:" not in out1, out1


def test_errors_name_the_process(runs, tmp_path):
    # --fresh on a workdir with checkpoints is refused after the runtime is up, in every process.
    procs = _train(tmp_path, "fresh", runs["tmp"] / "two", MESH_222 + TINY, processes=2, extra=["--fresh"])
    assert procs.wait() == [2, 2]
    for i in (0, 1):
        assert f"parallax[process {i}/2]: error: workdir" in procs.err(i), procs.err(i)


MESH_SCRIPT = """
import json
from parallax.train.distributed import initialize, process_spec
initialize(process_spec(), None)  # from PARALLAX_* env
from parallax.config import MeshConfig
from parallax.train.data import process_rows
from parallax.parallel.mesh import make_mesh
from parallax.train.train_step import batch_sharding
mesh = make_mesh(MeshConfig(data=2, tensor=4))
groups = mesh.devices.transpose(0, 2, 3, 1).reshape(-1, mesh.shape["tensor"])  # [data, tensor, pipe, expert] -> [., tensor]
print(json.dumps({"groups": [[d.process_index for d in g] for g in groups],
                  "rows": process_rows(batch_sharding(mesh), (8, 32)).tolist()}))
"""


def test_tensor_groups_stay_inside_one_process(tmp_path):
    port = _free_port()
    procs = [Procs(tmp_path, f"mesh{i}", lambda _: [sys.executable, "-c", MESH_SCRIPT], 1,
                   env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                        "PARALLAX_COORDINATOR": f"127.0.0.1:{port}", "PARALLAX_NUM_PROCESSES": "2",
                        "PARALLAX_PROCESS_ID": str(i)}) for i in (0, 1)]
    for p in procs:
        _check(p, p.wait(120))
    seen = [json.loads(p.out(0).strip().splitlines()[-1]) for p in procs]
    assert seen[0]["groups"] == seen[1]["groups"]
    groups = seen[0]["groups"]
    assert len(groups) == 2 and all(len(set(g)) == 1 for g in groups), groups
    assert {g[0] for g in groups} == {0, 1}  # one tensor group per process
    # Each process reads only its own data shard's rows: disjoint halves of the global batch.
    assert sorted(seen[0]["rows"] + seen[1]["rows"]) == list(range(8))
    assert len(seen[0]["rows"]) == len(seen[1]["rows"]) == 4


def test_a_dead_process_stops_the_other_within_the_heartbeat_bound(tmp_path):
    """Two runs. SIGKILL closes the peer's sockets, so the survivor's next collective
    fails at once; SIGSTOP leaves them open (a hung host), and only the missing heartbeats end the
    survivor's wait. Either way it must exit non-zero, with a clear message, within the bound."""
    sets = ["mesh.data=8", "mesh.tensor=1", "train.steps=100000", *TINY[:5], "train.log_every=1"]
    signals = {"killed": signal.SIGKILL, "hung": signal.SIGSTOP}
    runs, results = {}, {}
    try:
        deadline = time.monotonic() + 300
        for name in signals:  # one after the other: the second reads the compiled step from the cache
            procs = runs[name] = _train(tmp_path, name, tmp_path / name, sets, processes=2,
                                        extra=["--heartbeat-timeout", str(HEARTBEAT_S)])
            metrics = tmp_path / name / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both in the loop
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs.procs), procs.err(0)
                time.sleep(0.2)
            procs.procs[1].send_signal(signals[name])
            sent = time.monotonic()
            results[name] = (procs.procs[0].wait(timeout=HEARTBEAT_S + 60), time.monotonic() - sent)
    finally:
        for procs in runs.values():
            for p in procs.procs:
                p.kill()  # SIGKILL also ends a stopped process
                p.wait()
    for name, (rc, elapsed) in results.items():
        print(f"{name}: the survivor exited with {rc} after {elapsed:.1f} s")
        assert rc != 0, name
        assert elapsed < HEARTBEAT_S + 15, (name, elapsed)  # heartbeat timeout plus polling slack
    killed, hung = runs["killed"].err(0), runs["hung"].err(0)
    # JAX's coordination service aborts the survivor (SIGABRT) with its own message.
    coordination = "Terminating process because the JAX distributed service detected fatal errors"
    # Killed: the survivor's next collective usually fails at once (gloo, reported with the process
    # prefix); on a loaded machine the coordination service's heartbeat check was seen to fire
    # first (CI, 2026-11-30). Either is a clear error within the bound.
    assert "parallax[process 0/2]: error: JaxRuntimeError" in killed or coordination in killed, killed[-3000:]
    assert coordination in hung, hung[-3000:]
    assert "stopped sending heartbeats" in hung


# ----------------------------------------------------------------------------------------------
# Pure parts, in-process


def test_process_spec_sources():
    assert dist.process_spec(environ={}) is None
    spec = dist.process_spec("10.0.0.1:1234", 4, 3, environ={})
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.heartbeat_s) == ("10.0.0.1:1234", 4, 3, 100)
    env = {"PARALLAX_COORDINATOR": "h:9", "PARALLAX_NUM_PROCESSES": "2", "PARALLAX_PROCESS_ID": "1",
           "PARALLAX_HEARTBEAT_TIMEOUT": "7"}
    spec = dist.process_spec(environ=env)
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.heartbeat_s) == ("h:9", 2, 1, 7)
    assert dist.process_spec(process_id=0, environ=env).process_id == 0  # a flag beats the env
    jax_env = {"JAX_COORDINATOR_ADDRESS": "c:5", "PARALLAX_NUM_PROCESSES": "2", "PARALLAX_PROCESS_ID": "0"}
    assert dist.process_spec(environ=jax_env).coordinator == "c:5"
    slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    spec = dist.process_spec(environ=slurm)
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == (None, 2, 1, "SLURM")
    assert dist.process_spec(environ={**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert dist.process_spec(num_processes=1, environ=slurm) is None  # explicitly one process
    assert dist.process_spec(environ={}, platform="tpu").source == "Cloud TPU"


@pytest.mark.parametrize("args, env, words", [
    (("h:1", 2, None), {}, ["--process-id", "PARALLAX_PROCESS_ID", "missing"]),
    ((None, 2, 0), {}, ["--coordinator", "missing"]),
    (("h", 2, 0), {}, ["--coordinator", "HOST:PORT", "'h'"]),
    (("h:99999", 2, 0), {}, ["--coordinator", "port"]),
    (("h:1", 2, 2), {}, ["--process-id", "0..1", "2"]),
    (("h:1", 0, 0), {}, ["--num-processes", "at least 1"]),
    ((None, None, None), {"PARALLAX_NUM_PROCESSES": "two"}, ["PARALLAX_NUM_PROCESSES", "integer"]),
])
def test_process_spec_refuses_bad_layouts(args, env, words):
    with pytest.raises(dist.LaunchError) as e:
        dist.process_spec(*args, environ=env)
    for w in words:
        assert w in str(e.value)


def test_overlap_flags_per_platform():
    flags, added = dist.with_overlap_flags("", "gpu")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in added and flags == " ".join(added)
    # A user's own value is kept, whatever it is; other flags are left alone.
    user = "--xla_dump_to=/x --xla_gpu_enable_latency_hiding_scheduler=false"
    flags, added = dist.with_overlap_flags(user, "gpu")
    assert flags.startswith(user) and "xla_gpu_enable_latency_hiding_scheduler" not in " ".join(added)
    assert flags.count("latency_hiding") == 1
    assert dist.with_overlap_flags("--a=1", None) == ("--a=1", [])  # CPU: nothing
    assert all(f.startswith("--xla_tpu_") or f.startswith("--xla_enable_") for f in dist.with_overlap_flags("", "tpu")[1])
    assert dist.with_overlap_flags("", "gpu", defined=lambda name: False)[1] == []


def test_gpu_overlap_flags_exist_in_the_installed_jaxlib():
    # The same XLA flag table the CUDA plugin is built from; a flag missing here would abort XLA.
    defined = dist.flags_defined_in(dist._libraries("gpu") or [Path(dist.importlib.util.find_spec("jaxlib")
                                                                    .submodule_search_locations[0]) / "libjax_common.so"])
    assert all(defined(name) for name in dist.GPU_FLAGS), [n for n in dist.GPU_FLAGS if not defined(n)]
    assert not defined("xla_gpu_enable_async_all_reduce")  # removed from XLA; setting it aborts


def test_tpu_overlap_flags_exist_in_the_installed_libtpu():
    """The run-time check reads libtpu.so only: the wheel also ships sdk.so, which holds no flag
    table, and requiring every flag in both left a TPU run with none of them (found 2026-12-02)."""
    if dist.importlib.util.find_spec("libtpu") is None:
        if os.environ.get("CI"):
            pytest.fail("libtpu is not installed (the test extra installs it)")
        pytest.skip("libtpu is not installed")
    assert [p.name for p in dist._libraries("tpu")] == ["libtpu.so"]
    assert dist.overlap_options("tpu") == {name: True for name in dist.TPU_FLAGS}
    assert not dist.flags_defined_in(dist._libraries("tpu"))("xla_tpu_no_such_flag_at_all")


def test_slices_split_over_pipe_then_data():
    assert dcn_shape((2, 8, 1, 4), 4) == (2, 2, 1, 1)  # [pipe, data, expert, tensor]
    assert dcn_shape((1, 8, 1, 4), 2) == (1, 2, 1, 1)
    with pytest.raises(ConfigError, match="mesh.pipe x mesh.data"):
        dcn_shape((1, 2, 1, 8), 4)  # tensor would have to cross slices


def test_cpu_devices_are_split_over_processes(monkeypatch):
    from parallax.config import MeshConfig, UserError
    from parallax.train.distributed import configure_host_devices

    cfg = type("C", (), {"mesh": MeshConfig(data=2, tensor=2, pipe=2)})()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert "4 CPU devices in each of 2 processes" in configure_host_devices(cfg, 2)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(UserError, match="3 processes"):
        configure_host_devices(cfg, 3)


@pytest.mark.parametrize("name, devices", [("multihost_ssh_8", 8), ("multihost_slurm_64", 64),
                                           ("multihost_tpu_512", 512)])
def test_example_launch_configs_are_valid(name, devices):
    from parallax.config import load_experiment, resolve_mesh_shape

    cfg = load_experiment(REPO / "experiments" / f"{name}.py")
    sizes = resolve_mesh_shape(cfg.mesh, devices)
    parallelism.check(cfg, sizes)
    assert sizes["data"] * sizes["tensor"] * sizes["pipe"] * sizes["expert"] == devices
