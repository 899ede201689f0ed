"""The cost model (parallax/analysis/cost.py) against the compiled MoE step, on 8 simulated CPU devices.

Each layout is compiled once ahead of time (audit.compile_step, cached) and `audit.audit` sets the
compiled HLO beside the model, as tests/test_cost_validation.py does for dense layouts:
- every collective group over 4 KiB is explained by the model, each (axes, kind) row within 5%;
- the MoE all-to-alls: exactly 2 per MoE layer forward and 2 backward (2 more when a remat
  policy recomputes the layer), each moving one device's [B/(data expert), E, C, D] slots,
  computed here from the config, not from cost.py;
- the expert weights' gradients reduce over `data` alone, the rest over (data, expert);
- predicted memory within 15% of XLA's memory analysis, matmul FLOPs within 10% of the HLO's.
The MoE memory constants were fitted on another model (BUILD_NOTES.md, "Cost model: MoE").
"""

import dataclasses

import pytest

from parallax.analysis.audit import FAST_COMPILE, SCALAR_BYTES, audit, format_report
from parallax.config import Config, MeshConfig, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from parallax.config import moe_capacity

MOE = MoEConfig(num_experts=8, top_k=2)
MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, moe=MOE)
TRAIN = TrainConfig(global_batch=8, seq_len=32)
EVERY2_SHARED = dataclasses.replace(MODEL, moe=dataclasses.replace(MOE, every=2, shared_experts=1))

LAYOUTS = {
    # tensor x expert x data, a unit of 2 blocks (dense, then MoE with a shared expert)
    "d2_t2_e2_every2_shared": (MeshConfig(data=2, tensor=2, expert=2), ParallelConfig(), EVERY2_SHARED),
    # every device holds one expert; all gradient reductions run over `expert`
    "e8": (MeshConfig(data=1, expert=8), ParallelConfig(), MODEL),
    # ZeRO-1: the non-expert gradients reduce over data, then over expert on the 1/data slice
    "d4_e2_zero1": (MeshConfig(data=4, expert=2), ParallelConfig(zero=1), MODEL),
    # ZeRO-3 with recomputation: per-layer gathers over data twice, 6 all-to-alls per MoE layer
    "d4_e2_zero3_full": (MeshConfig(data=4, expert=2), ParallelConfig(zero=3, remat="full"), MODEL),
    # MoE inside pipeline stages: ZeRO-3 (the stage's non-expert gradients sum over expert, then
    # reduce-scatter over data), and circular with recomputation next to tensor
    "gpipe_d2_e2_p2_zero3": (MeshConfig(data=2, expert=2, pipe=2), ParallelConfig(microbatches=2, zero=3), EVERY2_SHARED),
    "circular_t2_e2_p2_full": (MeshConfig(data=1, tensor=2, expert=2, pipe=2),
                               ParallelConfig(microbatches=2, schedule="circular", repeats=2, remat="full"), MODEL),
}
COLLECTIVE_TOL, MEMORY_TOL, FLOPS_TOL = 0.05, 0.15, 0.10


def _config(name: str) -> Config:
    mesh, parallel, model = LAYOUTS[name]
    return Config(name=name, mesh=mesh, model=model, parallel=parallel, train=TRAIN)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def audited(request):
    return request.param, audit(_config(request.param), FAST_COMPILE)


def test_every_collective_is_modelled_per_axes_and_kind(audited):
    name, a = audited
    for row in a["collectives"]:
        if row["bytes"] <= SCALAR_BYTES and not row["model_bytes"]:
            continue  # loss, norm and routing-statistics scalars
        if not row["axes"]:  # groups of one device: the expert-weight reduction over data = 1, kept
            continue  # by XLA:CPU as a no-op; nothing crosses a link
        # (XLA folds those scalars into small modelled groups too: a few bytes on a norm reduction)
        near = abs(row["bytes"] - row["model_bytes"]) <= SCALAR_BYTES
        assert row["model_bytes"] > 0 and (abs(row["error"]) <= COLLECTIVE_TOL or near), (name, row)
    for family, totals in a["axes"].items():
        assert abs(totals["error"]) <= COLLECTIVE_TOL, (name, family, totals)


def test_all_to_alls_two_each_way_per_moe_layer(audited):
    name, a = audited
    cfg = _config(name)
    m, mesh = cfg.model, cfg.mesh
    par = cfg.parallel
    moe_layers = m.n_layers // m.moe.every
    recomputed = par.remat != "none"
    c = moe_capacity(TRAIN.seq_len, m.moe.num_experts, m.moe.top_k, m.moe.capacity_factor)
    # one device's [B/(data expert), E, C, D] float32 slots (XLA:CPU keeps MoE collectives in f32)
    slots = TRAIN.global_batch // (mesh.data * mesh.expert) * m.moe.num_experts * c * m.d_model * 4
    runs = moe_layers  # MoE layer executions per step
    if mesh.pipe > 1:  # every tick every stage runs its chunk (bubble ticks too) on one microbatch
        ticks = par.repeats * par.microbatches + mesh.pipe - 1
        rows = TRAIN.global_batch // (mesh.data * mesh.expert * par.microbatches)
        halves = 2 if rows % 2 == 0 else 1  # each tick runs two half-microbatches when it can
        runs = ticks * moe_layers // (mesh.pipe * par.repeats) * halves
        slots //= par.microbatches * halves
    (row,) = [r for r in a["collectives"] if r["kind"] == "all-to-all"]
    assert row["axes"] == ["expert"]
    assert row["executions"] == row["model_executions"] == runs * (6 if recomputed else 4), row
    assert row["bytes"] == row["model_bytes"] == row["executions"] * slots, (row, slots)
    assert a["axes"]["expert"]["bytes"] == row["bytes"]


def test_expert_weight_gradients_reduce_over_data_only(audited):
    name, a = audited
    cfg = _config(name)
    m, mesh = cfg.model, cfg.mesh
    moe_layers = m.n_layers // m.moe.every
    expert_bytes = 4 * moe_layers * m.moe.num_experts // mesh.expert * 3 * m.d_model * m.d_ff // mesh.tensor
    data_only = [r for r in a["collectives"] if r["axes"] == ["data"] and r["bytes"] > SCALAR_BYTES
                 and r["kind"] in ("all-reduce", "reduce-scatter")]
    if mesh.data == 1:
        assert not data_only
        return
    (row,) = data_only
    assert any("expert-weight" in what for what in row["model"])
    # ZeRO-1 also reduces the rest over data first (then over expert); a pipelined ZeRO-3 stage
    # reduce-scatters the rest over data after summing it over expert
    if cfg.parallel.zero != 1 and mesh.pipe == 1:
        assert 0 <= row["bytes"] - expert_bytes <= SCALAR_BYTES, (row, expert_bytes)  # + loss scalars


def test_memory_matches_xla(audited):
    name, a = audited
    mem = a["memory"]
    if mem["xla"] is None:
        pytest.skip("the backend gives no memory analysis")
    assert abs(mem["error"]) <= MEMORY_TOL, (name, mem["xla"]["peak"], mem["model"])


def test_executed_matmul_flops_count_capacity_slots(audited):
    name, a = audited
    predicted, measured = a["flops"]["executed_model"]["total"], a["flops"]["hlo_dots"]["total"]
    assert abs(predicted / measured - 1) <= FLOPS_TOL, (name, predicted, measured)
    # the MFU numerator counts activated parameters only: less than the slots executed
    assert a["flops"]["model_per_device"] < measured


def test_audit_report_shows_the_expert_axis(audited):
    name, a = audited
    text = format_report(a, name)
    assert "every collective is explained by the cost model" in text
    assert "MoE dispatch + combine" in text and "\n  expert   compiled" in text
    assert "part of a reduction XLA split" not in text  # nothing left unattributed
