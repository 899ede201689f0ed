"""parallel/residuals.py: which of a VJP's residuals a microbatch made (kept by the table
schedules from F to B) and which B has without them (the weights, what the weights alone give,
the arguments passed through). Pure tracing, no mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.parallel.residuals import plan

L, D, B = 3, 8, 4


def _unit(w, x):
    # the weight's bfloat16 copy is computed from the weight alone: B computes it again
    h = jnp.tanh(x @ w["a"].astype(jnp.bfloat16).astype(jnp.float32))
    return h @ w["b"] + x


def _stage(w, x, remat):
    unit = jax.checkpoint(_unit) if remat else _unit
    return jax.lax.scan(lambda h, wl: (unit(wl, h), None), x, w)[0]


def _leaves(remat):
    return lambda w, x: jax.tree.leaves(jax.vjp(lambda w, x: _stage(w, x, remat), w, x)[1])


W = {"a": jnp.full((L, D, D), 0.1), "b": jnp.full((L, D, D), 0.2)}
X = jnp.ones((B, D))


def _shapes(remat):
    return [tuple(a.shape) for a in jax.eval_shape(_leaves(remat), W, X)]


def test_without_remat_the_activations_are_kept_and_the_weights_are_not():
    res = plan(_leaves(False), (W, X), per_microbatch=(1,))
    shapes = _shapes(False)
    kept = [shapes[i] for i in res.kept]
    # every kept residual is a per-layer activation [L, B, ...]; the stacked weights, passed
    # through or cast per layer ([L, D, D] whatever the dtype), are not
    assert kept and all(s[:2] == (L, B) for s in kept), kept
    assert all(s[:2] != (L, B) for i, s in enumerate(shapes) if i not in res.kept), shapes
    assert any(s == (L, D, D) for i, s in enumerate(shapes) if i not in res.kept)  # the bf16 casts
    assert res.bytes == sum(int(np.prod(s)) * 4 for s in kept)


def test_under_remat_full_only_the_unit_inputs_are_kept():
    res = plan(_leaves(True), (W, X), per_microbatch=(1,))
    shapes = _shapes(True)
    assert [shapes[i] for i in res.kept] == [(L, B, D)]  # each unit's input; the weights pass through


def test_nothing_is_kept_that_no_microbatch_argument_reaches():
    res = plan(_leaves(False), (W, X), per_microbatch=())
    assert res.kept == () and res.bytes == 0


def test_b_from_the_kept_residuals_equals_the_vjp():
    """B's recipe (pipeline_1f1b `backward`): trace the VJP again on a stand-in, put the kept
    leaves back, apply; the result is F's VJP's."""
    f = lambda w, x: _stage(w, x, False)  # noqa: E731
    res = plan(_leaves(False), (W, X), per_microbatch=(1,))
    y, vjp = jax.vjp(f, W, X)
    made = [jax.tree.leaves(vjp)[i] for i in res.kept]
    _, again = jax.vjp(f, W, jnp.zeros_like(X))  # B's own trace: its kept leaves are replaced
    leaves, tree = jax.tree.flatten(again)
    for i, a in zip(res.kept, made):
        leaves[i] = a
    ct = jnp.ones_like(y)
    got, want = jax.tree.unflatten(tree, leaves)(ct), vjp(ct)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_a_vjp_traced_unlike_its_plan_is_refused():
    res = plan(_leaves(False), (W, X), per_microbatch=(1,))
    other = jax.tree.leaves(jax.vjp(lambda w, x: _stage(w, x, True), W, X)[1])  # remat: other residuals
    with pytest.raises(AssertionError, match="unlike its plan"):
        res.made(other)
    assert len(res.made(jax.tree.leaves(jax.vjp(lambda w, x: _stage(w, x, False), W, X)[1]))) == len(res.kept)
