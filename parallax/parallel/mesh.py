"""The one device mesh: axes ('data', 'tensor', 'pipe', 'expert').

Device order puts `tensor` innermost so that the latency-critical tensor-parallel all-reduces stay
inside one host (NVLink/ICI), then `expert`, then `data`, with `pipe` outermost so that the only
traffic crossing the slowest links is the stage-to-stage activation send. This module is the only
caller of `jax.devices()`.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils

from parallax.config import ConfigError, MeshConfig, resolve_mesh_shape

DATA, TENSOR, PIPE, EXPERT = "data", "tensor", "pipe", "expert"
AXES = (DATA, TENSOR, PIPE, EXPERT)
# Device-order nesting, outermost first: pipe, data, expert, tensor.
_DEVICE_ORDER = (PIPE, DATA, EXPERT, TENSOR)


def available_devices(n: int | None = None) -> list[jax.Device]:
    """All devices (or the first n), ordered by process then id so hosts stay contiguous."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if n is not None:
        if n > len(devices):
            raise ValueError(f"asked for {n} devices but only {len(devices)} exist")
        devices = devices[:n]
    return devices


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> jax.sharding.Mesh:
    """Build the 4-axis mesh with Auto axis types (GSPMD propagation from annotations).

    `devices` defaults to every device; the sizes must multiply to their count (one -1 absorbs
    the rest). Raises `ConfigError` naming the mesh field otherwise.
    """
    devices = available_devices() if devices is None else list(devices)
    sizes = resolve_mesh_shape(cfg, len(devices))
    ordered_shape = tuple(sizes[a] for a in _DEVICE_ORDER)
    n_slices = len({getattr(d, "slice_index", 0) for d in devices})
    if n_slices > 1:
        # TPU multislice: slices talk over the data-centre network (DCN), so only the outer axes
        # (pipe, then data) may span slices; inside each slice the mesh is topology-aware.
        dcn = dcn_shape(ordered_shape, n_slices)
        ici = tuple(s // d for s, d in zip(ordered_shape, dcn))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        try:
            # Topology-aware on TPU/GPU (keeps the innermost axes on physically close chips).
            grid = mesh_utils.create_device_mesh(ordered_shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            # CPU: devices are already sorted by process, so `tensor` groups stay inside a process.
            grid = np.asarray(devices, dtype=object).reshape(ordered_shape)
    # [pipe, data, expert, tensor] -> [data, tensor, pipe, expert]
    grid = grid.transpose([_DEVICE_ORDER.index(a) for a in AXES])
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def dcn_shape(ordered_shape: tuple[int, ...], n_slices: int) -> tuple[int, ...]:
    """How many slices each axis spans, in `_DEVICE_ORDER` ([pipe, data, expert, tensor]): the slice
    count is taken from `pipe` first, then `data`; never from `expert` or `tensor`, whose
    all-to-alls and per-block all-reduces would cross the slow network."""
    dcn, rest = [1] * len(ordered_shape), n_slices
    for i, axis in enumerate(_DEVICE_ORDER):
        if axis in (PIPE, DATA):
            dcn[i] = math.gcd(rest, ordered_shape[i])
            rest //= dcn[i]
    if rest != 1:
        raise ConfigError(f"mesh.pipe x mesh.data = {ordered_shape[0] * ordered_shape[1]} must be a multiple of "
                          f"the {n_slices} TPU slices: only pipe and data may cross slices")
    return tuple(dcn)


def describe(mesh: jax.sharding.Mesh) -> str:
    """One line: 'data=4 x tensor=2 x pipe=1 x expert=1 (8 cpu devices)'."""
    shape = " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    return f"{shape} ({mesh.devices.size} {mesh.devices.flat[0].platform} devices)"
