"""The pipeline schedules: the one owner of schedule facts (pure Python and numpy, no JAX).

The pipeline programs (parallel/pipeline.py, parallel/pipeline_1f1b.py), the cost model and the
planner all read what is here: the vectorised formulas (`ticks`, `bubble`) and, per schedule, its
work table (`Schedule.work` for GPipe/circular, `Schedule.table()` for the schedules that compute
their own gradients). parallelism.py re-exports every name.

Schedules that compute their own gradients (`OWN_GRADIENTS`) run from a `Table`: per (tick,
stage) an F op (chunk, microbatch), a B op, a W op, or nothing, and the buffer slots their data
live in. Each tick ends with two `ppermute`s round the `pipe` ring (activations forward,
cotangents backward), so ticks run in lockstep: a tick lasts as long as its busiest stage.

- `1f1b`: one F and one full backward B (input and weight gradients) per tick; F of microbatch i
  on stage s at tick i + s, its B at tick i + 2(P-1) - s. Tick cost F + B with B = 2 F.
- `interleaved_1f1b` (Megatron's interleaved order, v = `repeats` chunks per stage): stage s runs
  forward item k = t - s and backward item k = t - (vP + P - 2) + s, where items visit microbatches
  in groups of P, each group through chunk 0, 1, .. v-1 (backward: v-1 .. 0). The output of chunk
  c on the last stage reaches stage 0's chunk c+1 exactly when it is due there, so every received
  activation and cotangent is consumed in the tick it arrives. With v = 1 this is `1f1b`. Bubble
  (P-1)/(vM + P - 1), i.e. (P-1)/(vM) of the ideal; M must be a multiple of P when v > 1.
- `zb_h1` (Qi et al. 2024, ZB-H1): the backward split into B (input gradient) and W (weight
  gradient), on the paper's grid: one unit op per stage per tick, F:B:W = 1:1:1 assumed for the
  table. Stage 0's order fixes the backward's pace (P F's, then B, F, W per microbatch, B, W once
  the F's run out); stage s's B of microbatch i runs s ticks before stage 0's; F's go to the first
  free tick after their input arrives and while at most P - s microbatches are between F and B
  (1F1B's in-flight bound); W's fill the free ticks after their B. Ticks 3M + P - 1, bubble
  (P-1)(F+B-W) / (M(F+B+W) + (P-1)(F+B-W)) = (P-1)/(3M + P - 1): the paper's, and lockstep adds
  nothing under the 1:1:1 assumption (every tick is one unit). Compiled costs differ (from F's
  residuals the split B costs 1 + a forwards and W 1 - a, a the attention scores' share:
  kept_costs; recomputing the chunk, B and W each recompute the stage forward):
  `Schedule.bubble_fraction_at` evaluates the same table under other costs. With one op per
  stage and tick, every tick lasts as long as its costliest op, so unequal costs cost bubble.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1")
GPIPE, CIRCULAR, ONE_F_ONE_B, INTERLEAVED, ZB_H1 = range(5)
OWN_GRADIENTS = (ONE_F_ONE_B, INTERLEAVED, ZB_H1)  # the pipeline returns loss and gradients itself
VIRTUAL = (CIRCULAR, INTERLEAVED)  # schedules with several chunks per stage (parallel.repeats)
# Cost of one op in forward units, for the tick model of each table schedule (a chunk's share of
# a stage). 1F1B/interleaved: a full backward is twice a forward; ZB-H1: the paper's 1:1:1.
TABLE_COSTS = {"1f1b": {"F": 1, "B": 2, "W": 0}, "interleaved_1f1b": {"F": 1, "B": 2, "W": 0},
               "zb_h1": {"F": 1, "B": 1, "W": 1}}

# The same ops as compiled here (forward units): 1F1B's B recomputes the chunk then runs its
# backward (3); ZB-H1's B recomputes and runs the input gradient (2), its W recomputes and runs
# the input-gradient chain again (a unit's weight gradient needs its output's cotangent) and the
# weight gradients (3). (Under remat full each unit's VJP recomputes that unit once more, about
# one forward more per B and W from two units a chunk up: the matmul FLOPs the cost model counts,
# cost.hardware_flops_per_device; these tick costs leave it out.)
COMPILED_COSTS = {"1f1b": {"F": 1, "B": 3, "W": 0}, "interleaved_1f1b": {"F": 1, "B": 3, "W": 0},
                  "zb_h1": {"F": 1, "B": 2, "W": 3}}
# ... and where B and W start from F's residuals (parallelism.keeps_residuals, remat none): 1F1B's
# B is the backward (2); ZB-H1's B the input-gradient chain (1), its W the weight gradients from
# B's stash (1: the backward split by its outputs, parallel/split_backward.py; before the split W
# ran the chain again, 2). (Under dots and save_attn_mlp B adds what the policy recomputes.)
KEPT_COSTS = {"1f1b": {"F": 1, "B": 2, "W": 0}, "interleaved_1f1b": {"F": 1, "B": 2, "W": 0},
              "zb_h1": {"F": 1, "B": 1, "W": 1}}


def kept_costs(name: str, attention_share: float = 0.0) -> dict[str, float]:
    """KEPT_COSTS[name] for a model whose attention scores are `attention_share` of a forward's
    matmul FLOPs (transformer.attention_share): ZB-H1's split B runs the chain's input-gradient matmuls
    (the forward's projections' cost) and the scores' backward (twice their forward: on the
    chain), W the projections' weight gradients alone: B = 1 + a, W = 1 - a. (Compiled on CPU,
    bench_pipeline [4]: B 1.118, W 0.872 where the model's a is 0.111.)"""
    c = dict(KEPT_COSTS[name])
    if name == "zb_h1":
        c["B"], c["W"] = 1 + attention_share, 1 - attention_share
    return c


# ----------------------------------------------------------------------------------------------
# Formulas shared by the pipeline, the cost model and the planner (numpy-broadcasting)


def pipelined(pipe: Any, microbatches: Any) -> Any:
    """The block stack runs as a pipeline (stages, or microbatches on one stage)."""
    return (np.asarray(pipe) > 1) | (np.asarray(microbatches) > 1)


def own_gradients(schedule: Any) -> Any:
    """The schedule computes its own gradients (a table schedule: 1F1B, interleaved, ZB-H1)."""
    return np.isin(np.asarray(schedule), OWN_GRADIENTS)


def ticks(schedule: Any, pipe: Any, microbatches: Any, repeats: Any) -> Any:
    """Ticks of the tick loop: GPipe and circular R*M + P - 1 of each loop; 1F1B M + 2(P-1) and
    interleaved vM + vP + P - 2 of forward and backward together (v = R); ZB-H1 3M + P - 1 unit
    ops. `Schedule.ticks` counts them from the tables and the tests hold the two equal."""
    sched, p, m, r = (np.asarray(a) for a in (schedule, pipe, microbatches, repeats))
    v = np.where(sched == INTERLEAVED, r, 1)
    return np.select([sched == ZB_H1, own_gradients(sched)], [3 * m + p - 1, v * m + v * p + p - 2], r * m + p - 1)


def bubble(schedule: Any, pipe: Any, microbatches: Any, repeats: Any) -> Any:
    """The ideal bubble, a fraction of the step: (P-1)/(R M + P - 1) with R the chunks per stage
    (circular, interleaved; 1 otherwise); ZB-H1 (P-1)(F+B-W)/(M(F+B+W) + (P-1)(F+B-W)) with
    F = B = W: (P-1)/(3M + P - 1). 0 when not pipelined. `Schedule.bubble_fraction` counts it
    from the table instead."""
    sched, p, m = np.asarray(schedule), np.asarray(pipe), np.asarray(microbatches)
    r = np.where(np.isin(sched, VIRTUAL), repeats, 1)
    frac = np.where(sched == ZB_H1, (p - 1) / (3 * m + p - 1), (p - 1) / (r * m + p - 1))
    return np.where(pipelined(p, m), frac, 0.0)


EXACT_OPS = 4096  # lockstep_bubble walks ZB-H1's table up to this many ops per op kind (P x M)


@functools.lru_cache(maxsize=4096)
def _lockstep_bubble(name: str, p: int, m: int, r: int, kept: bool, share: float) -> float:
    if name != "zb_h1":
        # 1F1B / interleaved: F-only warm-up ticks, F+B steady ticks, B-only cool-down ticks, the
        # same on every stage, so the formula holds for any F:B cost (tests/test_schedules.py)
        return float(bubble(SCHEDULES.index(name), p, m, r))
    c = kept_costs(name, share) if kept else COMPILED_COSTS[name]
    work = m * (c["F"] + c["B"] + c["W"])
    if p * m > EXACT_OPS:  # an upper bound: every tick as long as the costliest op
        return 1 - work / (max(c.values()) * (3 * m + p - 1))
    tick_cost: dict[int, float] = {}
    for kind, times in zip("FBW", _zb_h1_times(p, m)):
        for t in times.values():
            tick_cost[t] = max(tick_cost.get(t, 0), c[kind])
    return 1 - work / sum(tick_cost.values())


def lockstep_bubble(schedule: Any, pipe: Any, microbatches: Any, repeats: Any, kept: Any = False,
                    attention_share: Any = 0.0) -> Any:
    """The bubble of a table schedule's own table with its ticks in lockstep and the compiled op
    costs (COMPILED_COSTS, or where `kept`, B and W from F's residuals, kept_costs for the
    model's `attention_share`); `bubble` elsewhere. Element-wise over a grid (the planner's), one
    table walk per distinct ZB-H1 layout up to P x M = EXACT_OPS, an upper bound beyond (each
    tick as long as its costliest op; 0.342 against the exact 0.317 at P 4, M 32 under
    COMPILED_COSTS). ZB-H1's one op per tick and stage makes every tick as long as its costliest
    op: the paper's bubble needs F = B = W, which the split's B = 1 + a, W = 1 - a miss by a."""
    args = (schedule, pipe, microbatches, repeats, kept, attention_share)
    shape = np.broadcast_shapes(*(np.shape(a) for a in args))
    sched, p, m, r, k, a = (np.broadcast_to(np.atleast_1d(x), shape or (1,)) for x in args)
    out = np.asarray(bubble(sched, p, m, r), float).copy()
    for idx in zip(*np.nonzero(own_gradients(sched) & pipelined(p, m))):
        name = SCHEDULES[int(sched[idx])]
        out[idx] = _lockstep_bubble(name, int(p[idx]), int(m[idx]), int(r[idx]) if name == "interleaved_1f1b" else 1,
                                    bool(k[idx]), round(float(a[idx]), 3))
    return out.reshape(shape)


def buffer_slots(schedule: Any, pipe: Any, microbatches: Any, repeats: Any) -> Any:
    """[B/M, T, D] buffers a table schedule's tick loop carries per device: the `Table`'s
    activation and cotangent slots (the max over stages) plus one trash slot each. 1F1B keeps at
    most 2P - 1 stage inputs, interleaved vP + P - 1 chunk inputs (Megatron's in-flight count),
    ZB-H1 P + 1 inputs and P cotangents (a W keeps both); fewer when M is smaller. The tests hold
    this equal to the tables'."""
    sched, p, m, r = (np.asarray(a) for a in (schedule, pipe, microbatches, repeats))
    v = np.where(sched == INTERLEAVED, r, 1)
    act = np.where(sched == ZB_H1, np.minimum(m, p + 1), np.minimum(v * m, v * p + p - 1))
    cot = np.where(sched == ZB_H1, np.where(p > 1, p, 2), 1)
    return act + cot + 2


def residual_slots(schedule: Any, pipe: Any, microbatches: Any, repeats: Any) -> Any:
    """Chunk residuals a table schedule keeps from F to B (`Table.res_slots`, the max over stages),
    vectorised: 1F1B min(M, 2P - 1), interleaved min(vM, vP + P - 1) (in the lockstep tick a
    stage runs an F and a B, so stage 0 runs P - 1 F's more than Megatron's P in flight before
    its first B), ZB-H1 min(M, P + 1) (to its W); plus one where an idle F finds every slot live
    (fewer microbatches than that bound; ZB-H1 always)."""
    sched, p, m, r = (np.asarray(a) for a in (schedule, pipe, microbatches, repeats))
    v = np.where(sched == INTERLEAVED, r, 1)
    bound = np.where(sched == ZB_H1, p + 1, v * p + p - 1)
    return np.minimum(v * m, bound) + ((v * m < bound) | (sched == ZB_H1))


def stage_padding(units: int, stages: int, repeats: int = 1) -> int | None:
    """Uneven stages: identity slots that pad a stack of `units` to a multiple of P*R (at its end,
    pipeline.to_stages); None when that would leave a stage with padding only."""
    ok, padding = stages_fill(units, stages, repeats)
    return int(padding) if ok else None


def stages_fill(units: Any, stages: Any, repeats: Any) -> tuple[Any, Any]:
    """(every stage holds a real layer, padding slots), vectorised."""
    chunks = np.asarray(stages) * np.asarray(repeats)
    padding = -np.asarray(units) % chunks
    return padding < -(-np.asarray(units) // chunks) * np.asarray(repeats), padding


# ----------------------------------------------------------------------------------------------
# The work table of the schedules that compute their own gradients

Op = tuple[int, int, int]  # (stage, chunk, microbatch)


def _one_f_one_b_times(p: int, m: int, v: int) -> tuple[dict[Op, int], dict[Op, int]]:
    """Interleaved 1F1B (v = 1: 1F1B): the tick of every F and B, closed form (module docstring)."""
    fwd, bwd = {}, {}
    for i in range(m):
        for c in range(v):
            kf = (i // p) * p * v + c * p + i % p  # forward item: groups of P, chunks in order
            kb = (i // p) * p * v + (v - 1 - c) * p + i % p  # backward item: chunks reversed
            for s in range(p):
                fwd[(s, c, i)] = kf + s
                bwd[(s, c, i)] = kb + v * p + p - 2 - s
    return fwd, bwd


def _zb_h1_times(p: int, m: int) -> tuple[dict[Op, int], dict[Op, int], dict[Op, int]]:
    """ZB-H1 on the unit grid (module docstring): the tick of every F, B and W."""
    b0 = [2 * p - 1]  # stage 0: P F's, P-1 idle ticks, then B(i), F(i+P), W(i) (B, W when F's run out)
    for i in range(m - 1):
        b0.append(b0[-1] + (3 if i + p < m else 2))
    fwd, bwd, wgt = {}, {}, {}
    for s in range(p):
        taken = set()
        for i in range(m):
            bwd[(s, 0, i)] = b0[i] - s
            taken.add(b0[i] - s)
        for i in range(m):
            t = fwd[(s - 1, 0, i)] + 1 if s else 0
            if i >= p - s:  # at most P - s microbatches between F and B (1F1B's in-flight bound)
                t = max(t, bwd[(s, 0, i - (p - s))] + 1)
            while t in taken:
                t += 1
            fwd[(s, 0, i)] = t
            taken.add(t)
        for i in range(m):
            t = max(bwd[(s, 0, i)] + 1, wgt[(s, 0, i - 1)] + 1 if i else 0)
            while t in taken:
                t += 1
            wgt[(s, 0, i)] = t
            taken.add(t)
    return fwd, bwd, wgt


def _colour(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for live intervals [start, end] (inclusive ticks): greedy by start, optimal for an
    interval graph. A slot freed at tick e is reused from tick e + 1: within a tick, arrivals and
    F's inputs are written before the tick's ops read, so an interval ending at t must not share
    a slot with one starting at t."""
    free: list[int] = []
    ends: list[tuple[int, int]] = []  # (end, slot)
    slot_of, n = {}, 0
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for e, sl in sorted(ends):
            if e < start:
                free.append(sl)
                ends.remove((e, sl))
        if free:
            sl = min(free)
            free.remove(sl)
        else:
            sl, n = n, n + 1
        slot_of[key] = sl
        ends.append((end, sl))
    return slot_of, n


@dataclass(frozen=True)
class Table:
    """A table schedule's work, as int arrays [ticks, P] the traced tick loop indexes.

    f_*, b_*, w_*: busy (0/1), chunk, microbatch and buffer slots of the F, B and W op of stage s
    at tick t (idle: busy 0, the rest 0). Activations (a stage chunk's input) live in `act_slots`
    slots from arrival (stage 0's chunk 0: its F) to their last use (B, or W when split);
    cotangents (a chunk output's) in `cot_slots` slots from arrival (the last chunk: the head, in
    its F's tick) to their last use. `recv_f` / `recv_b`: the slot the activation / cotangent
    received at the start of tick t goes to (`act_slots` / `cot_slots`: a trash slot, nothing
    arrived). `f_act` of an idle F and `f_cot` but on the head's tick: the trash slot (the tick loop writes them
    unconditionally). `f_res` / `b_res`: the slot of the residuals an F keeps for its B, live
    from the F's tick to the B's (W's when split); an idle F's: a slot free at its tick
    (residual_slots)."""

    stages: int
    chunks: int
    microbatches: int
    split: bool  # B is the input gradient only and W the weight gradient (zero bubble)
    ticks: int
    act_slots: int
    cot_slots: int
    res_slots: int  # kept VJP residuals (parallel/residuals.py), from an F to its B (W when split)
    arrays: dict[str, np.ndarray] = field(repr=False)
    times: dict[str, dict[Op, int]] = field(repr=False)  # 'F', 'B', 'W' -> {(s, c, i): tick}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


@functools.lru_cache(maxsize=256)
def make_table(name: str, p: int, m: int, v: int = 1) -> Table:
    """The table of schedule `name` on P stages, M microbatches, v chunks per stage (cached: a
    Table is read-only by convention, its arrays are not to be written)."""
    if name == "zb_h1":
        fwd, bwd, wgt = _zb_h1_times(p, m)
    else:
        fwd, bwd = _one_f_one_b_times(p, m, v)
        wgt = {}
    split = bool(wgt)
    last = bwd if not split else wgt
    n_ticks = 1 + max(max(fwd.values()), max(last.values()))

    def producer(s: int, c: int) -> tuple[int, int] | None:  # the chunk whose output feeds (s, c)
        return (s - 1, c) if s > 0 else ((p - 1, c - 1) if c > 0 else None)

    def consumer(s: int, c: int) -> tuple[int, int] | None:  # the chunk that takes (s, c)'s output
        return (s + 1, c) if s < p - 1 else ((0, c + 1) if c < v - 1 else None)

    act_iv, cot_iv, res_iv = {s: [] for s in range(p)}, {s: [] for s in range(p)}, {s: [] for s in range(p)}
    arrive_f, arrive_b = {}, {}  # (t, s) -> op whose data arrives then
    for (s, c, i), t in fwd.items():
        src = producer(s, c)
        start = t if src is None else fwd[(*src, i)] + 1
        if src is not None:
            arrive_f[(start, s)] = (s, c, i)
        act_iv[s].append((start, last[(s, c, i)], (s, c, i)))
        res_iv[s].append((t, last[(s, c, i)], (s, c, i)))
        dst = consumer(s, c)
        cstart = t if dst is None else bwd[(*dst, i)] + 1
        if dst is not None:
            arrive_b[(cstart, s)] = (s, c, i)
        cot_iv[s].append((cstart, last[(s, c, i)], (s, c, i)))
    act_slot, cot_slot, res_slot, n_act, n_cot, n_res = {}, {}, {}, 0, 0, 0
    for s in range(p):
        a, na = _colour(act_iv[s])
        g, ng = _colour(cot_iv[s])
        r, nr = _colour(res_iv[s])
        act_slot.update(a)
        cot_slot.update(g)
        res_slot.update(r)
        n_act, n_cot, n_res = max(n_act, na), max(n_cot, ng), max(n_res, nr)

    arrays = {k: np.zeros((n_ticks, p), np.int32) for k in (
        "f_busy", "f_chunk", "f_mb", "f_act", "f_cot", "b_busy", "b_chunk", "b_mb", "b_act", "b_cot",
        "w_busy", "w_chunk", "w_mb", "w_act", "w_cot", "f_res", "b_res", "w_res")}
    arrays["f_act"][:] = n_act  # an idle F's input write goes to the trash slot too
    arrays["f_cot"][:] = n_cot
    arrays["recv_f"] = np.full((n_ticks, p), n_act, np.int32)
    arrays["recv_b"] = np.full((n_ticks, p), n_cot, np.int32)
    for kind, times in (("f", fwd), ("b", bwd), ("w", wgt)):
        for (s, c, i), t in times.items():
            assert not arrays[f"{kind}_busy"][t, s], (kind, t, s)
            for key, value in (("busy", 1), ("chunk", c), ("mb", i), ("act", act_slot[(s, c, i)]),
                               ("cot", cot_slot[(s, c, i)]), ("res", res_slot[(s, c, i)])):
                if kind == "f" and key == "cot":
                    value = cot_slot[(s, c, i)] if consumer(s, c) is None else n_cot
                arrays[f"{kind}_{key}"][t, s] = value
    # An idle F writes its (zero) residuals unconditionally too: into a slot free at that tick
    # (no trash slot: one would hold a whole chunk's residuals), or, where every slot is live
    # (M < 2P - 1 in 1F1B: stage 0 waits on all M), into one more
    for s in range(p):
        live = np.zeros((n_ticks, n_res), bool)
        for (ss, c, i), t in fwd.items():
            if ss == s:
                live[t:last[(s, c, i)] + 1, res_slot[(s, c, i)]] = True
        for t in range(n_ticks):
            if not arrays["f_busy"][t, s]:
                free = np.flatnonzero(~live[t])
                arrays["f_res"][t, s] = free[0] if free.size else n_res
    n_res += int((arrays["f_res"] == n_res).any())
    for (t, s), op in arrive_f.items():
        arrays["recv_f"][t, s] = act_slot[op]
    for (t, s), op in arrive_b.items():
        arrays["recv_b"][t, s] = cot_slot[op]
    for a in arrays.values():
        a.setflags(write=False)  # cached and shared: read-only
    return Table(p, v, m, split, n_ticks, n_act, n_cot, n_res, arrays, {"F": fwd, "B": bwd, "W": wgt})


# ----------------------------------------------------------------------------------------------
# A pipeline schedule


@dataclass(frozen=True)
class Schedule:
    stages: int  # P
    microbatches: int  # M
    repeats: int = 1  # R (chunks per stage: circular's repeats, interleaved's v)
    name: str = "gpipe"
    units: int = 0  # U, the scanned stack's length; 0: a multiple of R*P (no padding)

    @property
    def chunk_units(self) -> int:
        """Lc: units per chunk, the stack padded up to a multiple of R*P (uneven stages)."""
        return -(-self.units // (self.repeats * self.stages))

    @property
    def padding(self) -> int:
        """Identity slots appended to the stack so that R*P chunks split it evenly."""
        return self.chunk_units * self.repeats * self.stages - self.units if self.units else 0

    @property
    def own_gradients(self) -> bool:
        return self.name in ("1f1b", "interleaved_1f1b", "zb_h1")

    @property
    def ticks(self) -> int:
        if self.own_gradients:
            return self.table().ticks
        return int(ticks(SCHEDULES.index(self.name), self.stages, self.microbatches, self.repeats))

    def table(self) -> Table:
        """The work table (1F1B, interleaved, ZB-H1)."""
        return make_table(self.name, self.stages, self.microbatches, self.repeats)

    def work(self, tick: int, stage: int) -> tuple[bool, int, int]:
        """(busy, microbatch, repeat) of `stage` at `tick` (GPipe/circular): stage s at tick t
        works on item k = t - s of its queue, which visits microbatches in groups of P, each
        group going round the ring R times."""
        p, r, m = self.stages, self.repeats, self.microbatches
        k = tick - stage
        if not 0 <= k < r * m:
            return False, 0, 0
        group, rest = divmod(k, r * p)
        return True, group * p + rest % p, rest // p

    def idle_stage_ticks(self) -> int:
        return sum(not self.work(t, s)[0] for t in range(self.ticks) for s in range(self.stages))

    def bubble_fraction_at(self, costs: dict[str, float]) -> float:
        """1 - ideal / total time of a table schedule with op costs `costs` ('F', 'B', 'W', in any
        unit): ticks in lockstep, each as long as its busiest stage's ops."""
        tab = self.table()
        per_stage = tab.chunks * tab.microbatches * (costs["F"] + costs["B"] + (costs["W"] if tab.split else 0))
        load = sum(tab[f"{k}_busy"] * costs[k.upper()] for k in ("f", "b", "w"))  # [ticks, P]
        return 1 - per_stage / float(load.max(axis=1).sum())

    @property
    def bubble_fraction(self) -> float:
        """Idle over total stage time, counted from the schedule table itself.

        GPipe/circular run a forward loop and a backward loop of `ticks` ticks each: idle
        stage-ticks over stage-ticks. Table schedules: `bubble_fraction_at(TABLE_COSTS[name])`.
        """
        if self.own_gradients:
            return self.bubble_fraction_at(TABLE_COSTS[self.name])
        return self.idle_stage_ticks() / (self.ticks * self.stages)

    def formula(self) -> float:
        return float(bubble(SCHEDULES.index(self.name), self.stages, self.microbatches, self.repeats))
