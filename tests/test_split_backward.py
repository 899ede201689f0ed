"""parallel/split_backward.py: a backward split by its outputs into B (input cotangent) and W
(weight gradients) equals the VJP, and W runs none of the input-gradient chain's matmuls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.parallel.split_backward import Split


def _unit(remat=False):
    """A norm-like scale, two matmuls with a tanh, a residual add; the first matmul under `jit`,
    the unit under `jax.checkpoint` when `remat`."""
    mm = jax.jit(lambda a, b: a @ b)

    def unit(h, wl):
        g = h * wl["g"]
        return jnp.tanh(mm(g, wl["a"])) @ wl["b"] + h

    if remat:
        unit = jax.checkpoint(unit, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return unit


def _case(unit, seed=0):
    """`unit` scanned over a stack of 3; the split of its VJP (weight gradients to W)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    w = {"a": jax.random.normal(k[0], (3, 4, 5)), "b": jax.random.normal(k[1], (3, 5, 4)),
         "g": jax.random.normal(k[2], (3, 4))}
    x = jax.random.normal(k[3], (2, 4))
    y, vjp = jax.vjp(lambda w, x: jax.lax.scan(lambda h, wl: (unit(h, wl), None), x, w)[0], w, x)
    leaves, tree = jax.tree.flatten(vjp)
    apply = lambda ls, ct: jax.tree.unflatten(tree, ls)(ct)  # noqa: E731
    args = (leaves, jax.random.normal(k[4], y.shape))
    split = Split.of(apply, args, lambda out: (jax.tree.map(lambda _: True, out[0]), False))
    return split, args, apply


@pytest.mark.parametrize("remat", [False, True], ids=["residuals", "dots_policy"])
def test_b_and_w_equal_the_vjp(remat):
    split, args, apply = _case(_unit(remat))
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
    split, args, _ = _case(_unit(remat))
    assert split.eqns("w").count("dot_general") == 2, split.eqns("w")
    assert split.eqns("b").count("dot_general") == 2, split.eqns("b")
    assert split.to_w == (True, True, False, False)  # a, b: W's; g: B's (cheap); x: B's
    # the stash, per unit: the unit's output cotangent and the tanh's input cotangent ([2, 4], [2, 5])
    _, stash = split.b(args)
    assert sorted(a.shape for a in stash) == [(3, 2, 4), (3, 2, 5)]


def test_a_widening_convert_is_stashed_narrow():
    """FP8's quantisation reads a bf16 operand in float32 (the amax B records, the E4M3 cast W's
    weight-gradient dot reads): B converts for its own output, and W converts again from the
    bf16 value it stashes, not from a float32 copy at twice the bytes (split_backward._widens)."""

    def fn(a, b, ct):
        x = (a @ b).astype(jnp.bfloat16)  # B's (a matmul): W cannot compute it again
        x32 = x.astype(jnp.float32)
        return jnp.max(jnp.abs(x32)), x32.T @ ct  # B's amax, W's weight gradient

    k = jax.random.split(jax.random.PRNGKey(1), 3)
    args = (jax.random.normal(k[0], (8, 4)), jax.random.normal(k[1], (4, 6)), jax.random.normal(k[2], (8, 3)))
    split = Split.of(fn, args, lambda out: (False, True))
    b, stash = jax.jit(split.b)(args)
    assert [(a.shape, a.dtype) for a in stash] == [((8, 6), jnp.bfloat16)]
    got = split.outputs(b, jax.jit(split.w)(args, stash))
    for g, r in zip(got, jax.jit(fn)(*args)):
        np.testing.assert_allclose(g, r, rtol=1e-6)


def test_a_recomputed_custom_vjp_primal_is_inlined():
    """A custom VJP inside a recomputed unit (the model's `transformer._reshard`, a layout change
    with its own backward) is run again by the backward as a `custom_vjp_call` of its primal: the
    split walks into it (split_backward._INLINED), so W recomputes the cheap primal from the
    unit's input, as it recomputes the plain scale. Treated as one opaque call it is heavy: B
    runs it (its own chain needs the output) and the stash holds its output for W as well."""

    @jax.custom_vjp
    def double(x):
        return 2.0 * x

    # the forward rule calls the function itself, as _reshard's does: the recomputed primal is then
    # a `custom_vjp_call` in the backward's jaxpr (a rule that computes 2x itself is inlined by JAX)
    double.defvjp(lambda x: (double(x), None), lambda _, ct: (2.0 * ct,))
    mm = jax.jit(lambda a, b: a @ b)

    def unit(h, wl):
        return jnp.tanh(mm(double(h * wl["g"]), wl["a"])) @ wl["b"] + h

    # nothing saved: B runs the unit again, `double` included
    split, args, apply = _case(jax.checkpoint(unit), seed=2)
    assert "custom_vjp_call" not in split.eqns("b") + split.eqns("w")
    b, stash = jax.jit(split.b)(args)
    # per unit: the output's cotangent, the tanh input's cotangent and the tanh (a matmul's, B's
    # to compute), not `double`'s output (another [2, 4] when the call is opaque)
    assert sorted(a.shape for a in stash) == [(3, 2, 4), (3, 2, 5), (3, 2, 5)]
    got = split.outputs(b, jax.jit(split.w)(args, stash))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(apply(*args))):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_split_op_costs_are_the_cost_models():
    """A pipeline stage chunk's F, split B and W, compiled (XLA:CPU cost_analysis, one device):
    B and W from F's residuals together are 1F1B's B, and their ratio to F is
    schedules.kept_costs' for the model's attention share (B = 1 + a, W = 1 - a, within 5%)."""
    from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
    from parallax.model.transformer import attention_share
    from parallax.parallel.pipeline import stage_fn
    from parallax.schedules import kept_costs
    from parallax.train.build import build

    cfg = Config(mesh=MeshConfig(data=1, pipe=2),
                 model=ModelConfig(d_model=64, n_layers=4, n_heads=2, n_kv_heads=2, d_ff=128, vocab_size=64),
                 parallel=ParallelConfig(microbatches=2, schedule="zb_h1"),
                 train=TrainConfig(global_batch=2, seq_len=64))
    built = build(cfg, jax.devices()[:2])
    stage = stage_fn(built.layout.model)
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), built.abstract_state().params["layers"])
    x = jax.ShapeDtypeStruct((1, 64, 64), jnp.float32)
    fwd = lambda w, h: stage(w, h)[0]  # noqa: E731
    leaves, tree = jax.tree.flatten(jax.eval_shape(lambda w, h: jax.vjp(fwd, w, h)[1], chunk, x))
    apply = lambda res, ct: jax.tree.unflatten(tree, res)(ct)  # noqa: E731
    split_of = lambda res, ct: Split.of(apply, (res, ct), lambda out: (jax.tree.map(lambda _: True, out[0]), False))  # noqa: E731

    def flops(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    stash = jax.eval_shape(lambda res, ct: split_of(res, ct).b((res, ct))[1], leaves, x)
    f = flops(lambda w, h: jax.vjp(fwd, w, h), chunk, x)
    b = flops(lambda res, ct: split_of(res, ct).b((res, ct)), leaves, x)
    w = flops(lambda res, ct, st: split_of(res, ct).w((res, ct), st), leaves, x, stash)
    whole = flops(apply, leaves, x)
    assert b + w == pytest.approx(whole, rel=0.01), (b, w, whole)
    share = attention_share(cfg.model, cfg.train.seq_len)
    want = kept_costs("zb_h1", share)
    assert b / f == pytest.approx(want["B"], rel=0.05), (b / f, want, share)
    assert w / f == pytest.approx(want["W"], rel=0.05), (w / f, want, share)


def test_every_collective_is_heavy():
    """W never computes a collective again (it reads B's result): the split's list of collective
    primitives names every one jax's parallel module defines but the device index and the type
    casts (a guard for a JAX upgrade that adds one)."""
    from jax._src import core
    from jax._src.lax import parallel

    from parallax.parallel.split_backward import _CASTS, _COLLECTIVES

    defined = {v.name for v in vars(parallel).values() if isinstance(v, core.Primitive)} - {"axis_index"} - _CASTS
    assert defined <= _COLLECTIVES, defined - _COLLECTIVES
