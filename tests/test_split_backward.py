"""parallel/split_backward.py: a backward split by its outputs into B (input cotangent) and W
(weight gradients) equals the VJP, and W runs none of the input-gradient chain's matmuls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.parallel.split_backward import Split


def _stack(w, x, remat=False):
    """A scanned stack of units: a norm-like scale, two matmuls with a tanh, a residual add;
    each unit's matmul under `jit`, the unit under `jax.checkpoint` when `remat`."""
    mm = jax.jit(lambda a, b: a @ b)

    def unit(h, wl):
        g = h * wl["g"]
        return jnp.tanh(mm(g, wl["a"])) @ wl["b"] + h

    if remat:
        unit = jax.checkpoint(unit, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return jax.lax.scan(lambda h, wl: (unit(h, wl), None), x, w)[0]


def _case(remat):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    w = {"a": jax.random.normal(k[0], (3, 4, 5)), "b": jax.random.normal(k[1], (3, 5, 4)),
         "g": jax.random.normal(k[2], (3, 4))}
    x = jax.random.normal(k[3], (2, 4))
    y, vjp = jax.vjp(lambda w, x: _stack(w, x, remat), w, x)
    leaves, tree = jax.tree.flatten(vjp)
    apply = lambda ls, ct: jax.tree.unflatten(tree, ls)(ct)  # noqa: E731
    args = (leaves, jax.random.normal(k[4], y.shape))
    split = Split.of(apply, args, lambda out: (jax.tree.map(lambda _: True, out[0]), False))
    return split, args, apply


@pytest.mark.parametrize("remat", [False, True], ids=["residuals", "dots_policy"])
def test_b_and_w_equal_the_vjp(remat):
    split, args, apply = _case(remat)
    b, stash = jax.jit(split.b)(args)
    w = jax.jit(split.w)(args, stash)
    got, want = split.outputs(b, w), apply(*args)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True], ids=["residuals", "dots_policy"])
def test_w_runs_only_the_weight_matmuls(remat):
    """Per unit the VJP has 4 matmuls: 2 for the input cotangent (B's chain) and 2 weight
    gradients (W's). W holds the 2 and no more, B the chain's 2 (plus, under the policy, none:
    the dots are saved); the scale's gradient (a product and a sum) is B's, not stashed."""
    split, args, _ = _case(remat)
    assert split.eqns("w").count("dot_general") == 2, split.eqns("w")
    assert split.eqns("b").count("dot_general") == 2, split.eqns("b")
    assert split.to_w == (True, True, False, False)  # a, b: W's; g: B's (cheap); x: B's
    # the stash, per unit: the unit's output cotangent and the tanh's input cotangent ([2, 4], [2, 5])
    _, stash = split.b(args)
    assert sorted(a.shape for a in stash) == [(3, 2, 4), (3, 2, 5)]
