"""Named compile-only targets: `v5e-8`, `v5p-32`, `tpu7x-256`, ... -> devices to compile for, with no device.

A target names a real slice the way Cloud TPU's accelerator types and MaxText's
`compile_topology` spell it; `target_devices(name)` returns the compile-only devices of that
slice (`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name=...)`), whose
compiler is the real one (libtpu's). `build(cfg, target_devices(name))` lays a config out on them
with make_mesh's device order; nothing can run on them, everything can be compiled.

Counting, as the accelerator type names do:
- v5e, v6e: N counts chips (one TensorCore, one JAX device each): `v5e-8` is 8 devices.
- v4, v5p: N counts TensorCores; a chip is two cores fused into one JAX device (megacore), so
  `v5p-32` and `v4-128` are 16 and 64 devices.
- tpu7x (Ironwood): N counts TensorCores and each is its own JAX device (2 per chip): `tpu7x-8`
  is 4 chips, 8 devices.
- `KxNAME` (e.g. `2xv5p-128`): K slices of NAME over the data-centre network (multislice);
  make_mesh lays pipe, then data, across the slices (mesh.dcn_shape).
GPU targets (`h100-N`, `h200-N`, `b200-N`: N GPUs, 8 per host, as on a DGX/HGX) compile with the
XLA:GPU compiler of the CUDA plugin, with no GPU: `get_topology_desc(platform="cuda",
target_config=<GpuTargetConfigProto>, topology="1xHx8")` gives H hosts of 8 compile-only GPUs.
The device descriptions are XLA's own (gpu_specs/*.txtpb, from openxla/xla's
xla/backends/gpu/target_config/specs). The compile needs jax-cuda12-plugin (with jax-cuda12-pjrt)
and ptxas with libdevice (nvidia-cuda-nvcc-cu12, or a CUDA toolkit); nvidia-cuda-runtime-cu12
keeps the plugin from logging "Could not find cuda drivers" when JAX starts with no GPU. No other
CUDA wheel is needed (no cuBLAS, NCCL: nothing runs), but for cuDNN flash attention
(model.attention, the default on a GPU mesh): jax asks the cuDNN library (nvidia-cudnn-cu12) for
its version while tracing, so that compile needs it (build refuses it in one line without).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.resources
import importlib.util
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass

from parallax.config import ConfigError, MeshConfig, UserError, resolve_mesh_shape


class TargetError(UserError):
    """A bad --target: one line naming it, exit 2."""


class UnknownTarget(TargetError):
    pass


class CompilerNotInstalled(TargetError):
    pass


class TargetMeshMismatch(TargetError, ConfigError):
    """The config's mesh does not multiply to the target's device count."""


@dataclass(frozen=True)
class Target:
    name: str  # as the user spells it: 'v5p-32', '2xv5e-256'
    platform: str  # JAX platform of its devices: 'tpu' or 'gpu'
    topology: str | None  # TPU: get_topology_desc's topology_name ('v5p:2x2x4'); GPU: None
    devices: int  # JAX devices in all slices
    chips: int  # chips in all slices
    slices: int
    device_type: str | None  # the planner's key in analysis/presets.DEVICES (None: not in that table)
    package: str  # what installs its compiler
    chip_config: str | None = None  # get_topology_desc's chip_config_name ('megacore': 2 cores, 1 device)

    @property
    def devices_per_slice(self) -> int:
        return self.devices // self.slices

    @property
    def scatter_all_reduce_group(self) -> int:
        """The group (devices) whose reduce-scatters this target's compiler writes as an all-reduce
        of the whole and a slice of it; 0: none. XLA:TPU does so on v4 and v5p for a group that is
        the whole slice on a torus with three dimensions > 1 (v5p-16's 2x2x2, v5p-32's 2x2x4), an
        explicit `psum_scatter` too. A sub-slice group there (a 2x2x2 cube or a plane of v5p-32),
        a 2x2x1 slice (v5p-8), a 2-D slice (v5e, v6e) and tpu7x all reduce-scatter (probed with
        libtpu 0.0.42.1: BUILD_NOTES.md). The result is the whole, so the links carry an
        all-reduce's bytes, twice a reduce-scatter's."""
        return self.devices_per_slice if min(self._megacore_torus() or [0]) > 1 else 0

    @property
    def gather_all_reduce_group(self) -> int:
        """The group whose all-gathers this target's compiler writes as an all-reduce (each device
        adding its shard into a zeroed whole; the same result, twice the bytes over the links);
        0: none. XLA:TPU does so on v4 and v5p for the whole slice when every dimension is 4 or
        more (v5p-128's 4x4x4 and up, v4-128; not v5p-64's 2x4x4, nor a 4x4x4 half of v5p-256:
        probed with libtpu 0.0.42.1, BUILD_NOTES.md)."""
        return self.devices_per_slice if min(self._megacore_torus() or [0]) >= 4 else 0

    def _megacore_torus(self) -> list[int] | None:
        """The slice's three chip dimensions on v4 and v5p (one device per chip), else None."""
        if self.platform != "tpu" or self.chip_config != "megacore" or not self.topology:
            return None
        dims = [int(x) for x in self.topology.split(":")[1].split("x")]
        return dims if len(dims) == 3 else None

    @property
    def fast_domain(self) -> int:
        """Devices that talk over the fast links: a TPU slice's ICI, a GPU host's NVLink."""
        return self.devices_per_slice if self.platform == "tpu" else min(GPU_PER_HOST, self.devices)


# ----------------------------------------------------------------------------------------------
# The table. TPU slice shapes: Cloud TPU's accelerator types (cloud.google.com/tpu/docs/v5e,
# /v5p, /v6e, /v4, /tpu7x "Ironwood") and MaxText's compile_topology names
# (AI-Hypercomputer/maxtext, MaxText/accelerator_to_spec_map.py: e.g. "v5p-32" -> "v5:2x2x4",
# 16 devices; "v4-128" -> "v4:4x4x4", 64; "v6e-256" -> "v6e:16x16"); tpu7x-8 is "tpu7x:2x2x1"
# (GKE's TPU_ACCELERATOR_TYPE for a 2x2x1 Ironwood slice). Device counts as libtpu 0.0.42.1's
# get_topology_desc gives them (checked 2026-12-01: v5e:2x4 -> 8, v5p:2x2x4 -> 16, v4:4x4x4 ->
# 64 with chip_config_name="megacore", tpu7x:2x2x1 -> 8, tpu7x:4x4x4 -> 128; v5e:1x1 is refused:
# hosts hold 2x2 chips).

_TPU = "libtpu (pip install 'jax[tpu]==0.10.2')"
# The smallest set that compiles for a GPU target on a machine with no GPU and no CUDA toolkit
# (checked 2026-12-01, jax 0.10.2: 4 wheels, 227 MB to download, 610 MB installed; BUILD_NOTES.md):
# the plugin and its PJRT library (jax[cuda12-local]), ptxas + libdevice (nvidia-cuda-nvcc-cu12),
# libcudart (nvidia-cuda-runtime-cu12; without it the plugin logs to stderr when JAX starts).
CUDA_WHEELS = ("nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12")
_CUDA = "the CUDA plugin (jax-cuda12-plugin)"
GPU_PER_HOST = 8
# 2D (v5e, v6e) and 3D (v4, v5p, tpu7x) slice shapes by chip count.
_SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
              512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}


@dataclass(frozen=True)
class _Family:
    topology: str | None  # prefix of topology_name
    shapes: dict[int, str] | None  # chips -> slice shape (None: GPU, any multiple of a host)
    n_per_chip: int  # how many of the name's N one chip is (cores per chip in the name)
    devices_per_chip: int  # JAX devices per chip
    platform: str
    device_type: str | None
    package: str
    chip_config: str | None = None


FAMILIES = {
    "v5e": _Family("v5e", _SHAPES_2D, 1, 1, "tpu", "tpu-v5e", _TPU),
    "v6e": _Family("v6e", _SHAPES_2D, 1, 1, "tpu", "tpu-v6e", _TPU),
    # megacore as MaxText asks for it (chip_config_name): libtpu's default v4 is 2 devices per chip
    # (v4:4x4x4 -> 128), where a real v4 slice shows JAX one device per chip.
    "v4": _Family("v4", {k: v for k, v in _SHAPES_3D.items() if k <= 2048}, 2, 1, "tpu", "tpu-v4", _TPU, "megacore"),
    "v5p": _Family("v5p", _SHAPES_3D, 2, 1, "tpu", "tpu-v5p", _TPU, "megacore"),
    "tpu7x": _Family("tpu7x", _SHAPES_3D, 2, 2, "tpu", None, _TPU),
    # GPU: N GPUs, 8 per host (DGX/HGX); the compiler's device description: GPU_SPECS.
    "h100": _Family(None, None, 1, 1, "gpu", "h100", _CUDA),
    "h200": _Family(None, None, 1, 1, "gpu", "h200", _CUDA),
    "b200": _Family(None, None, 1, 1, "gpu", "b200", _CUDA),
}
# The XLA:GPU compiler's device description per GPU family (gpu_specs/, next to this file):
# openxla/xla's xla/backends/gpu/target_config/specs/{h100_sxm,h200,b200}.txtpb, less the one
# field jaxlib 0.10.2's GpuTargetConfigProto lacks. The planner's peak FLOPs and memory for the
# same devices are analysis/presets.DEVICES.
GPU_SPECS = {"h100": "h100.txtpb", "h200": "h200.txtpb", "b200": "b200.txtpb"}
ALIASES = {"v5litepod": "v5e", "v7x": "tpu7x"}  # Cloud TPU's older v5e spelling; Ironwood's marketing name

_NAME = re.compile(r"^(?:(\d+)x)?([a-z0-9]+)-(\d+)$")


def known_names() -> list[str]:
    """Every single-slice name the table holds, family by family."""
    out = []
    for fam, f in FAMILIES.items():
        if f.shapes is None:
            out += [f"{fam}-{n}" for n in (1, 8, 64, 512)]
        else:
            out += [f"{fam}-{chips * f.n_per_chip}" for chips in f.shapes]
    return out


def _examples() -> str:
    return "v5e-8, v6e-256, v5p-32, v4-128, tpu7x-8, 2xv5p-128, h100-64"


def target(name: str) -> Target:
    """The table's entry for `name`; raises UnknownTarget (one line, with known names)."""
    m = _NAME.match(name.strip().lower())
    fam_name = ALIASES.get(m.group(2), m.group(2)) if m else None
    if not m or fam_name not in FAMILIES:
        raise UnknownTarget(f"--target {name!r}: unknown target (known: {_examples()}; families: "
                            f"{', '.join(FAMILIES)})")
    slices, n = int(m.group(1) or 1), int(m.group(3))
    f = FAMILIES[fam_name]
    if slices < 1:
        raise UnknownTarget(f"--target {name!r}: the slice count must be at least 1")
    if f.shapes is None:
        if n < 1 or (n > GPU_PER_HOST and n % GPU_PER_HOST):
            raise UnknownTarget(f"--target {name!r}: {fam_name}-N counts GPUs, 1-8 or a multiple of {GPU_PER_HOST} "
                                f"(one host has {GPU_PER_HOST}); e.g. {fam_name}-8, {fam_name}-64")
        return Target(name, f.platform, None, n * slices, n * slices, slices, f.device_type, f.package)
    chips = n // f.n_per_chip
    if n % f.n_per_chip or chips not in f.shapes:
        unit = "chips" if f.n_per_chip == 1 else "TensorCores (2 per chip)"
        sizes = ", ".join(f"{fam_name}-{c * f.n_per_chip}" for c in f.shapes)
        raise UnknownTarget(f"--target {name!r}: unknown slice size ({fam_name}-N counts {unit}; known: {sizes})")
    return Target(name, f.platform, f"{f.topology}:{f.shapes[chips]}", chips * f.devices_per_chip * slices,
                  chips * slices, slices, f.device_type, f.package, f.chip_config)


def all_reduce_groups(name: str | None, device_type: str | None = None, n_devices: int = 0) -> tuple[int, int]:
    """(Target.scatter_all_reduce_group, .gather_all_reduce_group) of the target `name`; with no
    name, of the one slice of `n_devices` devices of the planner's `device_type` ('tpu-v5p'). (0, 0)
    where no such target is known (a GPU, several slices' worth of devices, no name at all)."""
    if name is None:
        family = next((k for k, f in FAMILIES.items() if f.device_type == device_type and f.shapes), None)
        if family is None:
            return 0, 0
        f = FAMILIES[family]
        name = f"{family}-{n_devices * f.n_per_chip // f.devices_per_chip}"  # N counts what the family's names do
    try:
        t = target(name)
    except TargetError:
        return 0, 0
    return t.scatter_all_reduce_group, t.gather_all_reduce_group


def _ptxas_found() -> bool:
    """ptxas (and libdevice beside it): the nvidia-cuda-nvcc-cu12 wheel, or a CUDA toolkit."""
    try:
        if importlib.util.find_spec("nvidia.cuda_nvcc") is not None:
            return True
    except (ImportError, ValueError):
        pass
    return shutil.which("ptxas") is not None or os.path.exists("/usr/local/cuda/bin/ptxas")


def _gpu_install_line() -> str:
    from importlib import metadata

    try:
        jax_version = metadata.version("jax")
    except metadata.PackageNotFoundError:
        jax_version = "0.10.2"
    return f"pip install 'jax[cuda12-local]=={jax_version}' {' '.join(CUDA_WHEELS)}"


def compiler_installed(t: Target) -> bool:
    if t.platform == "tpu":
        return importlib.util.find_spec("libtpu") is not None
    return importlib.util.find_spec("jax_cuda12_plugin") is not None and _ptxas_found()


def require_compiler(t: Target) -> None:
    """Raises CompilerNotInstalled, one line naming what to install, when `t`'s compiler is missing."""
    if compiler_installed(t):
        return
    if t.platform == "tpu":
        raise CompilerNotInstalled(f"--target {t.name}: the TPU compiler is not installed; it comes with {t.package}")
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        what = "the GPU compiler (the CUDA plugin, jax-cuda12-plugin) is not installed"
    else:
        what = "the GPU compiler needs ptxas, which is not found (nvidia-cuda-nvcc-cu12, or a CUDA toolkit on PATH)"
    raise CompilerNotInstalled(f"--target {t.name}: {what}; no GPU is needed to compile: {_gpu_install_line()}")


def target_mesh_shape(mesh: MeshConfig, t: Target) -> dict[str, int]:
    """The config's mesh resolved on the target's device count; raises TargetMeshMismatch naming
    the mesh fields and the count."""
    try:
        return resolve_mesh_shape(mesh, t.devices)
    except ConfigError as e:
        sizes = dataclasses.asdict(mesh)
        shape = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items())
        fixed = math.prod(v for v in sizes.values() if v > 0)
        if any(v <= 0 and v != -1 for v in sizes.values()) or list(sizes.values()).count(-1) > 1:
            why = str(e)  # a bad size of its own: resolve_mesh_shape names the field
        elif -1 in sizes.values():
            why = f"the other axes' product {fixed} does not divide {t.devices}"
        else:
            why = f"{fixed} devices"
        raise TargetMeshMismatch(f"--target {t.name} has {t.devices} devices ({t.chips} chips), but the config's mesh "
                                 f"is {shape}: {why}") from None


@contextlib.contextmanager
def _quiet_stderr():
    """libtpu, finding no TPU, prints warnings about TPU_ACCELERATOR_TYPE and worker hostnames
    straight to file descriptor 2 while it makes a topology; the compile-only devices are fine."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(fd, 2)
    finally:
        os.close(fd)


_DEVICES: dict[str, list] = {}


def gpu_spec(device_type: str) -> str:
    """The GpuTargetConfigProto text (gpu_specs/) for a GPU family: 'h100', 'h200', 'b200'."""
    return (importlib.resources.files("parallax.parallel") / "gpu_specs" / GPU_SPECS[device_type]).read_text()


def gpu_topology(t: Target) -> str:
    """get_topology_desc's GPU topology, 'slices x hosts x GPUs per host': h100-64 -> '1x8x8'.
    K slices of a GPU target are K times its hosts in one topology (`2xh100-16` -> '1x4x8'): the
    plugin's slices give every device slice_index 0, and GPU hosts share one network anyway."""
    per_host = min(GPU_PER_HOST, t.devices)
    return f"1x{t.devices // per_host}x{per_host}"


def cpu_only_jax() -> None:
    """Compile-only GPU devices need no GPU backend: unless JAX has started, or a GPU is there, JAX
    runs on the CPU, and the CUDA plugin is not asked to find a GPU (its cuInit failure would be
    logged on the user's screen). Commands that compile for a target call it before they import
    anything that imports JAX (`parallax plan --verify`)."""
    if "jax" in sys.modules or os.environ.get("JAX_PLATFORMS") or glob.glob("/dev/nvidia[0-9]*"):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _gpu_devices(t: Target) -> list:
    cpu_only_jax()
    with _quiet_stderr():  # the plugin's loader logs (no libcudart, no driver) go to fd 2
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=gpu_spec(t.device_type),
                                            topology=gpu_topology(t))
    return list(topo.devices)


def target_devices(name: str | Target) -> list:
    """The compile-only devices of target `name`, in the topology's order (make_mesh arranges
    them). Raises UnknownTarget / CompilerNotInstalled. Cached per target."""
    t = name if isinstance(name, Target) else target(name)
    require_compiler(t)
    key = f"{t.device_type}:{gpu_topology(t)}" if t.platform == "gpu" else f"{t.slices}x{t.topology}/{t.chip_config}"
    if key in _DEVICES:
        return _DEVICES[key]
    if t.platform == "gpu":
        devices = _gpu_devices(t)
    else:
        kw = {"num_slices": t.slices} if t.slices > 1 else {}
        if t.chip_config:
            kw["chip_config_name"] = t.chip_config
        if "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu").lower():
            # Compile-only, JAX running elsewhere: libtpu otherwise takes /tmp/libtpu_lockfile, and a
            # second process compiling for a target at the same time (a test's subprocess, another
            # user's audit) fails with "Internal error when accessing libtpu multi-process lockfile".
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        with _quiet_stderr():
            from jax.experimental import topologies

            devices = topologies.get_topology_desc(platform="tpu", topology_name=t.topology, **kw).devices
    if len(devices) != t.devices:  # the table and the compiler disagree: a wrong table entry
        raise RuntimeError(f"target {t.name}: the compiler's topology has {len(devices)} devices, the table "
                           f"says {t.devices}")
    _DEVICES[key] = list(devices)
    return _DEVICES[key]
