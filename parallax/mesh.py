"""The one device mesh: axes ('data', 'tensor', 'pipe', 'expert').

Device order puts `tensor` innermost so that the latency-critical tensor-parallel all-reduces stay
inside one host (NVLink/ICI), then `expert`, then `data`, with `pipe` outermost so that the only
traffic crossing the slowest links is the stage-to-stage activation send. This module is the only
caller of `jax.devices()`.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils

from parallax.config import MeshConfig, resolve_mesh_shape

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
    try:
        # Topology-aware on TPU/GPU (keeps the innermost axes on physically close chips).
        grid = mesh_utils.create_device_mesh(ordered_shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(ordered_shape)
    # [pipe, data, expert, tensor] -> [data, tensor, pipe, expert]
    grid = grid.transpose([_DEVICE_ORDER.index(a) for a in AXES])
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def describe(mesh: jax.sharding.Mesh) -> str:
    """One line: 'data=4 x tensor=2 x pipe=1 x expert=1 (8 cpu devices)'."""
    shape = " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    return f"{shape} ({mesh.devices.size} {mesh.devices.flat[0].platform} devices)"
