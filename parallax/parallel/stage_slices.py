"""Slices of a pipeline stage's stacks and of the tick loop's slot buffers (pipeline_1f1b.py),
and the master weights its VJPs differentiate.

A stage holds its weights, FP8 state and gradient accumulators as [v, Lc, ...] stacks (v chunks of
Lc units); the tick loop keeps activations, cotangents, residuals and ZB-H1's stash in [slots, ...]
buffers. These read and update one chunk, one unit or one slot in place, with dynamic indices (the
table's, traced), and pick the weight-gradient leaves one side of ZB-H1's split backward computes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from parallax.model.layers import CastWeight, QuantizedWeight


def _is_weight(a: Any) -> bool:
    return isinstance(a, (QuantizedWeight, CastWeight))


def masters(tree: Any) -> Any:
    """The master weights of a stage's parameters (a QuantizedWeight's or CastWeight's `master`):
    what the VJPs differentiate."""
    return jax.tree.map(lambda a: a.master if _is_weight(a) else a, tree, is_leaf=_is_weight)


def with_masters(tree: Any, new: Any) -> Any:
    """`tree` with its master weights replaced by `new` (masters' structure)."""
    return jax.tree.map(lambda a, w: a._replace(master=w) if _is_weight(a) else w, tree, new, is_leaf=_is_weight)


def zero_masters(tree: Any) -> Any:
    """float32 zeros like every leaf of `tree`."""
    return jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), tree)


def at(tree: Any, c: jax.Array, v: int) -> Any:
    """Chunk c of a stage's [v, ...] leaves (v = 1: the only one, no dynamic slice)."""
    return jax.tree.map(lambda a: a[0] if v == 1 else jax.lax.dynamic_index_in_dim(a, c, keepdims=False), tree)


def add_at(tree: Any, c: jax.Array, update: Any, v: int, op: Callable = jnp.add) -> Any:
    """tree[c] = op(tree[c], update) over [v, ...] leaves."""
    def one(a: jax.Array, u: jax.Array) -> jax.Array:
        if v == 1:
            return op(a, u[None].astype(a.dtype))
        cur = jax.lax.dynamic_index_in_dim(a, c, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(a, op(cur, u[None].astype(a.dtype)), c, 0)

    return jax.tree.map(one, tree, update)


def at_unit(tree: Any, c: jax.Array, l: jax.Array, v: int) -> Any:
    """Unit l of chunk c of a stage's [v, Lc, ...] leaves, sliced alone: with v > 1 a dynamic
    chunk's whole slice is a copy of the chunk's weights (ZeRO-1: its float32 masters, 14.7 GiB
    per device for the interleaved dense-1T row; BUILD_NOTES.md)."""
    def one(a: jax.Array) -> jax.Array:
        if v == 1:
            return jax.lax.dynamic_index_in_dim(a[0], l, keepdims=False)
        return jax.lax.dynamic_slice(a, (c, l, *([0] * (a.ndim - 2))), (1, 1, *a.shape[2:]))[0, 0]

    return jax.tree.map(one, tree)


def update_at(tree: Any, c: jax.Array, l: jax.Array, update: Any, op: Callable = jnp.add) -> Any:
    """tree[c, l] = op(tree[c, l], update) over [v, Lc, ...] leaves, in place (a dynamic slice)."""
    def one(a: jax.Array, u: jax.Array) -> jax.Array:
        start = (c, l, *([0] * (a.ndim - 2)))
        cur = jax.lax.dynamic_slice(a, start, (1, 1, *a.shape[2:]))
        return jax.lax.dynamic_update_slice(a, op(cur, u[None, None].astype(a.dtype)), start)

    return jax.tree.map(one, tree, update)


def pick(tree: Any, mask: tuple[bool, ...], which: bool) -> list:
    """The leaves of `tree` where `mask` is `which`."""
    return [a for a, m in zip(jax.tree.leaves(tree), mask) if m == which]


def add_leaves(tree: Any, c: jax.Array, picked: list, mask: tuple[bool, ...], which: bool, v: int) -> Any:
    """add_at on the leaves `pick(tree, mask, which)` picked (the others untouched)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, m in enumerate(mask) if m == which]
    added = jax.tree.leaves(add_at([leaves[i] for i in where], c, picked, v))
    for i, a in zip(where, added):
        leaves[i] = a
    return jax.tree.unflatten(treedef, leaves)


def put(buf: jax.Array, x: jax.Array, slot: jax.Array) -> jax.Array:
    """buf[slot] = x, in place."""
    return jax.lax.dynamic_update_index_in_dim(buf, x, slot, 0)


def get(buf: jax.Array, slot: jax.Array) -> jax.Array:
    """buf[slot]."""
    return jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)
