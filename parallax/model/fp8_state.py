"""The FP8 state between train steps: what a step's dots read (step_state), how their new values
become the next stored state (overwrite), the telemetry a step asks for and reports
(request_telemetry, fp8_metrics), and a pipeline's padding slots (padding_value). The dots, the
state's layout and the recipes: fp8.py."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from parallax.config import Fp8Config
from parallax.model.fp8 import (NO_TELEMETRY, QDTYPES, STEP, STORED, TENSORS, compute_scale, fp8_max, push_history,
                                split_step)


def padding_value(name: str) -> float | tuple[float, ...]:
    """The value of state leaf `name` in a slot that holds no real dot (pipeline.to_stages pads an
    uneven stack with such slots): scale 1 (a zero would divide by zero), amaxes and stats 0; a
    step_state leaf, per entry of its last axis."""
    if name.endswith(f"_{STEP}"):
        return (1.0, 0.0, 0.0, 0.0)
    return 1.0 if name.endswith("_scale") else 0.0


def overwrite(old: Any, new: Any) -> Any:
    """The next FP8 state: the step's 'gradient' of the state is its new value (float32); where
    `new` is step_state's form, its amaxes (the max over every use) enter the old histories here.

    A tensor whose new scale is not positive was not used this step (autodiff gives zero, or fm32's
    zero, -inf, for an unused input; a used one always has a scale > 0): it keeps its old state.
    """
    if not old:
        return old
    flat_old, flat_new = traverse_util.flatten_dict(old), traverse_util.flatten_dict(new)
    out = {}
    for path, o in flat_old.items():
        prefix = _prefix(path[-1])
        packed = flat_new.get((*path[:-1], f"{prefix}_{STEP}"))
        if packed is None:
            scale, value = flat_new[(*path[:-1], f"{prefix}_scale")], flat_new[path]
        else:  # step_state's [scale, amax, saturated, flushed]: the amax enters the history here
            scale, amax, stats = split_step(packed)
            value = {"scale": scale, "amax_history": push_history(o, amax.astype(o.dtype)),
                     "stats": stats}[path[-1][len(prefix) + 1:]]
        out[path] = jnp.where(scale > 0, value.astype(o.dtype), o)  # [..., 1] broadcasts
    return traverse_util.unflatten_dict(out)


def _prefix(name: str) -> str:
    return next(p for p in TENSORS if name.startswith(p + "_"))


def step_state(fp8: Any, cfg: Fp8Config) -> Any:
    """The stored state as one train step's dots read it: per tensor one `{t}_step` [..., 4] of
    [scale (`delayed`: the scale this step uses, from the history, computed here once per step;
    `current`: the previous scale, the fallback for a zero amax), amax (a slot: its "gradient" is
    the max of the uses' amaxes), the two stats (as request_telemetry set them)].
    `overwrite(stored, new)` pushes the new amaxes into the stored histories.

    Why: with the history in the differentiated state every use of a tensor (each layer, tick and
    remat recomputation) took the max of its history of 1,024 and rolled it into a new one, and
    the backward loops stacked three leaves per tensor; measured on CPU (issue 22's layout,
    BUILD_NOTES.md "The FP8 step's state read once per step"): 5,505 -> 4,482 kernels per step,
    the FP8 / plain step ratio 1.442 -> 1.374 side by side in one run (the CPU timings move by
    about as much between runs). Exactly the same numbers (tests/test_fp8.py): the scale and the
    pushed history are the formulas quantize applies at each use, applied once."""
    if not fp8:
        return fp8
    flat, out = traverse_util.flatten_dict(fp8), {}
    for path in flat:
        prefix = _prefix(path[-1])
        if path[-1] != f"{prefix}_scale":
            continue
        scale, history, stats = (flat[(*path[:-1], f"{prefix}_{k}")] for k in STORED)
        if cfg.recipe == "delayed":
            scale = compute_scale(jnp.max(history, axis=-1, keepdims=True), scale, fp8_max(QDTYPES[prefix]),
                                  cfg.margin).astype(scale.dtype)
        out[(*path[:-1], f"{prefix}_{STEP}")] = jnp.concatenate([scale, jnp.zeros_like(scale), stats], axis=-1)
    return traverse_util.unflatten_dict(out)


def request_telemetry(fp8: Any, wanted: jax.Array) -> Any:
    """The state with every `{t}_stats` set to ask for this step's saturation and flush fractions
    (`wanted`, a traced bool: 0) or not (NO_TELEMETRY); quantize reads it."""
    if not fp8:
        return fp8
    flat = traverse_util.flatten_dict(fp8)
    ask = jnp.where(wanted, 0.0, NO_TELEMETRY)
    return traverse_util.unflatten_dict({path: jnp.broadcast_to(ask, v.shape).astype(v.dtype)
                                         if path[-1].endswith("_stats") else v for path, v in flat.items()})


def fp8_metrics(fp8: Any) -> dict[str, jax.Array]:
    """Per tensor kind (inputs, weights, gradients), over every FP8 dot and layer: the largest
    fraction saturated and flushed to zero of any one tensor this step (NaN on a step that did not
    compute them: request_telemetry), and the scales' range (read from the state: every step)."""
    if not fp8:
        return {}
    groups: dict[tuple[str, str], list[jax.Array]] = {}
    for path, leaf in traverse_util.flatten_dict(fp8).items():
        prefix = _prefix(path[-1])
        groups.setdefault((TENSORS[prefix], path[-1][len(prefix) + 1:]), []).append(leaf)
    out = {}
    for kind in TENSORS.values():
        scales, stats = (_joined(groups[(kind, name)], width) for name, width in (("scale", 1), ("stats", 2)))
        for i, name in enumerate(("saturated", "flushed")):
            worst = jnp.max(jnp.stack([jnp.max(x[..., i]) for x in stats]))
            out[f"fp8_{kind}_{name}"] = jnp.where(worst < 0, jnp.nan, worst)
        out[f"fp8_{kind}_scale_min"] = jnp.min(jnp.stack([jnp.min(x) for x in scales]))
        out[f"fp8_{kind}_scale_max"] = jnp.max(jnp.stack([jnp.max(x) for x in scales]))
    return out


def _joined(leaves: list[jax.Array], width: int) -> list[jax.Array]:
    """Leaves of one kind as at most two arrays: the scanned stack's [L, ..., width] joined along a
    non-layer axis ([L, n, width]: a stack stored over `pipe`, pipeline.stack_state_spec, stays
    where it is; joining along L gathered every leaf, 48 all-gathers and 15 all-to-alls per step
    on the pipelined tiny model), the rest flattened to [n, width]."""
    stacked = [x.reshape(x.shape[0], -1, width) for x in leaves if x.ndim > 1]
    single = [x.reshape(-1, width) for x in leaves if x.ndim <= 1]
    return ([jnp.concatenate(stacked, axis=1)] if stacked else []) + ([jnp.concatenate(single)] if single else [])
