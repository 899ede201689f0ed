"""parallel/residuals.py: which of a VJP's residuals a microbatch made (kept by the table
schedules from F to B) and which B has without them (the weights, what the weights alone give,
the arguments passed through). Pure tracing, no mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

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
    # an idle tick's stand-ins are the kept leaves' shapes and dtypes
    assert [(z.shape, z.dtype) for z in res.zeros()] == [res.leaves[i] for i in res.kept]


def test_under_remat_full_only_the_unit_inputs_are_kept():
    res = plan(_leaves(True), (W, X), per_microbatch=(1,))
    shapes = _shapes(True)
    assert [shapes[i] for i in res.kept] == [(L, B, D)]  # each unit's input; the weights pass through


def test_nothing_is_kept_that_no_microbatch_argument_reaches():
    res = plan(_leaves(False), (W, X), per_microbatch=())
    assert res.kept == () and res.zeros() == []


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


def test_a_residual_the_input_made_but_not_typed_varying_is_counted_not_kept():
    """Inside the pipeline's shard_map a kept leaf must vary over `pipe` (the tick loop's buffers
    do). One made from the input but invariant over it (here through a psum; in the stages, a
    fused kernel's, fused_attention.py) is counted in `untyped` and not kept: the pipeline then
    recomputes the chunk in B (pipeline_1f1b)."""
    mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[:2])
    found = []

    def body(x):
        def f(x):
            return jnp.sin(x) * jnp.cos(jax.lax.psum(x, "pipe"))
        found.append(plan(lambda x: jax.tree.leaves(jax.vjp(f, x)[1]), (x,), per_microbatch=(0,), varying="pipe"))
        return x

    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe")))(
        jax.device_put(jnp.ones((2, D)), NamedSharding(mesh, P("pipe"))))
    (res,) = found
    assert res.untyped > 0 and res.kept, res
    assert all("pipe" in a for a in res.axes), res.axes


@pytest.mark.parametrize("remat, attend, costs", [
    ("none", None, "kept"), ("dots", None, "kept"), ("full", None, "compiled"),
    ("none", "splash", "compiled"), ("dots", "splash", "kept")])
def test_the_step_record_bubble_uses_the_costs_of_the_backward_that_runs(remat, attend, costs):
    """train/loop.StepRecord's `bubble_fraction_compiled_costs`: ZB-H1's table in lockstep under
    kept_costs for the model's attention share (the split's B = 1 + a, W = 1 - a) where B and W
    start from F's residuals (residuals.keeps, the rule the pipeline reads), else under
    COMPILED_COSTS; the two differ at p 4, m 8 (a fused kernel under remat none recomputes)."""
    from types import SimpleNamespace

    from parallax.config import Config, MeshConfig, ParallelConfig
    from parallax.model.transformer import attention_share
    from parallax.parallel.fused_attention import FusedAttention
    from parallax.schedules import COMPILED_COSTS, KEPT_COSTS, Schedule, kept_costs
    from parallax.train.loop import StepRecord

    sched = Schedule(4, 8, 1, "zb_h1")
    cfg = Config(mesh=MeshConfig(pipe=4), parallel=ParallelConfig(microbatches=8, schedule="zb_h1", remat=remat))
    model = SimpleNamespace(remat=remat, attend=FusedAttention(attend) if attend else None)
    built = SimpleNamespace(device_kind="cpu", n_devices=4, schedule=sched, layout=SimpleNamespace(model=model),
                            batch_shards=1)
    record = StepRecord(cfg, built)(1, {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0}, 1.0, 0)
    share = attention_share(cfg.model, cfg.train.seq_len, attend or "xla")
    assert 0 < share < 0.5, share
    want = {"kept": sched.bubble_fraction_at(kept_costs("zb_h1", share)),
            "compiled": sched.bubble_fraction_at(COMPILED_COSTS["zb_h1"])}
    assert abs(want["kept"] - want["compiled"]) > 1e-3, want
    # ... and not the paper's F = B = W: the attention share lengthens every tick that holds a B
    assert want["kept"] > sched.bubble_fraction_at(KEPT_COSTS["zb_h1"]) + 1e-3, want
    assert record["bubble_fraction_compiled_costs"] == pytest.approx(want[costs])
    assert record["pipeline_ticks"] == sched.ticks and record["bubble_fraction"] == sched.bubble_fraction
