"""parallelism.py is the one owner of the layout rules: the scalar check (configs) and the
vectorised filter (the planner) are the same table, the schedule's formulas agree with its table,
and lifting a limit is one edit."""

import dataclasses
import itertools

import numpy as np
import pytest

from parallax import parallelism
from parallax.config import Config, ConfigError, Fp8Config, MeshConfig, ModelConfig, MoEConfig, ParallelConfig, \
    TrainConfig
from parallax.analysis.cost import Workload
from parallax.parallelism import LAYOUT_FIELDS, RULES, SCHEDULES, Parallelism, Schedule, bubble, legal, ticks
from parallax.analysis.plan import candidates

DENSE = ModelConfig(d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256)
MOE = dataclasses.replace(DENSE, moe=MoEConfig(num_experts=4, every=2))


def _grid(n_devices: int):
    """Every combination of the layout fields on n_devices, legal or not (a superset of the
    planner's enumeration: its preferences are not applied)."""
    rows = []
    divs = [k for k in range(1, n_devices + 1) if n_devices % k == 0]
    for d, t, p in itertools.product(divs, divs, divs):
        if n_devices % (d * t * p):
            continue
        e = n_devices // (d * t * p)
        for zero, mb, sched, r, remat, sp, gr in itertools.product((0, 1, 3), (1, 2, 4), range(3), (1, 2), range(3),
                                                                      (0, 1, 2), (0, 1)):
            rows.append((d, t, p, e, zero, mb, sched, r, remat, sp, gr))
    return dict(zip(LAYOUT_FIELDS, np.asarray(rows).T))


def _config(model: ModelConfig, fields: dict, i: int, fp8: bool = False) -> tuple[Config, dict]:
    par = ParallelConfig(zero=int(fields["zero"][i]), remat=parallelism.REMATS[fields["remat"][i]],
                         microbatches=int(fields["microbatches"][i]), schedule=SCHEDULES[fields["schedule"][i]],
                         repeats=int(fields["repeats"][i]), sequence_parallel=bool(fields["sequence"][i]),
                         sequence_parallel_dim=parallelism.SEQUENCE_DIMS[max(int(fields["sequence"][i]) - 1, 0)],
                         grad_reduce_dtype=parallelism.GRAD_REDUCE_DTYPES[fields["grad_reduce"][i]])
    cfg = Config(model=model, parallel=par, train=TrainConfig(global_batch=16, seq_len=32), fp8=Fp8Config(enabled=fp8))
    return cfg, {a: int(fields[a][i]) for a in ("data", "tensor", "pipe", "expert")}


@pytest.mark.parametrize("model, fp8", [(DENSE, False), (MOE, False), (DENSE, True)], ids=["dense", "moe", "fp8"])
def test_vectorised_rules_agree_with_the_check_on_every_layout(model, fp8):
    fields = _grid(8)
    cfg0 = Config(model=model, train=TrainConfig(global_batch=16, seq_len=32), fp8=Fp8Config(enabled=fp8))
    ok = legal(cfg0, fields)
    assert 0 < ok.sum() < ok.size  # both kinds present: the comparison can fail either way
    for i in range(ok.size):
        cfg, sizes = _config(model, fields, i, fp8)
        try:
            parallelism.check(cfg, sizes)
            accepted = True
        except ConfigError:
            accepted = False
        assert accepted == bool(ok[i]), (cfg.parallel, sizes)


def test_planner_candidates_are_exactly_the_legal_layouts_it_enumerates():
    w = Workload(MOE, 16, 32)
    g = candidates(w, 8)
    assert np.size(g.data) > 0
    for i in range(np.size(g.data)):
        fields = {f.name: int(np.asarray(getattr(g, f.name))[i]) for f in dataclasses.fields(g)}
        cfg, sizes = _config(MOE, {k: [v] for k, v in fields.items()}, 0)
        parallelism.check(cfg, sizes)  # every candidate is a layout a config may ask for
    # MoE runs in every schedule, 1F1B included (pipeline_1f1b.py)
    assert np.any((g.schedule == parallelism.ONE_F_ONE_B) & (g.pipe > 1))
    # ... and the other table schedules: interleaved chunks, the split backward
    assert np.any((g.schedule == parallelism.INTERLEAVED) & (g.repeats > 1))
    assert np.any(g.schedule == parallelism.ZB_H1)


def test_lifting_a_limit_is_one_edit(monkeypatch):
    """Chunks per stage (repeats) with 1F1B are refused by one rule (interleaved_1f1b is the
    schedule with chunks); without the rule the config check accepts it."""
    cfg = Config(model=MOE, parallel=ParallelConfig(schedule="1f1b", microbatches=4, repeats=2),
                 train=TrainConfig(global_batch=16, seq_len=32))
    sizes = dict(data=2, tensor=1, pipe=2, expert=2)
    with pytest.raises(ConfigError, match="repeats"):
        Parallelism.of(cfg, sizes)
    monkeypatch.setattr(parallelism, "RULES", tuple(r for r in RULES if r.name != "repeats"))
    assert Parallelism.of(cfg, sizes).schedule.name == "1f1b"


@pytest.mark.parametrize("p, m, r, name", [(1, 4, 1, "1f1b"), (2, 4, 1, "gpipe"), (4, 8, 2, "circular"),
                                           (4, 8, 1, "1f1b"), (3, 3, 1, "gpipe"), (4, 8, 2, "interleaved_1f1b"),
                                           (4, 8, 1, "zb_h1"), (2, 3, 1, "zb_h1")])
def test_schedule_formulas_agree_with_its_table(p, m, r, name):
    """Every schedule's table counts its formula's ticks and bubble (tests/test_schedules.py walks
    the table schedules over many more layouts)."""
    s = Schedule(p, m, r, name)
    index = SCHEDULES.index(name)
    assert s.ticks == int(ticks(index, p, m, r))
    assert s.formula() == pytest.approx(float(bubble(index, p, m, r)))
    assert s.bubble_fraction == pytest.approx(s.formula())


def test_parallelism_says_what_follows():
    cfg = Config(model=DENSE, parallel=ParallelConfig(microbatches=4, sequence_parallel=True),
                 train=TrainConfig(global_batch=16, seq_len=32))
    par = Parallelism.of(cfg, dict(data=2, tensor=2, pipe=2, expert=1), "cpu")
    assert (par.batch_shards, par.pipelined, par.sequence_sharded, par.devices) == (2, True, True, 8)
    assert par.schedule == Schedule(2, 4, 1, "gpipe", 6)
    flat = Parallelism.of(dataclasses.replace(cfg, parallel=ParallelConfig()), dict(data=8, tensor=1, pipe=1, expert=1))
    assert flat.schedule is None and not flat.pipelined and not flat.sequence_sharded


def test_platform_guards_apply_to_cpu_only():
    cfg = Config(model=dataclasses.replace(DENSE, dtype="bfloat16"), parallel=ParallelConfig(microbatches=2),
                 train=TrainConfig(global_batch=16, seq_len=32))
    sizes = dict(data=4, tensor=1, pipe=2, expert=1)
    with pytest.raises(ConfigError, match="crashes XLA:CPU"):
        Parallelism.of(cfg, sizes, "cpu")
    assert Parallelism.of(cfg, sizes, "tpu").pipelined


def test_make_layout_lays_out_only_checked_layouts():
    from parallax.parallel.mesh import make_mesh
    from parallax.train.train_state import make_layout

    cfg = Config(model=DENSE, mesh=MeshConfig(data=8), train=TrainConfig(global_batch=16, seq_len=32))
    mesh = make_mesh(cfg.mesh)
    bad = dataclasses.replace(cfg, train=TrainConfig(global_batch=12, seq_len=32))
    with pytest.raises(ConfigError, match="train.global_batch=12"):  # no Parallelism given: checked here
        make_layout(bad, mesh)
    other = Parallelism.of(dataclasses.replace(cfg, parallel=ParallelConfig(zero=1)), mesh.shape, "cpu")
    with pytest.raises(ConfigError, match="checked for"):
        make_layout(cfg, mesh, other)
    layout = make_layout(cfg, mesh, Parallelism.of_mesh(cfg, mesh))
    assert layout.parallelism.batch_shards == 8
