"""Named compile-only targets (parallel/targets.py): the table, the mesh on a target's devices,
`parallax audit --target` / `audit(cfg, target=...)` compiled by the TPU compiler with no TPU,
`parallax plan --target`, and every bad --target refused in one line with exit status 2.

The TPU compiles go through libtpu (the test extra installs it; Linux x86_64 only). Under env CI
a missing libtpu fails these tests instead of skipping them. One compile here: the tiny dense
model on data 4 x tensor 2 for v5e-8, shared by the API and the CLI tests (audit.compile_step's
cache), about 8 s on 2 cores.

The GPU compiles (h100-8: the same tiny model, bf16 and FP8) go through the CUDA plugin with no
GPU (the test extra installs jax[cuda12-local] and ptxas from nvidia-cuda-nvcc-cu12; Linux x86_64
only); under env CI a missing plugin fails them too. Two compiles, about 5 s and 7 s on 2 cores.
"""

import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.analysis.audit import FAST_COMPILE, audit, compile_step

from parallax.analysis.gemms import matmuls
from parallax.analysis.hlo import collectives, conv_macs, kernel_bytes, kernels, while_loops
from parallax.cli import main
from parallax.config import Config, ConfigError, Fp8Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
from parallax.parallel import targets
from parallax.parallel.mesh import make_mesh
from parallax.parallel.targets import target, target_devices

# TPU tiles are 128 lanes wide: the smallest model whose shapes the TPU compiler keeps as they are.
MODEL = ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256, dtype="bfloat16")
CFG = Config(name="tiny_tpu", mesh=MeshConfig(data=4, tensor=2), model=MODEL,
             train=TrainConfig(global_batch=8, seq_len=64))
EXPERIMENT = """from parallax.config import Config, MeshConfig, ModelConfig, TrainConfig


def get_config():
    return Config(name="tiny_tpu", mesh=MeshConfig(data=4, tensor=2),
                  model=ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256,
                                    dtype="bfloat16"),
                  train=TrainConfig(global_batch=8, seq_len=64))
"""


@pytest.fixture(scope="module")
def libtpu():
    """The TPU compiler must be there: a failure under CI, a skip elsewhere."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64") or importlib.util.find_spec("libtpu") is None:
        if os.environ.get("CI"):  # CI installs libtpu and must run these: never a silent skip there
            pytest.fail("the compile-only TPU target tests need libtpu (Linux x86_64; the test extra installs it)")
        pytest.skip("libtpu is not installed (it has wheels for Linux x86_64 only; the test extra installs it)")


@pytest.fixture(scope="module")
def cuda_plugin():
    """The GPU compiler (CUDA plugin + ptxas) must be there: a failure under CI, a skip elsewhere."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64") or not targets.compiler_installed(
            target("h100-8")):
        if os.environ.get("CI"):  # CI installs the plugin and must run these: never a silent skip there
            pytest.fail("the compile-only GPU target tests need the CUDA plugin and ptxas (Linux x86_64; the test "
                        f"extra installs them: {targets._gpu_install_line()})")
        pytest.skip(f"the CUDA plugin or ptxas is not installed (Linux x86_64 only; {targets._gpu_install_line()})")
    # The GPU steps run cuDNN flash attention (model.attention auto on a GPU mesh), whose compile
    # needs the cuDNN library (the test extra installs nvidia-cudnn-cu12): checked the same way.
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except Exception as e:  # noqa: BLE001 - "cuDNN is not detected", a loader error
        if os.environ.get("CI"):
            pytest.fail(f"the GPU target tests need the cuDNN library (the test extra installs nvidia-cudnn-cu12): {e}")
        pytest.skip(f"the cuDNN library is not installed (pip install nvidia-cudnn-cu12): {e}")


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    path = tmp_path_factory.mktemp("targets") / "tiny_tpu.py"
    path.write_text(EXPERIMENT)
    return str(path)


@pytest.fixture(scope="module")
def v5e_audit(libtpu):
    """The audit of CFG compiled for v5e-8: the one compile of this file (the CLI test reuses it)."""
    return audit(CFG, FAST_COMPILE, target="v5e-8")


# ----------------------------------------------------------------------------------------------
# The table


@pytest.mark.parametrize("name, platform_, topology, devices, chips", [
    ("v5e-8", "tpu", "v5e:2x4", 8, 8),  # v5e, v6e: N counts chips, one device each
    ("v5litepod-16", "tpu", "v5e:4x4", 16, 16),
    ("v6e-256", "tpu", "v6e:16x16", 256, 256),
    ("v5p-32", "tpu", "v5p:2x2x4", 16, 16),  # v5p, v4: N counts TensorCores, 2 per chip (one device)
    ("v5p-8192", "tpu", "v5p:16x16x16", 4096, 4096),
    ("v4-128", "tpu", "v4:4x4x4", 64, 64),
    ("tpu7x-8", "tpu", "tpu7x:2x2x1", 8, 4),  # Ironwood: N counts TensorCores, each its own device
    ("tpu7x-256", "tpu", "tpu7x:4x4x8", 256, 128),
    ("2xv5p-128", "tpu", "v5p:4x4x4", 128, 128),  # two slices
    ("h100-64", "gpu", None, 64, 64),
])
def test_target_table(name, platform_, topology, devices, chips):
    t = target(name)
    assert (t.platform, t.topology, t.devices, t.chips) == (platform_, topology, devices, chips)
    assert t.name in targets.known_names() or t.slices > 1 or "litepod" in name


@pytest.mark.parametrize("name, devices, kind", [
    ("v5e-8", 8, "TPU v5 lite"), ("v6e-256", 256, "TPU v6 lite"), ("v5p-32", 16, "TPU v5"), ("v4-128", 64, "TPU v4"),
    ("tpu7x-8", 8, "TPU7x"), ("2xv5e-8", 16, "TPU v5 lite"),
])
def test_target_devices_are_libtpus_compile_only_devices(libtpu, name, devices, kind):
    found = target_devices(name)  # raises if libtpu's count disagrees with the table
    assert len(found) == devices and {d.platform for d in found} == {"tpu"} and found[0].device_kind == kind
    assert len({getattr(d, "slice_index", 0) for d in found}) == target(name).slices


def test_libtpu_warnings_stay_off_the_users_screen(libtpu):
    """libtpu, with no TPU, writes TPU_ACCELERATOR_TYPE / worker-hostname warnings to fd 2 when it
    makes a topology; target_devices keeps them there."""
    code = "from parallax.parallel.targets import target_devices; print(len(target_devices('v5e-8')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert (out.returncode, out.stdout, out.stderr) == (0, "8\n", ""), out.stderr


def test_build_on_a_target_uses_its_devices_in_make_mesh_order(libtpu):
    from parallax.train.build import build

    devices = target_devices("v5e-8")
    built = build(CFG, devices)
    assert built.mesh.devices.tolist() == make_mesh(CFG.mesh, devices).devices.tolist()
    assert set(built.mesh.devices.flat) == set(devices) and dict(built.mesh.shape)["tensor"] == 2
    assert (built.platform, built.parallelism.platform) == ("tpu", "tpu")
    # tensor innermost: each tensor pair is on one host (4 chips per v5e host)
    for row in built.mesh.devices.reshape(4, 2, -1)[..., 0]:
        assert len({d.process_index for d in row}) == 1
    # the CPU-only guards are XLA:CPU's: a bfloat16 pipeline is refused on CPU, built for a TPU
    piped = dataclasses.replace(CFG, mesh=MeshConfig(data=2, tensor=2, pipe=2),
                                parallel=ParallelConfig(microbatches=2))
    with pytest.raises(ConfigError, match="bfloat16"):
        build(piped)
    assert build(piped, devices).parallelism.platform == "tpu"
    # two slices: data crosses the data-centre network (outer half per slice), tensor never does
    grid = build(dataclasses.replace(CFG, mesh=MeshConfig(data=8, tensor=2)), target_devices("2xv5e-8")).mesh.devices
    slices = [[d.slice_index for d in row] for row in grid[:, :, 0, 0]]
    assert slices == [[0, 0]] * 4 + [[1, 1]] * 4, slices


# ----------------------------------------------------------------------------------------------
# audit --target: compiled by the TPU compiler


def test_audit_for_v5e_8_reads_the_tpu_compilers_collectives(v5e_audit):
    a = v5e_audit
    assert (a["platform"], a["target"], a["device_kind"]) == ("tpu", "v5e-8", "TPU v5 lite")
    assert a["compiler"].startswith("XLA:TPU (libtpu ")
    assert a["mesh"] == {"data": 4, "tensor": 2, "pipe": 1, "expert": 1}
    rows = {(tuple(r["axes"]), r["kind"]): r for r in a["collectives"]}
    reductions = ("all-reduce", "reduce-scatter")
    for axis in ("data", "tensor"):
        found = [r for (axes, kind), r in rows.items() if axes == (axis,) and kind in reductions]
        assert found and sum(r["bytes"] for r in found) > 0 and sum(r["model_bytes"] for r in found) > 0, rows
    assert a["memory"]["xla"] and a["memory"]["xla"]["peak"] > 0  # the TPU compiler's memory analysis
    assert set(a["axes"]) >= {"data", "tensor"}


def test_audit_for_v5e_8_counts_the_scanned_stack_and_the_convolution_matmuls(v5e_audit):
    """The TPU compiler's loops carry no known_trip_count and its matmuls are convolutions: the
    audit reads the trip count from each loop's condition and the FLOPs from the convolutions'
    shapes. Measured on this layout (libtpu 0.0.42.1, 2026-12-01, /work/notes/audit_tpu.md): data
    723,460 compiled vs 723,456 modelled bytes, tensor 329,592 vs 329,216 (the rest are loss and
    norm scalars), matmul FLOPs 146,800,640 both; before the fix data read -41% and tensor -40% of
    the model, matmuls 0. With the gather embedding and the fused loss head (issue 22, same date):
    tensor 329,080 vs 329,216, matmul FLOPs 142,606,336 both (the one-hot matmul gone, the
    logits recomputed in the loss's backward)."""
    a = v5e_audit
    loops = a["loops"]
    assert len(loops) == 2 and {lp["source"] for lp in loops} == {"condition"}, loops  # forward, backward stack
    assert [lp["trip_count"] for lp in loops] == [MODEL.n_layers] * 2, loops
    dots, executed = a["flops"]["hlo_dots"], a["flops"]["executed_model"]["total"]
    assert dots["convolution"] == dots["total"] > 0 and dots["uncounted_convolutions"] == 0, dots
    assert dots["total"] == pytest.approx(executed, rel=0.01), (dots, executed)
    for axis in ("data", "tensor"):
        f = a["axes"][axis]
        assert f["bytes"] == pytest.approx(f["model_bytes"], rel=0.01), (axis, f)
    assert a["axes"]["data"]["executions"] == a["axes"]["data"]["model_executions"] == 3


_LOOP = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i.1, %one)
  %x = f32[4]{0} get-tuple-element(%p.1), index=1
  %ar = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%sum
  ROOT %t = (s32[], f32[4]{0}) tuple(%next, %ar)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %a)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize("edits, trips, source", [
    ((), 5, "condition"),  # for i in range(5)
    (((" compare(%i, %n), direction=LT", " compare(%n, %i), direction=GT"),), 5, "condition"),  # 5 > i
    (((" constant(5)", " constant(6)"), ("direction=LT", "direction=LE"), (" constant(1)", " constant(2)")), 4,
     "condition"),  # i = 0, 2, 4, 6
    (((" constant(0)", " constant(10)"), (" constant(5)", " constant(0)"), ("direction=LT", "direction=GT"),
      (" add(", " subtract("), (" constant(1)", " constant(3)")), 4, "condition"),  # i = 10, 7, 4, 1
    (((" constant(5)", " get-tuple-element(%p), index=1"),), None, "unknown"),  # bound not a constant
    (((" add(%i.1, %one)", " multiply(%i.1, %one)"),), None, "unknown"),  # no constant step
    (((", body=%body", ', body=%body, backend_config={"known_trip_count":{"n":"7"}}'),), 7, "known_trip_count"),
])
def test_while_trip_count_from_the_loop_condition(edits, trips, source):
    hlo = _LOOP
    for old, new in edits:
        assert old in hlo
        hlo = hlo.replace(old, new)
    assert [(lp["trip_count"], lp["source"]) for lp in while_loops(hlo)] == [(trips, source)]
    # an unknown count keeps the old reading (once per entry), flagged as unknown in the report
    assert [c.executions for c in collectives(hlo, {"data": 2})] == [trips or 1]


@pytest.mark.parametrize("out, lhs, rhs, attrs, macs", [
    # as the TPU compiler writes them (v5e-8, the tiny layout): x @ w_qkv over 4 heads (a padded,
    # reversed window over the head dim), the scores q k^T (lhs dilation), a plain x @ w
    ([2, 64, 4, 32], [2, 64, 128, 1], [128, 4, 32, 1],
     "window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f", 2 * 64 * 128 * 128),
    ([2, 64, 2, 64], [2, 64, 2, 32], [2, 64, 32, 1],
     "window={size=2x1 lhs_dilate=2x1}, dim_labels=0b1f_0oi1->0b1f", 2 * 2 * 64 * 64 * 32),
    ([2, 64, 128], [2, 64, 128], [128, 128, 1], "window={size=1}, dim_labels=0bf_io0->0bf", 2 * 64 * 128 * 128),
    ([128, 128, 1], [2, 64, 128], [2, 64, 128], "window={size=2}, dim_labels=0fb_0io->bf0", 2 * 64 * 128 * 128),
    ([8, 8], [8, 8], [8, 8], "dim_labels=bf_io->bf, feature_group_count=2", None),  # not read: uncounted
])
def test_convolution_macs_count_only_real_taps(out, lhs, rhs, attrs, macs):
    assert conv_macs(out, lhs, rhs, attrs) == macs


def test_audit_cli_target_prints_the_tpu_report_and_nothing_on_stderr(v5e_audit, experiment, capfd):
    assert main(["audit", experiment, "--target", "v5e-8"]) == 0
    out, err = capfd.readouterr()
    assert err == ""
    assert "compiling for v5e-8 (8 compile-only TPU devices, 8 chips; nothing runs)" in out
    assert "on data=4 x tensor=2 x pipe=1 x expert=1 (v5e-8: TPU v5 lite, 8 tpu devices), compiled by XLA:TPU" in out
    assert any(line.split()[:2] == ["data", "all-reduce"] for line in out.splitlines()), out
    assert any(line.split()[:2] == ["tensor", "all-reduce"] for line in out.splitlines()), out
    assert "memory per device: XLA" in out
    assert "while loops: 2, 0 with the compiler's known_trip_count, 2 read from the loop condition (2, 2 trips)" in out
    assert re.search(r"compiled matmuls include \d+\.\d\d G from convolutions", out), out


# ----------------------------------------------------------------------------------------------
# plan --target


def test_plan_takes_count_and_device_type_from_the_target(capsys):
    def plan(*argv):
        assert main(["plan", "--preset", "llama2-70b", "--top", "3", *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["layouts"]

    assert plan("--target", "v5p-512") == plan("--devices", "256", "--device", "v5p")
    assert plan("--target", "h100-64") == plan("--devices", "64", "--device", "h100")
    assert plan("--target", "v5p-512", "--devices", "256", "--device", "tpu-v5p") == plan("--target", "v5p-512")


# ----------------------------------------------------------------------------------------------
# Bad input: one line naming the target or field, exit 2


def _refused(capsys, argv, *words):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name, words", [
    ("v9z-8", ("'v9z-8'", "unknown target", "v5e-8", "v5p-32")),
    ("v5e-7", ("'v5e-7'", "counts chips", "v5e-8")),
    ("v5p-24", ("'v5p-24'", "TensorCores", "v5p-32")),
    ("h100-12", ("'h100-12'", "multiple of 8")),
    ("tpu", ("'tpu'", "unknown target")),
])
def test_unknown_target_is_refused(capsys, experiment, name, words):
    _refused(capsys, ["audit", experiment, "--target", name], *words)
    _refused(capsys, ["plan", "--preset", "llama2-70b", "--target", name], *words)


def test_target_without_its_compiler_names_the_package(capsys, experiment, monkeypatch):
    # TPU, as on a machine without libtpu
    monkeypatch.setattr(targets, "compiler_installed", lambda t: False)
    _refused(capsys, ["audit", experiment, "--target", "v5e-8"], "v5e-8", "not installed", "libtpu")


def test_mesh_that_does_not_fit_the_target_is_refused(capsys, experiment):
    _refused(capsys, ["audit", experiment, "--target", "v5e-16", "--set", "mesh.data=4"],
             "v5e-16", "16 devices", "mesh.data=4", "mesh.tensor=2", ": 8 devices")
    _refused(capsys, ["audit", experiment, "--target", "v5e-8", "--set", "mesh.data=-1", "--set", "mesh.tensor=3"],
             "v5e-8", "8 devices", "mesh.data=-1", "mesh.tensor=3")
    with pytest.raises(targets.TargetMeshMismatch, match="v5p-32 has 16 devices"):
        targets.target_mesh_shape(MeshConfig(data=4, tensor=2), target("v5p-32"))


def test_plan_refuses_a_devices_count_the_target_contradicts(capsys):
    _refused(capsys, ["plan", "--preset", "llama2-70b", "--target", "v5p-32", "--devices", "32"],
             "--devices 32", "v5p-32", "16 devices")
    _refused(capsys, ["plan", "--preset", "llama2-70b", "--target", "v5p-32", "--device", "h100"],
             "--device h100", "v5p-32")
    _refused(capsys, ["plan", "--preset", "llama2-70b", "--target", "tpu7x-8"], "tpu7x-8", "no device entry")
    _refused(capsys, ["plan", "--preset", "llama2-70b"], "--devices", "--target")


# ----------------------------------------------------------------------------------------------
# GPU targets: compiled by XLA:GPU (the CUDA plugin), no GPU


@pytest.mark.parametrize("name, topology", [
    ("h100-1", "1x1x1"), ("h100-8", "1x1x8"), ("h200-16", "1x2x8"), ("b200-64", "1x8x8"), ("h100-16384", "1x2048x8"),
    ("2xh100-16", "1x4x8"),
])
def test_gpu_topology_is_hosts_of_eight(name, topology):
    assert targets.gpu_topology(target(name)) == topology


@pytest.mark.parametrize("family, kind, memory", [
    ("h100", "NVIDIA H100 80GB HBM3", 84942979072), ("h200", "NVIDIA H200 141GB HBM3e", 151397597184),
    ("b200", "NVIDIA B200", 191514411008),
])
def test_gpu_specs_are_xlas_device_descriptions(family, kind, memory):
    text = targets.gpu_spec(family)
    assert "openxla/xla, xla/backends/gpu/target_config/specs/" in text  # the source, named
    assert f'device_description_str: "{kind}"' in text and f"device_memory_size: {memory}" in text
    assert "collective_memory_granularity:" not in text  # refused by jaxlib 0.10.2's proto


@pytest.mark.parametrize("name, kind", [("h100-8", "NVIDIA H100 80GB HBM3"), ("h200-16", "NVIDIA H200 141GB HBM3e"),
                                        ("b200-8", "NVIDIA B200")])
def test_gpu_target_devices_are_the_plugins_compile_only_gpus(cuda_plugin, name, kind):
    found = target_devices(name)
    assert len(found) == target(name).devices and {d.platform for d in found} == {"gpu"}
    assert {d.device_kind for d in found} == {kind}
    assert [d.process_index for d in found] == [i // 8 for i in range(len(found))]  # 8 per host


def test_gpu_target_in_a_fresh_process_keeps_the_plugin_off_the_screen(cuda_plugin):
    """As an API user calls it, JAX not started and no JAX_PLATFORMS: target_devices tells JAX to
    run on the CPU before it starts (else the plugin looks for a GPU and logs its failure)."""
    code = ("from parallax.parallel.targets import target_devices; d = target_devices('h100-16'); "
            "import jax; print(len(d), jax.devices()[0].platform)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (0, "16 cpu\n", ""), out.stderr


def test_build_on_a_gpu_target_keeps_tensor_inside_a_host(cuda_plugin):
    from parallax.train.build import build

    devices = target_devices("h100-16")
    built = build(dataclasses.replace(CFG, mesh=MeshConfig(data=8, tensor=2)), devices)
    assert (built.platform, built.parallelism.platform) == ("gpu", "gpu")
    assert set(built.mesh.devices.flat) == set(devices)
    for row in built.mesh.devices.reshape(8, 2):
        assert len({d.process_index for d in row}) == 1


@pytest.fixture(scope="module")
def h100_audit(cuda_plugin):
    """The audit of CFG compiled for h100-8 (the CLI test reuses it), and the compiled HLO."""
    return audit(CFG, FAST_COMPILE, target="h100-8"), compile_step(CFG, FAST_COMPILE, "h100-8").hlo


def test_audit_for_h100_8_reads_the_gpu_compilers_program(h100_audit):
    """The GPU compiler's program: every collective an async -start/-done pair, which hlo.py reads
    (one row per start, its axes from the mesh replica groups); every matmul a Triton gemm fusion;
    memory from its buffer assignment. Measured (jax-cuda12-plugin 0.10.2, 2026-12-01): 13
    all-reduce pairs, 22 gemm fusions, XLA peak 6.76 MB per GPU, cost model -19%. Bytes: an async
    start's are its -done's result (a GPU all-reduce-start returns its result alone, its
    reduce-scatter- and all-gather-start (operands, results)); per axis within 5% of the model
    (seen on the quickstart shape: tensor -0.0%, data -3.6%)."""
    a, hlo = h100_audit
    assert (a["platform"], a["target"], a["device_kind"]) == ("gpu", "h100-8", "NVIDIA H100 80GB HBM3")
    assert a["compiler"].startswith("XLA:GPU (jax-cuda12-plugin ")
    assert a["mesh"] == {"data": 4, "tensor": 2, "pipe": 1, "expert": 1}
    ops = re.findall(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9\-]*)\(", hlo, re.MULTILINE)
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    starts = [op for op in ops if op.endswith("-start") and op[:-6] in kinds]
    assert starts and all(op[:-6] in kinds for op in starts)
    assert sorted(starts) == sorted(op.replace("-done", "-start") for op in ops if op.endswith("-done")
                                    and op[:-5] in kinds)  # each start has its done
    assert not [op for op in ops if op in kinds], "the GPU compiler left a synchronous collective"
    found = collectives(hlo, a["mesh"])
    assert len(found) == len(starts) and all(c.axes for c in found)  # hlo.py reads every async pair
    assert {c.axes for c in found} >= {("data",), ("tensor",)}
    gemms = hlo.count('"kind":"__triton_nested_gemm_fusion"') + hlo.count('custom_call_target="__cublas$gemm"') \
        + hlo.count('custom_call_target="__cublas$lt$matmul"')
    assert gemms >= 4 * MODEL.n_layers and gemms == len(matmuls(hlo)), gemms  # every dot a GEMM kernel
    for axis in ("data", "tensor"):
        f = a["axes"][axis]
        assert f["bytes"] > 0 and f["model_bytes"] == pytest.approx(f["bytes"], rel=0.05), (axis, f)
    assert a["memory"]["xla"] and a["memory"]["xla"]["peak"] > 0
    assert a["flops"]["hlo_dots"]["total"] == pytest.approx(a["flops"]["executed_model"]["total"], rel=0.05)


def test_fp8_gemms_keep_f8_operands_on_h100_8(cuda_plugin):
    """What experiments/bench_gpu.py checks on a real GPU, from the compile-only H100: every matmul
    through the FP8 dot_general stays an f8 GEMM (E4M3 x E4M3 forward; E5M2 gradient x E4M3 in
    both backward matmuls), and only those (the output head stays bf16; attention runs in cuDNN).
    The audit counts them per step (gemms.fp8_report) and names why each other matmul is not FP8."""
    cfg = dataclasses.replace(CFG, fp8=Fp8Config(enabled=True))
    hlo = compile_step(cfg, FAST_COMPILE, "h100-8").hlo
    dots = matmuls(hlo)
    fp8 = [m.operands for m in dots if m.through_fp8_dot]
    rest = [m.operands for m in dots if not m.through_fp8_dot]
    assert fp8 and {t for t in fp8} <= {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}, fp8
    assert rest and not [t for t in rest if any(x.startswith("f8") for x in t)], rest
    # per step: 4 matmuls per block (qkv, out, wi, wo) x L layers forward, twice that backward
    e = audit(cfg, FAST_COMPILE, target="h100-8")["fp8"]
    layers = MODEL.n_layers
    assert (e["fp8_gemms_forward"], e["fp8_gemms_backward"]) == (4 * layers, 8 * layers), e
    assert e["fp8_gemms"] == e["fp8_dot_general"] == 12 * layers
    assert "f8e4m3fn x f8e4m3fn" in e["operand_types"]
    # attention runs in cuDNN's fused kernel (model.attention=auto), whose matmuls are no HLO dots
    assert set(e["not_fp8"]) == {"output head (FP8 only with fp8.logits)"}, e["not_fp8"]


def test_audit_cli_target_h100_8_prints_the_gpu_report_and_nothing_on_stderr(h100_audit, experiment, capfd):
    assert main(["audit", experiment, "--target", "h100-8"]) == 0
    out, err = capfd.readouterr()
    assert err == ""
    assert "compiling for h100-8 (8 compile-only GPU devices, 8 chips; nothing runs)" in out
    assert ("on data=4 x tensor=2 x pipe=1 x expert=1 (h100-8: NVIDIA H100 80GB HBM3, 8 gpu devices), compiled by "
            "XLA:GPU (jax-cuda12-plugin ") in out
    assert any(line.split()[:3] == ["data", "all-reduce", "f32"] for line in out.splitlines()), out
    assert any(line.split()[:3] == ["tensor", "all-reduce", "bf16"] for line in out.splitlines()), out
    assert "memory per device: XLA" in out
    overlap = out.split("overlap in the compiled schedule")[1].splitlines()
    assert any(line.split()[:2] == ["data", "overlapped"] for line in overlap), out


def test_gpu_target_without_the_plugin_or_ptxas_names_the_install(capsys, experiment, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("jax_cuda") else real(name, *a))
    for argv in (["audit", experiment, "--target", "h100-8"], ["audit", experiment, "--target", "b200-16",
                                                               "--set", "mesh.data=8"]):
        line = _refused(capsys, argv, argv[3], "jax-cuda12-plugin", "not installed", "pip install 'jax[cuda12-local]==",
                        "nvidia-cuda-nvcc-cu12")
        assert "Traceback" not in line
    with pytest.raises(targets.CompilerNotInstalled, match="h200-8"):
        target_devices("h200-8")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if importlib.util.find_spec("jax_cuda12_plugin") is not None:  # the plugin, but no ptxas
        monkeypatch.setattr(targets, "_ptxas_found", lambda: False)
        _refused(capsys, ["audit", experiment, "--target", "h100-8"], "h100-8", "ptxas", "nvidia-cuda-nvcc-cu12")


_KERNELS = """HloModule k

%fused (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%a)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused, metadata={op_name="jit(step)/while/body/fp8_telemetry/neg"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %f)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%c0, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %z = f32[8]{0} copy(%y), metadata={op_name="jit(step)/fp8_telemetry_not/copy"}
}
"""


def test_kernel_bytes_count_each_kernel_per_loop_trip_and_nothing_inside_a_fusion():
    """The fusion reads and writes f32[8] (64 bytes) on each of 3 trips, the copy 64 once; the
    negate inside the fusion, views, tuples and the loop itself move nothing of their own."""
    assert kernel_bytes(_KERNELS) == {"total": 3 * 64 + 64, "conditional": 0.0}
    # `scope`: the kernels of a named scope (a whole op_name path component, not a prefix of one)
    assert kernel_bytes(_KERNELS, scope="fp8_telemetry") == {"total": 3 * 64 + 64, "conditional": 0.0,
                                                             "scoped": 3 * 64}


def _bench_gpu_modules():
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "experiments"))
    try:
        import bench_fp8
        import bench_gpu
        import gpu_vs_target
    finally:
        sys.path.remove(str(repo / "experiments"))
    return bench_fp8, bench_gpu, gpu_vs_target, repo / "experiments" / "results" / "h200_2026-12-04"


def _h200_step(bench_gpu, name: str):
    """(bench_gpu's config of case `name`, its step compiled for h200-1: one compile per case)."""
    cfg = bench_gpu.make_config(next(c for c in bench_gpu.CASES if c.name == name), tiny=False)
    return cfg, compile_step(cfg, target="h200-1")


def test_h200_target_gives_the_memory_and_kernels_measured_on_the_device(cuda_plugin):
    """The compile-only GPU target against the device (BUILD_NOTES.md, "First run on a GPU"):
    bench_gpu's dense steps, compiled here for h200-1, against what one real H200 compiled and
    ran (experiments/results/h200_2026-12-04, jax 0.11.2): the BF16 step's XLA peak within 2%
    (measured 0.990-1.000x for all four cases on the program of that day; the FP8 step's own
    program has changed since, below), the FP8 step's FP8 GEMMs and cuDNN attention calls equal."""
    bench_fp8, bench_gpu, gpu_vs_target, results = _bench_gpu_modules()
    measured = gpu_vs_target.real_cases(results)
    for case in ("dense_bf16", "dense_fp8"):  # on the device, XLA's memory analysis was the high-water mark
        assert measured[case]["device"] == "gpu:NVIDIA H200"
        assert measured[case]["peak_bytes_in_use"] == pytest.approx(measured[case]["xla_memory_bytes"], rel=1e-6)
    _, bf16 = _h200_step(bench_gpu, "dense_bf16")
    assert bf16.memory["peak"] == pytest.approx(measured["dense_bf16"]["xla_memory_bytes"], rel=0.02)
    _, fp8 = _h200_step(bench_gpu, "dense_fp8")
    assert bench_fp8.fp8_gemm_report(fp8.hlo)["fp8_gemms"] == measured["dense_fp8"]["hlo"]["fp8_gemms"] == 12
    assert fp8.hlo.count("__cudnn$fmha") == measured["dense_fp8"]["cudnn_attention_calls"] == 3


_PRED = re.compile(r"pred\[([\d,]+)\]")


def test_fp8_weight_telemetry_writes_no_masks_on_one_gpu(cuda_plugin):
    """Issue 22: on one GPU XLA turns the telemetry's conditional into a select, so it runs every
    step; it then fused the weights' saturation and flush comparisons into their transposing cast
    and wrote them out as pred masks the size of every stacked weight (1.65 GiB of the dense FP8
    step's 28.76 GiB on the H200). The weights' telemetry now reads the weights in its own
    reduction (fp8.quantize): no kernel outside a fusion body writes a pred array as large as one
    layer's smallest weight, and the compiled peak is 1.5 GiB under the device's figure for the
    step before (compiled 26.88 GiB, 2026-12-05)."""
    _, bench_gpu, gpu_vs_target, results = _bench_gpu_modules()
    cfg, step = _h200_step(bench_gpu, "dense_fp8")
    m = cfg.model
    smallest = min(m.d_model * m.d_model, m.d_model * m.d_ff)  # elements of one layer's smallest weight
    masks = [k.line.strip()[:160] for k, _ in kernels(step.hlo) for dims in _PRED.findall(k.type)
             if math.prod(int(d) for d in dims.split(",")) >= smallest]
    assert not masks, masks
    before = gpu_vs_target.real_cases(results)["dense_fp8"]["xla_memory_bytes"]
    assert step.memory["peak"] < before - 1.5 * 2**30, (step.memory["peak"] / 2**30, before / 2**30)
