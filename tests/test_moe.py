"""Mixture-of-Experts: the router's invariants, exact drops, the layer against a dense reference,
expert parallelism against one device, and the all-to-alls in the compiled step.

Tolerances (BUILD_NOTES.md): fp32 throughout; layer vs dense reference rtol 1e-5; layouts vs one
device as tests/test_equivalence.py (loss rtol 1e-6, gradients rtol 1e-4 of each leaf's max).
"""

import dataclasses
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.analysis.audit import FAST_COMPILE, compile_step

from parallax.analysis.hlo import collectives
from parallax.config import (Config, MeshConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig,
                             apply_overrides, moe_capacity)
from parallax.parallel.mesh import available_devices, make_mesh
from parallax.model.transformer import Transformer, active_params, count_params, flops_per_token
from parallax.model.moe import MoE, assign_slots, load_balancing_loss, route, router_z_loss
from parallax.parallel.pipeline import to_layer_major
from parallax.parallel.sharding import logical_context
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_grad_fn, make_value_and_grad
from numerics import assert_trees_close

LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-4, 1e-6
LAYER_RTOL = 1e-5


# ----------------------------------------------------------------------------------------------
# Router invariants (property tests over random shapes and seeds)


@pytest.mark.parametrize("seed", range(5))
def test_router_invariants(seed):
    rng = np.random.default_rng(seed)
    g, s, e = rng.integers(1, 4), rng.integers(1, 17), rng.integers(2, 9)
    k = int(rng.integers(1, e + 1))
    logits = jnp.asarray(rng.normal(0, 3, (g, s, e)), jnp.float32)
    r = route(logits, k, renormalize=True)
    np.testing.assert_allclose(np.sum(r.gates, -1), 1.0, rtol=1e-6)  # gates sum to 1 over the k chosen
    experts = np.asarray(r.experts)
    assert all(len(set(row)) == k for row in experts.reshape(-1, k))  # k distinct experts per token
    np.testing.assert_array_equal(experts, np.asarray(jax.lax.top_k(r.probs, k)[1]))  # the top-k, in order
    raw = route(logits, k, renormalize=False)
    np.testing.assert_allclose(raw.gates, np.take_along_axis(np.asarray(raw.probs), experts, -1), rtol=1e-6)
    # z-loss = mean over tokens of logsumexp(logits)^2
    lse = np.log(np.sum(np.exp(np.asarray(logits, np.float64)), -1))
    np.testing.assert_allclose(router_z_loss(logits), np.mean(lse**2), rtol=1e-5)
    # Switch normalisation: uniform probabilities give exactly 1 whatever the assignment...
    uniform = r._replace(probs=jnp.full((g, s, e), 1.0 / e))
    np.testing.assert_allclose(load_balancing_loss(uniform), 1.0, rtol=1e-6)
    # ...and so does a perfectly balanced assignment whatever the probabilities.
    balanced = r._replace(experts=jnp.asarray(np.arange(g * s * e).reshape(g, s * e, 1) % e, jnp.int32),
                          probs=r.probs.repeat(e, axis=1))
    np.testing.assert_allclose(load_balancing_loss(balanced), 1.0, rtol=1e-5)
    # Collapse onto one expert with certainty costs E.
    collapsed = r._replace(experts=jnp.zeros((g, s, 1), jnp.int32), probs=jax.nn.one_hot(jnp.zeros((g, s), int), e))
    np.testing.assert_allclose(load_balancing_loss(collapsed), float(e), rtol=1e-6)


def test_capacity():
    assert moe_capacity(32, 8, 2, 1.25) == 10  # ceil(1.25 * 32 * 2 / 8)
    assert moe_capacity(32, 8, 2, 0.0) == 32 == moe_capacity(32, 8, 2, -1.0)  # dropless: one sequence's worth
    assert moe_capacity(4, 2, 1, 100.0) == 4  # never more than a sequence can send one expert
    assert moe_capacity(7, 64, 6, 1.0) == 1  # ceil(7 * 6 / 64)
    assert moe_capacity(64, 4, 1, 2.0) == 32


def test_drops_follow_router_probability_and_pass_through_the_residual():
    """Hand-computed: 4 tokens, 2 experts, top-1, capacity factor 0.5 -> 1 slot per expert.
    Tokens 0, 1, 2 choose expert 0 with probabilities 0.9, 0.6, 0.8; token 3 chooses expert 1.
    Expert 0 keeps token 0 (the most confident) and drops 1 and 2: dropped fraction 2/4."""
    p0 = np.array([0.9, 0.6, 0.8, 0.3])
    logits = jnp.asarray(np.log(np.stack([p0, 1 - p0], -1))[None], jnp.float32)  # [1, 4, 2]
    r = route(logits, 1, renormalize=True)
    cap = moe_capacity(4, 2, 1, 0.5)
    assert cap == 1
    slot, keep = assign_slots(r, 2, cap)
    np.testing.assert_array_equal(np.asarray(keep)[0, :, 0], [True, False, False, True])
    np.testing.assert_array_equal(np.asarray(slot)[0, :, 0], [0, 2, 1, 0])  # queue order by probability

    # Through the layer: dropped tokens get exactly zero from the MoE (the block adds the
    # residual). Token i is the unit vector e_i and the router's rows are the logits above.
    layer = MoE(MoEConfig(num_experts=2, top_k=1, capacity_factor=0.5), d_ff=8)
    x = jnp.eye(4, 6, dtype=jnp.float32)[None]  # [1, 4, 6]
    params = dict(nn.unbox(layer.init(jax.random.key(0), x)["params"]))
    params["router"] = jnp.zeros((6, 2), jnp.float32).at[:4].set(logits[0])
    y, stats = layer.apply({"params": params}, x)
    y = np.asarray(y)[0]
    assert np.all(y[1] == 0) and np.all(y[2] == 0)
    assert np.abs(y[0]).max() > 0 and np.abs(y[3]).max() > 0
    assert float(stats["dropped_fraction"]) == 0.5
    np.testing.assert_array_equal(stats["load"], [3, 1])  # assignments before drops


# ----------------------------------------------------------------------------------------------
# The layer against a dense reference: every token through its top-k experts with plain einsums


def _dense_reference(x, router, wi, wo, k):
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, router), -1)
    gates, experts = jax.lax.top_k(probs, k)
    gates = gates / gates.sum(-1, keepdims=True)
    gate_up = jnp.einsum("btd,edhf->btehf", x, wi)
    out = jnp.einsum("btef,efd->bted", jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :], wo)  # all experts
    picked = jnp.take_along_axis(out, experts[..., None], axis=2)  # [B, T, k, D]
    return jnp.sum(picked * gates[..., None], axis=2)


@pytest.mark.parametrize("k", [1, 2])
def test_layer_equals_dense_reference(k):
    cfg = MoEConfig(num_experts=4, top_k=k, capacity_factor=0.0)  # dropless
    layer = MoE(cfg, d_ff=16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 12)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(1), x)["params"])
    params = {**params, "router": params["router"] * 50}  # confident, well-separated routing

    @jax.jit
    def ours(x, p):
        return layer.apply({"params": p}, x)[0]

    @jax.jit
    def ref(x, p):
        return _dense_reference(x, p["router"], p["wi"], p["wo"], k)

    np.testing.assert_allclose(ours(x, params), ref(x, params), rtol=LAYER_RTOL, atol=1e-6)
    g_ours = jax.grad(lambda x, p: jnp.sum(jnp.sin(ours(x, p))), argnums=(0, 1))(x, params)
    g_ref = jax.grad(lambda x, p: jnp.sum(jnp.sin(ref(x, p))), argnums=(0, 1))(x, params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=LAYER_RTOL, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------------------------
# Expert parallelism: every layout equals one device, loss and gradients (router losses included)

BASE = Config(
    model=ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=256,
                      moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=0.0, shared_experts=1)),
    optim=OptimConfig(warmup_steps=1),
    train=TrainConfig(global_batch=8, seq_len=16, lr=1e-3, seed=5),
)
LAYOUTS = {
    "data4_expert2": MeshConfig(data=4, expert=2),
    "expert8": MeshConfig(data=1, expert=8),
    "data2_tensor2_expert2": MeshConfig(data=2, tensor=2, expert=2),
    "tensor2_expert4": MeshConfig(data=1, tensor=2, expert=4),
}
DROPPING = dataclasses.replace(BASE.model, moe=dataclasses.replace(BASE.model.moe, capacity_factor=1.0, every=2))


def _grads(cfg: Config, devices=None, with_stats: bool = False):
    """(loss, gradients layer-major[, per-layer MoE stats]) at the initial parameters."""
    mesh = make_mesh(cfg.mesh, devices)
    layout = make_layout(cfg, mesh)
    state = init_state(cfg, layout)
    rows = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))
    loss, grads = make_grad_fn(layout)(state.params, batch)
    if layout.schedule is not None:
        grads = {**grads, "layers": to_layer_major(grads["layers"])}
    out = (float(loss), jax.tree.map(np.asarray, grads))
    if with_stats:  # the statistics the train step reports (1F1B: its own, from the forward ticks)
        stats_of = jax.jit(lambda params, batch: make_value_and_grad(layout)(params, batch, {})[0][1][1])
        out += (jax.tree.map(np.asarray, stats_of(state.params, batch)),)
    return out


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=LOSS_RTOL)
    assert_trees_close(got[1], want[1], GRAD_RTOL, GRAD_ATOL)
    for name, value in (got[2] if len(got) > 2 else {}).items():  # routing stats, per layer
        np.testing.assert_allclose(value, want[2][name], rtol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def one_device():
    return _grads(dataclasses.replace(BASE, mesh=MeshConfig(data=1)), available_devices(1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_equals_one_device(one_device, name):
    _assert_same(_grads(dataclasses.replace(BASE, mesh=LAYOUTS[name])), one_device)


def test_drops_do_not_depend_on_the_layout():
    """Capacity is per sequence, so even with drops (and MoE every 2nd block) every layout
    computes the same function (this is also the expert=2 x tensor=2 layout)."""
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(DROPPING, n_layers=4))
    want = _grads(dataclasses.replace(cfg, mesh=MeshConfig(data=1)), available_devices(1))
    # ... with ZeRO-3 too: expert weights stored over data, gathered where the experts run.
    sharded = dataclasses.replace(cfg, mesh=MeshConfig(data=2, tensor=2, expert=2), parallel=ParallelConfig(zero=3))
    _assert_same(_grads(sharded), want)


# GPipe with MoE (and FP8) on data 2 x pipe 2 x expert 2 is tests/test_fp8.py's pipeline test.
PIPELINED = {
    # circular: 2 chunks per stage, experts and their hidden dim split 2 x 2
    "circular_tensor2_pipe2_expert2": ["mesh.data=1", "mesh.tensor=2", "mesh.pipe=2", "mesh.expert=2",
                                       "parallel.microbatches=2", "parallel.schedule=circular", "parallel.repeats=2"],
    # 1F1B: the router losses' cotangents through every per-tick VJP; all four axes at once
    "1f1b_tensor2_pipe2_expert2": ["mesh.data=1", "mesh.tensor=2", "mesh.pipe=2", "mesh.expert=2",
                                   "parallel.microbatches=4", "parallel.schedule=1f1b"],
    "1f1b_data2_pipe2_expert2_zero3": ["mesh.data=2", "mesh.pipe=2", "mesh.expert=2", "parallel.zero=3",
                                       "parallel.microbatches=2", "parallel.schedule=1f1b"],
    "1f1b_data2_tensor2_pipe2_remat": ["mesh.data=2", "mesh.tensor=2", "mesh.pipe=2", "parallel.microbatches=2",
                                       "parallel.schedule=1f1b", "parallel.remat=full"],
    # interleaved 1F1B (2 chunks per stage) with ZeRO-3; ZB-H1 (the split B and W) on all four axes
    "interleaved_data2_pipe2_expert2_zero3": ["mesh.data=2", "mesh.pipe=2", "mesh.expert=2", "parallel.zero=3",
                                              "parallel.microbatches=2", "parallel.schedule=interleaved_1f1b",
                                              "parallel.repeats=2"],
    "zb_h1_tensor2_pipe2_expert2": ["mesh.data=1", "mesh.tensor=2", "mesh.pipe=2", "mesh.expert=2",
                                    "parallel.microbatches=4", "parallel.schedule=zb_h1"],
}


@pytest.fixture(scope="module")
def dropping_one_device():
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(DROPPING, n_layers=8), mesh=MeshConfig(data=1))
    return cfg, _grads(cfg, available_devices(1), with_stats=True)


@pytest.mark.parametrize("name", list(PIPELINED))
def test_moe_inside_pipeline_stages(dropping_one_device, name):
    """MoE blocks in pipeline stages (the all-to-all inside the stage's shard_map): loss, gradients
    and every layer's routing stats (combined over microbatches and batch shards) equal one device."""
    cfg, want = dropping_one_device
    _assert_same(_grads(apply_overrides(cfg, PIPELINED[name]), with_stats=True), want)


# ----------------------------------------------------------------------------------------------
# The compiled step: 2 all-to-alls per MoE layer forward and 2 backward, of the slot bytes


def test_compiled_all_to_alls():
    cfg = apply_overrides(dataclasses.replace(BASE, model=dataclasses.replace(DROPPING, n_layers=4)),
                          ["mesh.data=2", "mesh.tensor=2", "mesh.expert=2", "model.moe.capacity_factor=1.25"])
    step = compile_step(cfg, FAST_COMPILE)
    found = collectives(step.hlo, step.mesh_shape)
    a2a = [c for c in found if c.kind == "all-to-all"]
    n_moe = cfg.model.n_layers // cfg.model.moe.every
    assert sum(c.executions for c in a2a) == 4 * n_moe
    assert {c.axes for c in a2a} == {("expert",)}
    e, cap = cfg.model.moe.num_experts, moe_capacity(cfg.train.seq_len, 8, 2, 1.25)
    slots = cfg.train.global_batch // (2 * 2) * e * cap * cfg.model.d_model * 4  # [B/(data expert), E, C, D] f32
    assert {c.bytes for c in a2a} == {slots}
    # Nothing is all-gathered (no ZeRO-3; routing stays local), and `expert` carries only the
    # all-to-alls and reductions of replicated gradients and scalars.
    assert not [c for c in found if c.kind == "all-gather"], [c.op_name for c in found if c.kind == "all-gather"]
    assert {c.kind for c in found if "expert" in c.axes} == {"all-to-all", "all-reduce"}


# ----------------------------------------------------------------------------------------------
# Counting: parameters of the built tree, and activated FLOPs


@pytest.mark.parametrize("every, shared", [(1, 0), (2, 1)])
def test_counts(every, shared):
    m = dataclasses.replace(BASE.model, n_layers=4, moe=dataclasses.replace(BASE.model.moe, every=every, shared_experts=shared))
    shapes = jax.eval_shape(lambda: Transformer(m).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    built = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert count_params(m)["total"] == built
    n_moe, d, f, e = 4 // every, m.d_model, m.d_ff, m.moe
    unused = n_moe * (e.num_experts - e.top_k) * 3 * d * f  # the experts a token does not use
    assert active_params(m) == built - unused
    dense = dataclasses.replace(m, moe=MoEConfig())
    # Activated FLOPs: each MoE layer swaps a dense FFN for a router, k experts and the shared ones.
    swap = n_moe * (d * e.num_experts + (e.top_k + shared - 1) * 3 * d * f)
    assert flops_per_token(m, 16) == flops_per_token(dense, 16) + 6 * swap


# ----------------------------------------------------------------------------------------------
# Through the CLI: the routing metrics reach metrics.jsonl per MoE layer


def test_cli_moe_run_logs_routing_metrics_per_layer(tmp_path, capsys):
    from pathlib import Path

    from parallax.cli import main

    quickstart = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.py"
    sets = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
            "train.seq_len=16", "train.global_batch=8", "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
            "train.log_every=1",
            "mesh.data=2", "mesh.tensor=2", "mesh.expert=2", "model.moe.num_experts=4", "model.moe.every=2",
            "model.moe.capacity_factor=0.5"]
    assert main(["train", str(quickstart), "--workdir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for name in ("aux_loss", "z_loss", "dropped_fraction", "load_max_over_mean"):
            assert r[f"moe_{name}"] == r[f"moe_{name}_layer1"]  # one MoE layer: block 1 of 2
            assert f"moe_{name}_layer0" not in r  # block 0 is dense
        assert 0 < r["moe_dropped_fraction"] < 1  # capacity 0.5: some tokens drop
        assert 1 <= r["moe_load_max_over_mean"] <= 4 and r["moe_aux_loss"] > 0
    assert "eval_loss" in records[-1]


# ----------------------------------------------------------------------------------------------
# Ragged dispatch (dropless): sorted tokens through ragged_dot, against the capacity path with
# capacity_factor=0 (the dropless reference that runs everywhere). Same parameters (same names,
# same initialisation), so outputs and gradients must agree to rounding.

RAGGED = dataclasses.replace(BASE.model.moe, dispatch="ragged")  # E=8, k=2, dropless, 1 shared expert


def _layer_outputs_and_grads(layer, params, x, mesh=None):
    """(y, d/d(x, params) of sum(sin(y))) of one MoE layer, jitted; under `mesh` if given."""
    from parallax.parallel.sharding import DEFAULT_RULES

    def loss(x, p):
        if mesh is None:
            y = layer.apply({"params": p}, x)[0]
        else:
            with logical_context(mesh, DEFAULT_RULES):
                y = layer.apply({"params": p}, x)[0]
        return jnp.sum(jnp.sin(y)), y

    if mesh is not None:
        x, params = jax.device_put((x, params), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)
    return jax.tree.map(np.asarray, (y, grads))


def _assert_layers_agree(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=LAYER_RTOL, atol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=LAYER_RTOL, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def capacity_layer_reference():
    """The capacity path, capacity_factor=0, on one device: x [8, 6, 12] (8 sequences: one per
    device of the batch axes below), confident routing."""
    layer = MoE(BASE.model.moe, d_ff=16)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 6, 12)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(3), x)["params"])
    params = {**params, "router": params["router"] * 20}
    return x, params, _layer_outputs_and_grads(layer, params, x)


@pytest.fixture
def grouped_calls(monkeypatch):
    """Counts traces of the grouped matmul: proof that `dispatch='ragged'` took the ragged path."""
    import parallax.model.moe as moe

    calls, inner = [], moe.grouped_swiglu
    monkeypatch.setattr(moe, "grouped_swiglu", lambda *a, **k: calls.append(1) or inner(*a, **k))
    return calls


def test_ragged_layer_equals_capacity_dropless(capacity_layer_reference, grouped_calls):
    x, params, want = capacity_layer_reference
    layer = MoE(RAGGED, d_ff=16)
    assert jax.tree.map(jnp.shape, nn.unbox(layer.init(jax.random.key(3), x)["params"])) == jax.tree.map(jnp.shape, params)
    _assert_layers_agree(_layer_outputs_and_grads(layer, params, x), want)
    assert grouped_calls
    y, stats = layer.apply({"params": params}, x)
    assert float(stats["dropped_fraction"]) == 0.0 and float(jnp.sum(stats["load"])) == 8 * 6 * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_weight_gradient_leaves_its_gemm_in_grad_reduce_dtype(dtype):
    """moe.grouped_param_dot: the ragged experts' matmul with its weight gradient emitted in
    float32 (parallel.grad_reduce_dtype), as layers.param_matmul does for every other weight.
    float32 compute: value and both gradients equal plain autodiff of ragged_dot (one GEMM each,
    the same sums). bfloat16 compute: the weight gradient is float32 and closer to the float32
    reference than plain autodiff's, which rounds it to bfloat16 before any reduction."""
    from parallax.model.moe import grouped_param_dot

    rng = np.random.default_rng(7)
    sizes = jnp.asarray([5, 0, 9, 2], jnp.int32)  # 16 rows; an empty group; 4 padding rows belong to none
    x32 = jnp.asarray(rng.normal(size=(20, 12)), jnp.float32)
    # weights and cotangent exact in bfloat16, so the only rounding left is the gradient's own
    w = jnp.asarray(rng.normal(size=(4, 12, 8)), jnp.bfloat16).astype(jnp.float32)
    g = jnp.asarray(rng.normal(size=(20, 8)), jnp.bfloat16).astype(jnp.float32)
    x = x32.astype(dtype)

    def ours(x, w):
        return jnp.sum(grouped_param_dot(x, w, sizes, jnp.dtype(dtype), jnp.float32).astype(jnp.float32) * g)

    def plain(x, w, compute=dtype):
        y = jax.lax.ragged_dot(x.astype(compute), w.astype(compute), sizes, preferred_element_type=compute)
        return jnp.sum(y.astype(jnp.float32) * g)

    (v, (dx, dw)), (pv, (pdx, pdw)) = (jax.value_and_grad(f, argnums=(0, 1))(x, w) for f in (ours, plain))
    assert dw.dtype == jnp.float32 and dx.dtype == x.dtype
    if dtype == "float32":
        np.testing.assert_allclose(v, pv, rtol=1e-6)
        np.testing.assert_allclose(dx, pdx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dw, pdw, rtol=1e-5, atol=1e-6)
        return
    _, (_, ref) = jax.value_and_grad(lambda x, w: plain(x, w, "float32"), argnums=(0, 1))(x.astype(jnp.float32), w)
    ours_err, plain_err = float(jnp.max(jnp.abs(dw - ref))), float(jnp.max(jnp.abs(pdw.astype(jnp.float32) - ref)))
    assert ours_err < 1e-5 and plain_err > 10 * ours_err, (ours_err, plain_err)


def test_ragged_model_data2_tensor2_equals_one_device(one_device, grouped_calls):
    """The whole model on data=2 x tensor=2 (expert=1: no all-to-all, runs on CPU) with ragged
    dispatch equals the capacity path with capacity_factor=0 on one device: loss and gradients."""
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, moe=RAGGED), mesh=MeshConfig(data=2, tensor=2))
    _assert_same(_grads(cfg, available_devices(4)), one_device)
    assert grouped_calls


def test_cli_refuses_ragged_with_expert_parallelism_on_cpu(tmp_path, capsys):
    from pathlib import Path

    from parallax.cli import main

    quickstart = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.py"
    sets = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
            "train.seq_len=16", "train.global_batch=8", "train.steps=1", "mesh.data=4", "mesh.tensor=1", "mesh.expert=2",
            "model.moe.num_experts=4", "model.moe.dispatch=ragged", "model.moe.capacity_factor=0"]
    rc = main(["train", str(quickstart), "--workdir", str(tmp_path / "wd"), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("parallax: error: "), err
    for needle in ("model.moe.dispatch", "XLA:CPU", "ragged_all_to_all", "capacity_factor=0"):
        assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / "wd" / "metrics.jsonl").exists()


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all as its docstring specifies (one slice per device), built from
    all_gather, which XLA:CPU runs. The receiver writes recv_sizes[src] rows at the offset the
    sender named, read from the sender's input_offsets: a wrong size or offset on either side
    shows up as wrong rows."""
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    assert input_offsets.shape == (n,), "the emulation covers one slice per device"
    data, starts, lands = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, output_offsets))
    rows, result = jnp.arange(output.shape[0]), output
    for src in range(n):
        rel = rows - lands[src, me]
        hit = (rel >= 0) & (rel < recv_sizes[src])
        value = data[src][jnp.clip(starts[src, me] + rel, 0, operand.shape[0] - 1)]
        result = jnp.where(hit.reshape(-1, *([1] * (output.ndim - 1))), value, result)
    return result


@pytest.mark.parametrize("shape", [MeshConfig(data=2, expert=4), MeshConfig(data=2, tensor=2, expert=2)])
def test_ragged_expert_exchange_offsets_with_emulated_collective(capacity_layer_reference, monkeypatch, shape):
    """The expert > 1 ragged exchange (counts all_to_all, offsets, regrouping by local expert, the
    way back) on CPU, with ragged_all_to_all replaced by an emulation of its documented semantics.
    What this cannot check (the real collective, its transpose) is the GPU test's job below."""
    import parallax.parallel.expert_parallel as ep

    moved = []  # traces of the collective: there and back, in the forward pass
    monkeypatch.setattr(ep, "ragged_all_to_all", lambda *a, **k: moved.append(1) or _emulated_ragged_all_to_all(*a, **k))
    x, params, want = capacity_layer_reference
    mesh = make_mesh(shape)
    layer = MoE(RAGGED, d_ff=16, exchange=ep.EXPERT_EXCHANGE)
    _assert_layers_agree(_layer_outputs_and_grads(layer, params, x, mesh), want)
    assert len(moved) == 2


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.skipif(not _gpus(), reason="needs a GPU: XLA:CPU cannot run jax.lax.ragged_all_to_all (jax #34755); "
                                        "run with JAX_PLATFORMS=cuda on a GPU machine")
def test_ragged_expert_exchange_on_gpu(capacity_layer_reference):
    """The real ragged_all_to_all, forward and backward, with experts over every GPU (on one GPU
    the exchange is forced at expert=1: each device sends to itself)."""
    import parallax.parallel.expert_parallel as ep
    from parallax.model.moe import Exchange

    gpus = _gpus()
    n = max(d for d in (1, 2, 4, 8) if d <= len(gpus))
    x, params, want = capacity_layer_reference
    mesh = make_mesh(MeshConfig(data=1, expert=n), gpus[:n])
    exchange = Exchange(*ep.EXPERT_EXCHANGE[:3], ep.make_ragged(exchange_at_one=True))
    layer = MoE(RAGGED, d_ff=16, exchange=exchange)
    _assert_layers_agree(_layer_outputs_and_grads(layer, params, x, mesh), want)
