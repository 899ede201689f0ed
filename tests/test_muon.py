"""optim.name=muon (issue 23): Muon for the blocks' matmul kernels, AdamW for the rest.

- Which matrix each parameter is (optim.muon_dimensions), from its logical axis names.
- The composed optimizer equals optax's own pieces leaf by leaf over 3 updates: the Muon leaves
  optax.contrib.muon with the same matrices and consistent_rms, the AdamW leaves optax.adamw
  with parallax's decay mask. float32, the same operations in the same order: rtol 1e-6.
- One train step under data 4 x tensor 2 x ZeRO-3 and under data 2 x pipe 2 equals one device,
  per parameter: the Newton-Schulz iterations run on sharded matrices (GSPMD inserts the
  collectives), so only the order of float32 sums differs; params atol 1e-5 at lr 1e-2 (the
  grad_accum bound; seen ~1e-7), momenta within the layout-equivalence gradient bounds.
- The optimizer state the cost model counts (cost.memory_parts 'optimizer') equals the bytes the
  layout holds per device, within the norms and router that Muon's count includes (< 1%).
- A Muon run trains, saves and resumes through the CLI; an unknown optimizer is one line, exit 2.
"""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from parallax.analysis.cost import Grid, Workload, memory_parts, optimizer_flops_per_device
from parallax.cli import main
from parallax.config import Config, MeshConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig
from parallax.train.build import build
from parallax.train.optim import decay_mask, make_lr_schedule, make_optimizer, muon_dimensions
from parallax.train.train_state import init_state
from numerics import assert_trees_close
from test_cli import QUICKSTART, TINY, _assert_one_error_line, _make_workdir, _sets, _snapshot

D = optax.contrib.MuonDimensionNumbers
PARAM_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6

BASE = Config(
    model=ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=256),
    optim=OptimConfig(name="muon", warmup_steps=0),
    train=TrainConfig(global_batch=8, seq_len=16, lr=1e-2, seed=5),
)


@pytest.mark.parametrize("names, dims", [
    (("layers", "embed", "kv_heads", None, "kv"), D((-4,), (-3, -1))),  # q/k/v slots: one matrix each
    (("layers", "heads", "kv", "embed"), D((-3, -2), (-1,))),  # attention output
    (("layers", "embed", None, "mlp"), D((-3,), (-1,))),  # gate and up: one matrix each
    (("layers", "mlp", "embed"), D((-2,), (-1,))),
    (("layers", "exp", "embed", None, "mlp"), D((-3,), (-1,))),  # every expert its own matrices
    (("layers", "exp", "mlp", "embed"), D((-2,), (-1,))),
    (("repeat", "stage", "layers", "mlp", "embed"), D((-2,), (-1,))),  # the pipelined stack
    (("vocab", "embed"), None), (("embed", "vocab"), None),  # embedding, output projection: AdamW
    (("layers", "embed"), None), (("embed",), None),  # norms
    (("layers", "embed", None), None),  # the router
])
def test_muon_dimensions_from_logical_names(names, dims):
    assert muon_dimensions(names) == dims


def _specs_and_params(cfg: Config):
    b = build(dataclasses.replace(cfg, mesh=MeshConfig(data=1)), jax.devices()[:1])
    specs = b.layout.logical_specs
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), b.layout.abstract_state.params)
    return specs, params


def test_composed_optimizer_equals_optax_pieces_leaf_by_leaf():
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, moe=MoEConfig(num_experts=4)),
                              optim=dataclasses.replace(BASE.optim, clip_norm=0.0))
    specs, params = _specs_and_params(cfg)
    o = cfg.optim
    dims = jax.tree.map(lambda s: muon_dimensions(tuple(s)), specs, is_leaf=lambda x: isinstance(x, P))
    is_muon = jax.tree.map(lambda d: d is not None, dims, is_leaf=lambda x: x is None or isinstance(x, D))
    assert sum(jax.tree.leaves(is_muon)) == 4  # q/k/v, attention output, the experts' wi and wo
    ours = make_optimizer(cfg, specs)
    lr = make_lr_schedule(cfg)  # the cosine's count 0, 1, 2: the references follow the same schedule
    ref_muon = optax.contrib.muon(lr, ns_steps=o.muon_ns_steps, beta=o.muon_beta, eps=o.eps,
                                  weight_decay=o.weight_decay, consistent_rms=o.muon_rms,
                                  muon_weight_dimension_numbers=dims)
    ref_adam = optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    states = [tx.init(params) for tx in (ours, ref_muon, ref_adam)]
    rng = np.random.default_rng(1)
    for _ in range(3):
        grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
        (u, states[0]), (um, states[1]), (ua, states[2]) = [
            tx.update(grads, s, params) for tx, s in zip((ours, ref_muon, ref_adam), states)]
        for (path, got), m, a, muon in zip(jax.tree_util.tree_leaves_with_path(u), jax.tree.leaves(um),
                                           jax.tree.leaves(ua), jax.tree.leaves(is_muon)):
            np.testing.assert_allclose(got, m if muon else a, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
        params = optax.apply_updates(params, u)


def _one_step(cfg: Config, devices) -> dict:
    b = build(cfg, devices)
    rows = np.random.default_rng(0).integers(0, 256, (cfg.train.global_batch, cfg.train.seq_len + 1)).astype(np.int32)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, b.batch_sharding)
    state = init_state(cfg, b.layout)
    params0 = jax.tree.map(np.asarray, state.params)
    state, metrics = b.train_step()(state, batch)
    return {"params0": params0, "state": jax.tree.map(np.asarray, state), "loss": float(metrics["loss"])}


@pytest.fixture(scope="module")
def one_device():
    return _one_step(dataclasses.replace(BASE, mesh=MeshConfig(data=1)), jax.devices()[:1])


@pytest.mark.parametrize("mesh, parallel", [
    pytest.param(MeshConfig(data=4, tensor=2), ParallelConfig(zero=3), id="data4-tensor2-zero3"),
    pytest.param(MeshConfig(data=2, pipe=2), ParallelConfig(zero=1, microbatches=2), id="data2-pipe2-zero1"),
])
def test_muon_step_sharded_equals_one_device(one_device, mesh, parallel):
    cfg = dataclasses.replace(BASE, mesh=mesh, parallel=parallel)
    n = mesh.data * mesh.tensor * mesh.pipe
    got = _one_step(cfg, jax.devices()[:n])
    np.testing.assert_allclose(got["loss"], one_device["loss"], rtol=1e-6)
    ref = one_device["state"]
    got_params = got["state"].params
    if mesh.pipe > 1:  # the stage layout [repeat, stage, layers/stage, ...] back to [layers, ...]
        got_params = {**got_params, "layers": jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), got_params["layers"])}
    for (path, p), r in zip(jax.tree_util.tree_leaves_with_path(got_params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(p, r, atol=PARAM_ATOL, rtol=0, err_msg=jax.tree_util.keystr(path))
    moved = max(np.abs(p - q).max() for p, q in zip(jax.tree.leaves(ref.params), jax.tree.leaves(one_device["params0"])))
    assert moved > 1e-3  # the step really moved the parameters
    if mesh.pipe == 1:  # momenta leaf by leaf (the stage layout reshapes them as the params)
        moments = lambda s: [x for x in jax.tree.leaves(s.opt_state) if x.ndim > 1]  # noqa: E731
        assert_trees_close(moments(got["state"]), moments(ref), GRAD_RTOL, GRAD_ATOL)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_cost_model_counts_the_optimizer_state(name):
    cfg = dataclasses.replace(BASE, mesh=MeshConfig(data=4, tensor=2), parallel=ParallelConfig(zero=1),
                              optim=dataclasses.replace(BASE.optim, name=name))
    b = build(cfg, jax.devices())
    held = 0
    leaves = jax.tree_util.tree_leaves_with_path(b.layout.abstract_state.opt_state)
    for (path, x), s in zip(leaves, jax.tree.leaves(b.layout.state_shardings.opt_state)):
        if x.ndim and "ns_coeffs" not in jax.tree_util.keystr(path):  # the moments, not counts or coefficients
            held += np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    model = memory_parts(Workload.of(cfg), Grid.of(cfg, dict(b.mesh.shape)))["optimizer"]
    assert float(model) == pytest.approx(held, rel=0.01), (name, float(model), held)


def test_a_muon_run_saves_and_resumes(tmp_path):
    """Quickstart's data 4 x tensor 2 (ZeRO-1) with Muon: stop after step 1 (a save), resume to
    step 2; the partitioned state (empty MaskedNodes where the other half owns a leaf) round-trips
    through Orbax. One compile per run (~5 s each)."""
    wd = tmp_path / "wd"
    args = ["train", str(QUICKSTART), *_sets(*TINY, "optim.name=muon"), "--workdir", str(wd)]
    assert main([*args, "--stop-at", "1"]) == 0
    assert main(args) == 0
    records = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)


def test_an_unknown_optimizer_is_one_line_exit_2(tmp_path, capsys):
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    assert main(["train", str(QUICKSTART), *_sets(*TINY, "optim.name=sgd"), "--workdir", str(wd)]) == 2
    _assert_one_error_line(capsys.readouterr().err, "optim.name", "'adamw', 'muon'", "'sgd'")
    assert _snapshot(tmp_path) == before


def _collective_bytes(cfg: Config, devices) -> dict[str, int]:
    from parallax.analysis.hlo import collectives

    b = build(cfg, devices)
    compiled = b.train_step().lower(b.abstract_state(), b.abstract_batch()).compile()
    out: dict[str, int] = {}
    for c in collectives(compiled.as_text(), dict(b.mesh.shape)):
        out[c.kind] = out.get(c.kind, 0) + c.bytes_per_step
    cost = compiled.cost_analysis()
    out["flops"] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    return out, b


@pytest.mark.parametrize("zero", [1, 3])
def test_newton_schulz_runs_on_whole_matrices_spread_over_the_mesh(zero):
    """data 2 x tensor 2, 4 layers: every Muon kernel's momentum lives with its matrices whole and
    its layers over data x tensor (optim.muon_shardings), so the step gathers nothing AdamW's does
    not (the Newton-Schulz iterations would otherwise gather each matrix, every iteration) and
    reshards with all-to-alls instead. See experiments/bench_muon.py for a larger shape."""
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, n_layers=4),
                              mesh=MeshConfig(data=2, tensor=2), parallel=ParallelConfig(zero=zero))
    adamw, _ = _collective_bytes(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="adamw")),
                                 jax.devices()[:4])
    muon, b = _collective_bytes(cfg, jax.devices()[:4])
    print(f"zero {zero}: collective bytes per step, adamw {adamw}, muon {muon}")
    assert muon.get("all-gather", 0) <= adamw.get("all-gather", 0)
    assert muon.get("all-to-all", 0) > 0
    state = b.layout.state_shardings.opt_state
    # every Muon momentum leaf (the partition's 'muon' half) has its layers over data x tensor
    muon_specs = {jax.tree_util.keystr(path): s.spec for (path, s) in jax.tree_util.tree_leaves_with_path(state)
                  if "'muon'" in jax.tree_util.keystr(path) and ".mu[" in jax.tree_util.keystr(path)}
    assert len(muon_specs) == 4, muon_specs  # q/k/v, attention output, MLP wi and wo
    assert all(tuple(spec)[:1] == (("data", "tensor"),) for spec in muon_specs.values()), muon_specs
    # The Newton-Schulz FLOPs per device, as the cost model counts them (XLA counts a scanned
    # loop's body once, but the optimizer update is outside the layer loop: all of it counts)
    model = float(optimizer_flops_per_device(Workload.of(cfg), Grid.of(cfg, dict(b.mesh.shape))))
    assert muon["flops"] - adamw["flops"] == pytest.approx(model, rel=0.02), (muon["flops"] - adamw["flops"], model)
