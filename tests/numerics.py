"""One tolerance rule for comparing gradients (and other trees) across layouts, per layer.

A stacked leaf (under a `layers` key: axis 0 is the layer axis, layer-major) is compared one
layer at a time, each slice against its own largest magnitude: scaled by the whole stack's
maximum, an error in a layer whose gradients are much smaller than the largest layer's would
pass. Every other leaf is compared as a whole. The bound is |got - ref| <= atol + rtol * max|ref|
(per slice); the tolerances themselves are written down in BUILD_NOTES.md.

Also here, as the other measurement of trees the tests share: `bytes_per_device`.
"""

from __future__ import annotations

import jax
import numpy as np


def _slices(path: tuple, ref: np.ndarray) -> list[tuple[str, slice | int]]:
    stacked = any(getattr(k, "key", None) == "layers" for k in path) and ref.ndim >= 1
    return [(f"[layer {i}]", i) for i in range(ref.shape[0])] if stacked else [("", slice(None))]


def tree_errors(got, ref, rtol: float, atol: float, only=None) -> list[tuple[str, float, float]]:
    """(name, error, bound) of every slice that breaks the bound; structures must match.
    `only(name)`: compare just the leaves whose path name it accepts."""
    assert jax.tree.structure(got) == jax.tree.structure(ref), (jax.tree.structure(got), jax.tree.structure(ref))
    bad = []
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        if only is not None and not only(jax.tree_util.keystr(path)):
            continue
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape, (jax.tree_util.keystr(path), g.shape, r.shape)
        for label, idx in _slices(path, r):
            err = float(np.abs(g[idx] - r[idx]).max(initial=0.0))
            bound = atol + rtol * float(np.abs(r[idx]).max(initial=0.0))
            if not err <= bound:  # NaN fails too
                bad.append((jax.tree_util.keystr(path) + label, err, bound))
    return bad


def assert_trees_close(got, ref, rtol: float, atol: float) -> None:
    bad = tree_errors(got, ref, rtol, atol)
    assert not bad, "\n".join(f"{name}: error {err:.3g} > bound {bound:.3g}" for name, err, bound in bad)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays (measured on the first device's shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        device = leaf.sharding.device_set and min(leaf.sharding.device_set, key=lambda d: d.id)
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total
