"""The table schedules (schedules.py: 1F1B, interleaved 1F1B, ZB-H1), pure Python and exhaustive:
every op once, dependency order within and across stages, the data each op reads is the data it
needs (buffer slots never overwritten while live, the tick loop's unconditional writes
included), ticks and bubble against the formulas, and the activation-memory bounds."""

import pytest

import numpy as np

from parallax.schedules import (COMPILED_COSTS, KEPT_COSTS, SCHEDULES, Schedule, bubble, buffer_slots, lockstep_bubble,
                              make_table, residual_slots, ticks)

# every layout the tests below walk: p stages, m microbatches, v chunks
LAYOUTS = [(name, p, m, v) for p in range(1, 9) for m in range(p, 4 * p + 1)
           for name, v in (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 1), ("interleaved_1f1b", 2),
                           ("interleaved_1f1b", 3))
           if (v == 1 or m % p == 0) and (p > 1 or m > 1)]


def _needs(s, c, i, p):
    """What F/B/W of chunk c of microbatch i on stage s read: its input, its output's cotangent."""
    x = ("x", i) if (s, c) == (0, 0) else ("y", (s - 1) % p, c - (s == 0), i)
    return x, ("dy", s, c, i)


def _run(tab):
    """Play the table as pipeline_1f1b's tick loop does (the same writes, unconditional ones
    included: arrivals, the F's input, the head's cotangent) on symbolic data, asserting that
    every op reads what it needs."""
    p, v = tab.stages, tab.chunks
    act = {s: [None] * (tab.act_slots + 1) for s in range(p)}
    cot = {s: [None] * (tab.cot_slots + 1) for s in range(p)}
    res = {s: [None] * tab.res_slots for s in range(p)}  # no trash slot: an idle F writes a free one
    sent_f, sent_b = [None] * p, [None] * p
    for t in range(tab.ticks):
        recv_f, recv_b = [sent_f[(s - 1) % p] for s in range(p)], [sent_b[(s + 1) % p] for s in range(p)]
        for s in range(p):
            row = {k: int(a[t, s]) for k, a in tab.arrays.items()}
            act[s][row["recv_f"]], cot[s][row["recv_b"]] = recv_f[s], recv_b[s]
            out = dx = None
            c, i = row["f_chunk"], row["f_mb"]
            inp = ("x", i) if (s, c) == (0, 0) else act[s][row["f_act"]]
            act[s][row["f_act"]] = inp
            if row["f_busy"]:
                assert inp == _needs(s, c, i, p)[0], ("F", t, s, c, i)
                out = ("y", s, c, i)
                cot[s][row["f_cot"]] = ("dy", s, c, i)  # the head (the trash slot otherwise)
                res[s][row["f_res"]] = ("res", s, c, i)  # the residuals F keeps for its B (and W)
            else:
                cot[s][row["f_cot"]] = None
                res[s][row["f_res"]] = None  # an idle F's zeros
            for kind in ("b", "w"):
                if row[f"{kind}_busy"]:
                    c, i = row[f"{kind}_chunk"], row[f"{kind}_mb"]
                    assert (act[s][row[f"{kind}_act"]], cot[s][row[f"{kind}_cot"]]) == _needs(s, c, i, p), (kind, t, s, c, i)
                    assert res[s][row[f"{kind}_res"]] == ("res", s, c, i), (kind, "residuals", t, s, c, i)
                    if kind == "b":
                        dx = ("dy", (s - 1) % p, c - (s == 0), i)
            sent_f[s], sent_b[s] = out, dx


@pytest.mark.parametrize("name,p,m,v", LAYOUTS)
def test_table_runs_every_op_once_in_dependency_order(name, p, m, v):
    tab = make_table(name, p, m, v)
    f, b, w = tab.times["F"], tab.times["B"], tab.times["W"]
    ops = {(s, c, i) for s in range(p) for c in range(v) for i in range(m)}
    assert set(f) == set(b) == ops and set(w) == (ops if tab.split else set())
    for kind in ("f", "b", "w"):  # one op of a kind per stage and tick: the busy table holds them all
        assert tab[f"{kind}_busy"].sum() == (len(ops) if kind != "w" or tab.split else 0)
    for s, c, i in ops:
        last = (s, c) == (p - 1, v - 1)
        # F before B (the last chunk's B may share the F's tick in 1F1B's tick: head, then B), B before W
        assert b[(s, c, i)] > f[(s, c, i)] or (last and not tab.split and b[(s, c, i)] == f[(s, c, i)])
        if tab.split:
            assert w[(s, c, i)] > b[(s, c, i)]
        # across stages: the producer's F at least one tick earlier (its send arrives next tick) ...
        if (s, c) != (0, 0):
            src = (s - 1, c) if s else (p - 1, c - 1)
            assert f[(s, c, i)] >= f[(*src, i)] + 1
        # ... and the consumer's B at least one tick earlier
        if not last:
            dst = (s + 1, c) if s < p - 1 else (0, c + 1)
            assert b[(s, c, i)] >= b[(*dst, i)] + 1
    _run(tab)


@pytest.mark.parametrize("name,p,m,v", LAYOUTS)
def test_table_ticks_and_bubble_are_the_formulas(name, p, m, v):
    sched = Schedule(p, m, v, name)
    index = SCHEDULES.index(name)
    assert sched.ticks == int(ticks(index, p, m, v))
    assert sched.bubble_fraction == pytest.approx(float(bubble(index, p, m, v)))
    if name == "interleaved_1f1b":  # (P-1)/(vM) of the ideal: bubble / (1 - bubble)
        assert sched.bubble_fraction / (1 - sched.bubble_fraction) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("name,p,m,v", LAYOUTS)
def test_table_activation_memory_is_bounded(name, p, m, v):
    """Stage inputs kept: 1F1B at most 2P - 1 (stage 0 holds a microbatch from its F to its B,
    2(P-1) ticks later), interleaved vP + P - 1 (Megatron's in-flight count (v-1)P + 2(P-1) + 1),
    ZB-H1 P + 1 inputs and P output cotangents (2 on one stage; a W keeps both until it runs):
    none grows with M."""
    tab = make_table(name, p, m, v)
    bound = {"1f1b": (2 * p - 1, 1), "interleaved_1f1b": (v * p + p - 1, 1), "zb_h1": (p + 1, max(p, 2))}[name]
    assert tab.act_slots <= bound[0] and tab.cot_slots <= bound[1]
    # the cost model's count (with the two trash slots)
    assert buffer_slots(SCHEDULES.index(name), p, m, v) == tab.act_slots + tab.cot_slots + 2
    # kept residuals: from F to B (W), at most the stage inputs' bound, + 1 where an idle F finds
    # every slot live; the cost model's count
    assert tab.res_slots <= bound[0] + 1
    assert residual_slots(SCHEDULES.index(name), p, m, v) == tab.res_slots


def test_interleaved_with_one_chunk_is_1f1b():
    for p, m in [(2, 3), (4, 8), (8, 9)]:
        one, inter = make_table("1f1b", p, m), make_table("interleaved_1f1b", p, m, 1)
        assert one.times == inter.times and all((one[k] == inter[k]).all() for k in one.arrays)


def test_zb_h1_table_is_the_papers_shape():
    """p = 4, m = 8 (F:B:W = 1:1:1): stage 0 runs P F's, waits P - 1 ticks for the first
    cotangent, and never idles again; the last stage defers its last W's to the end; the bubble is
    (P-1)(F+B-W) = 3 units of 27, a third of 1F1B's (P-1)(F+B+W) = 9 on the same unit grid."""
    tab = make_table("zb_h1", 4, 8)
    grid = {s: ["." for _ in range(tab.ticks)] for s in range(4)}
    for kind in ("F", "B", "W"):
        for (s, _, i), t in tab.times[kind].items():
            grid[s][t] = f"{kind}{i}"
    assert grid[0][:8] == ["F0", "F1", "F2", "F3", ".", ".", ".", "B0"] and "." not in grid[0][7:]
    assert grid[3][-4:] == ["W4", "W5", "W6", "W7"] and grid[3][:4] == [".", ".", ".", "F0"]
    assert tab.ticks == 3 * 8 + 3
    sched = Schedule(4, 8, 1, "zb_h1")
    # the same table under compiled-like costs (B and W each recompute the forward): lockstep hurts
    assert sched.bubble_fraction_at({"F": 1, "B": 2, "W": 3}) > sched.bubble_fraction


def test_lockstep_bubble_reads_each_layouts_table():
    """The planner's vectorised bubble: each table schedule's own table under the compiled op
    costs (1F1B and interleaved: the formula, any F:B ratio; ZB-H1: more than the paper's);
    GPipe/circular and unpipelined layouts: the formula."""
    sched = np.array([SCHEDULES.index(n) for n in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h1")])
    p, m, r = np.array([4, 4, 4, 4, 1]), np.array([8, 8, 8, 8, 1]), np.array([1, 1, 2, 1, 1])
    got = lockstep_bubble(sched, p, m, r)
    want = [bubble(0, 4, 8, 1), bubble(2, 4, 8, 1), bubble(3, 4, 8, 2),
            Schedule(4, 8, 1, "zb_h1").bubble_fraction_at(COMPILED_COSTS["zb_h1"]), 0.0]
    np.testing.assert_allclose(got, want)
    assert got[3] > bubble(4, 4, 8, 1)
    # 1F1B and interleaved in lockstep: the formula under any F:B cost (what lockstep_bubble returns)
    for name, p_, m_, v in [("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 6, 3)]:
        sch = Schedule(p_, m_, v, name)
        for costs in (COMPILED_COSTS[name], {"F": 1, "B": 5, "W": 0}):
            assert sch.bubble_fraction_at(costs) == pytest.approx(sch.formula())
    # B and W from F's residuals (parallelism.keeps_residuals): ZB-H1's ops cost 1:1:2, not 1:2:3
    kept = lockstep_bubble(sched, p, m, r, True)
    assert kept[3] == pytest.approx(Schedule(4, 8, 1, "zb_h1").bubble_fraction_at(KEPT_COSTS["zb_h1"]))
    assert kept[3] > bubble(4, 4, 8, 1) and kept[3] != pytest.approx(got[3])
    np.testing.assert_allclose(kept[[0, 1, 2, 4]], got[[0, 1, 2, 4]])
    # beyond EXACT_OPS: an upper bound of the table's lockstep bubble
    assert lockstep_bubble(4, 64, 128, 1) >= Schedule(64, 128, 1, "zb_h1").bubble_fraction_at(COMPILED_COSTS["zb_h1"])
    assert np.shape(lockstep_bubble(4, 4, 8, 1)) == ()
