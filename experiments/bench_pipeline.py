"""Benchmark: pipeline memory (1F1B, interleaved 1F1B, ZB-H1 against GPipe), the schedule tables'
bubble against the formulas, the compiled cost of a split backward, and the bubble against m.

    python experiments/bench_pipeline.py                  # full run, ~5-8 minutes on a 2-core CPU
    python experiments/bench_pipeline.py --tiny           # ~1 minute; what tests/test_bench_pipeline.py runs
    python experiments/bench_pipeline.py --json out.json  # also write every figure as JSON
    python experiments/bench_pipeline.py --out DIR        # the PNG goes to DIR (default experiments/results)

A script, not a timed test: it prints figures and PASS/FAIL against the target and exits 0 either
way (a nonzero exit means it crashed). It simulates 8 CPU devices (before JAX is imported,
--xla_force_host_platform_device_count=8 is added to XLA_FLAGS unless a device count is already
there; --tiny also adds --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true,
which halves compile time and leaves the compiled memory figures unchanged, but makes the tiny
timings unrepresentative) and uses the mesh data=2 x pipe=4 throughout: p = 4 stages, each
microbatch split over 2 data shards. On a GPU/TPU host run it with JAX_PLATFORMS=cpu.

Model (full): a llama-like Transformer, d_model 128, 8 layers, 4 heads, d_ff 512, vocab 256,
seq 128, float32; every microbatch holds `--rows` rows per data shard (default 1), so the global
batch is m * 2 * rows.

[1] Memory (target: temp(1f1b) / temp(gpipe) <= 0.5 at m = 8p = 32, both with remat none).
    The train step (`make_train_step`) is lowered against the abstract state (ShapeDtypeStructs
    carrying `layout.state_shardings`) and an abstract batch, compiled, and XLA's
    `compiled.memory_analysis()` read: temp (scratch: activations saved for the backward, loop
    buffers, ...), argument, output and alias bytes. These are for the per-device SPMD program,
    i.e. per device. Compiled: gpipe (remat none), gpipe (remat full), circular (repeats 2, remat
    none), 1f1b, interleaved_1f1b (v = 2) and zb_h1 (remat none: each keeps its F's residuals
    until B, or W: schedules.residual_slots). Reported: temp 1f1b, interleaved and zb_h1 over gpipe
    (target <= 0.5 each), zb_h1 over 1f1b (target <= 1.1), and temp 1f1b / gpipe with full remat.

[3] Tables (no compile): ticks and bubble of every schedule's table at p = 4, m in the timed ms and
    8p, against the formula; the table schedules also with their ticks in lockstep under the op
    costs measured in [4] (ZB-H1's table assumes F:B:W = 1:1:1, its compiled ops are not).

[4] Op costs: XLA cost_analysis flops of one stage chunk's F, 1F1B's B, ZB-H1's B and W (jitted on
    one device, compiled, not run), from F's residuals and recomputing the chunk; ZB-H1's work per
    microbatch over 1F1B's, and 1F1B's from F's residuals over recomputing.
    Memory figures do not depend on machine load.

[2] Bubble against m. For gpipe, circular (repeats 2) and 1f1b at p = 4 and a fixed microbatch
    size, the train step is compiled for each m in {4, 8, 16} (tiny: {4, 8}), warmed up, then
    timed in interleaved rounds (every configuration once per round, order reversed every other
    round, so load drift hits all alike; one step per sample, `block_until_ready`); the median is
    kept. Per schedule, step_time = a * m + c is fitted by least squares, and the measured bubble
    is bubble(m) = c / (a * m + c): the share of the step that does not grow with m. It is
    printed beside `Schedule.formula()` = (p-1) / (r m + p - 1) and `Schedule.bubble_fraction`
    (idle over total stage time counted from the schedule table). The same fit on process CPU
    time is printed as a second opinion. The compiled temp memory of every timed step is also
    printed (memory against m). The state is initialised once (`init_state`) and reshaped into
    each schedule's stage layout, so the first step of every schedule (m = 4, same batch) starts
    from the same parameters: their losses must agree (printed, a correctness check).

    READ THIS before comparing with the formula: the 8 "devices" are threads sharing this host's
    cores, so a stage that waits does not leave a core idle (another stage's work runs on it).
    What is measured is therefore the fill/drain cost in *executed work*, not parallel idle
    time as on real accelerators. GPipe and circular compute masked (thrown-away) work in their
    bubble ticks, so their executed work follows the formula; 1F1B skips idle halves of a tick
    with `lax.cond`, so on CPU what its fit calls a bubble is only per-step fixed cost (the
    optimizer update, dispatch, the conditionals, ring sends and buffer writes of empty ticks:
    near zero when B recomputed the chunk, 0.14-0.39 since F keeps its residuals, 2026-12-07),
    whereas on real devices its bubble is the formula's. The fixed cost c also includes the
    optimizer update and per-step dispatch for every schedule, which pushes every measured bubble
    up a little. Timing on a loaded machine is noisy; the memory figures are not.

The PNG (matplotlib, Agg) has the measured bubble against m per schedule (markers) with the
formula (lines) on the left, and compiled temp memory per device against m on the right.
"""

from __future__ import annotations

import os
import sys


def _xla_flags(tiny: bool) -> str:
    """XLA_FLAGS with 8 simulated CPU devices (unless a device count is already set); with --tiny,
    also cheaper LLVM code generation (halves compile time; compiled memory figures unchanged)."""
    flags = os.environ.get("XLA_FLAGS", "")
    extra = ["--xla_force_host_platform_device_count=8"]
    if tiny:
        extra += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    for flag in extra:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    return flags


os.environ["XLA_FLAGS"] = _xla_flags("--tiny" in sys.argv[1:])  # before JAX is imported

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from parallax.train.build import build  # noqa: E402
from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from parallax.parallel.mesh import describe, make_mesh  # noqa: E402
from parallax.model.transformer import count_params  # noqa: E402
from parallax.parallel.pipeline import stage_fn  # noqa: E402
from parallax.parallel.split_backward import Split  # noqa: E402
from parallax.parallelism import Schedule  # noqa: E402
from parallax.train.train_state import init_state  # noqa: E402
from parallax.train.train_step import batch_sharding  # noqa: E402

DATA, PIPE = 2, 4
MEMORY_TARGET = 0.5
MEMORY_M = 8 * PIPE  # m = 8p
MIB = 2**20


@dataclass(frozen=True)
class Case:
    label: str
    schedule: str
    remat: str = "none"
    repeats: int = 1


MEMORY_CASES = (
    Case("gpipe", "gpipe"),
    Case("gpipe_remat_full", "gpipe", remat="full"),
    Case("circular_r2", "circular", repeats=2),
    Case("circular_r2_remat_full", "circular", remat="full", repeats=2),
    Case("1f1b", "1f1b"),
    Case("1f1b_remat_full", "1f1b", remat="full"),  # B recomputes the chunk: the memory-first 1F1B
    Case("interleaved_r2", "interleaved_1f1b", repeats=2),
    Case("zb_h1", "zb_h1"),
)
# the table schedules against GPipe (target <= 0.5), and ZB-H1 against 1F1B (target <= 1.1)
MEMORY_RATIOS = (("1f1b", "gpipe", MEMORY_TARGET), ("interleaved_r2", "gpipe", MEMORY_TARGET),
                 ("zb_h1", "gpipe", MEMORY_TARGET), ("zb_h1", "1f1b", 1.1))
TABLE_CASES = (Case("gpipe", "gpipe"), Case("circular_r2", "circular", repeats=2), Case("1f1b", "1f1b"),
               Case("interleaved_r2", "interleaved_1f1b", repeats=2), Case("zb_h1", "zb_h1"))
BUBBLE_CASES = (Case("gpipe", "gpipe"), Case("circular_r2", "circular", repeats=2), Case("1f1b", "1f1b"),
                Case("zb_h1", "zb_h1"))


def make_config(tiny: bool, case: Case, m: int, rows: int) -> Config:
    if tiny:  # 8 layers: circular needs n_layers divisible by p * r = 8
        model = ModelConfig(d_model=32, n_layers=8, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=256)
        seq = 16
    else:
        model = ModelConfig(d_model=128, n_layers=8, n_heads=4, n_kv_heads=4, d_ff=512, vocab_size=256)
        seq = 128
    return Config(
        name=f"bench_pipeline_{case.label}_m{m}",
        mesh=MeshConfig(data=DATA, pipe=PIPE),
        model=model,
        parallel=ParallelConfig(remat=case.remat, microbatches=m, schedule=case.schedule, repeats=case.repeats),
        train=TrainConfig(steps=1000, global_batch=m * DATA * rows, seq_len=seq),
    )


def compile_step(cfg: Config):
    """(layout, compiled train step, compile seconds), lowered against the abstract state and batch
    on `cfg`'s mesh (data x pipe, the same mesh as main's)."""
    built = build(cfg)
    step, abstract, batch = built.train_step(), built.abstract_state(), built.abstract_batch()
    t0 = time.perf_counter()
    compiled = step.lower(abstract, batch).compile()
    return built.layout, compiled, time.perf_counter() - t0


def memory_figures(compiled) -> dict | None:
    """Bytes per device from XLA's memory analysis; None where the backend gives none."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # some backends raise instead of returning None
        return None
    if ma is None:
        return None
    fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    out = {f.replace("_size_in_bytes", "_bytes"): getattr(ma, f, None) for f in fields}
    if out["temp_bytes"] is None:
        return None
    return out


def fmt_mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / MIB:8.2f} MiB"


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "FAIL"


# ----------------------------------------------------------------------------------------------
# [1] memory


def bench_memory(tiny: bool, rows: int, mesh) -> dict:
    out = {}
    for case in MEMORY_CASES:
        if tiny and case.label in ("circular_r2_remat_full", "1f1b_remat_full"):  # a smoke run
            continue
        cfg = make_config(tiny, case, MEMORY_M, rows)
        _, compiled, seconds = compile_step(cfg)
        mem = memory_figures(compiled)
        out[case.label] = {"memory": mem, "compile_s": seconds}
        if mem is None:
            print(f"  {case.label:<18} memory_analysis unavailable on this backend (compile {seconds:.1f} s)")
        else:
            print(f"  {case.label:<18} temp {fmt_mib(mem['temp_bytes'])}  argument {fmt_mib(mem['argument_bytes'])}  "
                  f"output {fmt_mib(mem['output_bytes'])}  alias {fmt_mib(mem['alias_bytes'])}  "
                  f"(compile {seconds:.1f} s)")
    return out


def temp_ratio(mem: dict, a: str, b: str) -> float | None:
    ma, mb = mem[a]["memory"], mem[b]["memory"]
    if ma is None or mb is None or not mb["temp_bytes"]:
        return None
    return ma["temp_bytes"] / mb["temp_bytes"]


# ----------------------------------------------------------------------------------------------
# [2] bubble against m


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, c) of y = a x + c."""
    a, c = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(c)


def bench_bubble(tiny: bool, rows: int, ms: list[int], mesh, warmup: int, rounds: int) -> dict:
    runs = []  # (case, m, compiled, batch)
    states = {}  # one state per schedule: its shape does not depend on m; threaded through (donated)
    host_state = None  # initialised once; every stage layout is a reshape of the layer-major stack
    mem = {}
    batches = {}
    for case in BUBBLE_CASES:
        for m in ms:
            cfg = make_config(tiny, case, m, rows)
            layout, compiled, seconds = compile_step(cfg)
            if host_state is None:
                host_state = jax.device_get(init_state(cfg, layout))
            if case.label not in states:
                # [R, P, Lc, ...] stage layouts of the same layer-major stack differ by a reshape
                # (pipeline.to_stages), for the parameters and the Adam moments alike.
                states[case.label] = jax.tree.map(
                    lambda h, a, sh: jax.device_put(np.reshape(h, a.shape), sh),
                    host_state, layout.abstract_state, layout.state_shardings,
                )
            b, t = cfg.train.global_batch, cfg.train.seq_len
            if m not in batches:  # the same batch for every schedule at one m
                tokens = np.random.default_rng(m).integers(0, cfg.model.vocab_size, size=(b, t + 1), dtype=np.int32)
                batches[m] = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, batch_sharding(mesh))
            batch = batches[m]
            mem[(case.label, m)] = memory_figures(compiled)
            runs.append((case, m, compiled, batch))
            temp = mem[(case.label, m)]
            print(f"  compiled {case.label:<12} m={m:<3} batch {b}x{t}  {seconds:5.1f} s  "
                  f"temp {fmt_mib(temp and temp['temp_bytes'])}")

    def one(case, compiled, batch) -> tuple[float, float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        state, metrics = compiled(states[case.label], batch)
        jax.block_until_ready((state, metrics))
        t1, c1 = time.perf_counter(), time.process_time()
        states[case.label] = state
        return t1 - t0, c1 - c0, float(metrics["loss"])

    losses, first_loss = {}, {}
    for case, m, compiled, batch in runs:
        for _ in range(warmup):
            *_, loss = one(case, compiled, batch)
            # The first step of each schedule starts from the same parameters and batch (m = ms[0]).
            first_loss.setdefault(case.label, loss)
        losses[(case.label, m)] = loss
    spread = max(first_loss.values()) - min(first_loss.values())
    print(f"  first-step loss per schedule (same parameters, same batch, m={ms[0]}): "
          + ", ".join(f"{k} {v:.6f}" for k, v in first_loss.items()) + f"; spread {spread:.2e}")
    wall = {(c.label, m): [] for c, m, _, _ in runs}
    cpu = {(c.label, m): [] for c, m, _, _ in runs}
    for r in range(rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        for case, m, compiled, batch in order:
            w, c, _ = one(case, compiled, batch)
            wall[(case.label, m)].append(w)
            cpu[(case.label, m)].append(c)

    result = {}
    for case in BUBBLE_CASES:
        label = case.label
        med = [statistics.median(wall[(label, m)]) for m in ms]
        med_cpu = [statistics.median(cpu[(label, m)]) for m in ms]
        a, c = fit_line(ms, med)
        a_cpu, c_cpu = fit_line(ms, med_cpu)
        rows_out = []
        for i, m in enumerate(ms):
            sched = Schedule(PIPE, m, case.repeats, case.schedule)
            temp = mem[(label, m)]
            rows_out.append({
                "m": m,
                "step_ms": 1e3 * med[i],
                "step_ms_samples": [1e3 * x for x in wall[(label, m)]],
                "cpu_ms": 1e3 * med_cpu[i],
                "bubble_measured": c / (a * m + c),
                "bubble_measured_cpu": c_cpu / (a_cpu * m + c_cpu),
                "bubble_formula": sched.formula(),
                "bubble_table": sched.bubble_fraction,
                "ticks": sched.ticks,
                "temp_bytes": temp and temp["temp_bytes"],
                "loss_last_warmup": losses[(label, m)],
            })
        temps = [mem[(label, m)] and mem[(label, m)]["temp_bytes"] for m in ms]
        temp_fit = None
        if all(t is not None for t in temps):
            slope, const = fit_line(ms, [t / MIB for t in temps])
            temp_fit = {"mib_per_microbatch": slope, "mib_fixed": const}
        result[label] = {
            "schedule": case.schedule, "repeats": case.repeats, "remat": case.remat,
            "temp_fit_mib": temp_fit,
            "fit_ms": {"a_per_microbatch": 1e3 * a, "c_fixed": 1e3 * c},
            "fit_cpu_ms": {"a_per_microbatch": 1e3 * a_cpu, "c_fixed": 1e3 * c_cpu},
            "points": rows_out,
            "first_step_loss": first_loss[label],
        }
    return result


# ----------------------------------------------------------------------------------------------
# [3] the tables against the formulas; [4] the compiled cost of each op


def bench_tables(ms: list[int], costs: dict[str, float] | None) -> dict:
    """Ticks and bubble of every schedule at p = PIPE from its table, against the formula; the
    table schedules also with their ticks in lockstep under the compiled op costs `costs`
    (section [4]), where they differ from the tick model's."""
    out = {}
    for case in TABLE_CASES:
        for m in ms:
            sched = Schedule(PIPE, m, case.repeats, case.schedule)
            row = {"ticks": sched.ticks, "table": sched.bubble_fraction, "formula": sched.formula()}
            if sched.own_gradients and costs is not None:
                split = {"F": costs["F"], "B": costs["B_split" if case.schedule == "zb_h1" else "B"],
                         "W": costs["W"] if case.schedule == "zb_h1" else 0}
                row["lockstep_compiled_costs"] = sched.bubble_fraction_at(split)
            out[f"{case.label}_m{m}"] = row
    return out


def bench_op_costs(tiny: bool) -> dict:
    """XLA's flop count (cost_analysis, one device) of the ops a stage chunk runs per microbatch at
    m = 8p: F (the forward, keeping its VJP's residuals), and from F's residuals (the table
    schedules under remat none: parallelism.keeps_residuals) 1F1B's B (input and weight
    gradients), ZB-H1's B (the input gradient) and W (the weight gradients from B's stash:
    parallel/split_backward.py); then the same three recomputing the chunk from its input first
    (`*_recompute`: what the table schedules run under remat full). Compiled, not run."""
    cfg = make_config(tiny, Case("zb_h1", "zb_h1"), MEMORY_M, 1)
    built = build(cfg)
    layout = built.layout
    stage = stage_fn(layout.model)
    params = layout.abstract_state.params["layers"]
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), params)  # one stage: [Lc, ...]
    x = jax.ShapeDtypeStruct((1, cfg.train.seq_len, cfg.model.d_model), np.float32)  # [b, T, D], one row

    def fwd(w, h):
        return stage(w, h)[0]

    def vjp_all(w, h):
        y, back = jax.vjp(fwd, w, h)
        return back(y)

    def vjp_input(w, h):
        y, back = jax.vjp(lambda hh: fwd(w, hh), h)
        return back(y)

    def vjp_weights(w, h):
        y, back = jax.vjp(lambda ww: fwd(ww, h), w)
        return back(y)

    # From F's residuals: the VJP function's leaves are the arguments (jax.vjp's Partial)
    kept = jax.eval_shape(lambda w, h: jax.vjp(fwd, w, h)[1], chunk, x)
    leaves, tree = jax.tree.flatten(kept)

    def kept_vjp(pick):
        return lambda res, ct: pick(jax.tree.unflatten(tree, res)(ct))

    def cost_of(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("flops", 0.0)) if cost else 0.0

    # ZB-H1's B and W from F's residuals: the backward's jaxpr split by outputs, as the pipeline
    # runs them (parallel/split_backward.py), W reading B's stash
    def split_of(res, ct):
        return Split.of(lambda r, c: jax.tree.unflatten(tree, r)(c), (res, ct),
                        lambda out: (jax.tree.map(lambda _: True, out[0]), jax.tree.map(lambda _: False, out[1])))

    b_side = lambda res, ct: split_of(res, ct).b((res, ct))  # noqa: E731
    stash = jax.eval_shape(lambda res, ct: b_side(res, ct)[1], leaves, x)
    flops = {"F": cost_of(lambda w, h: jax.vjp(fwd, w, h), chunk, x), "B": cost_of(kept_vjp(lambda g: g), leaves, x),
             "B_split": cost_of(b_side, leaves, x),
             "W": cost_of(lambda res, ct, st: split_of(res, ct).w((res, ct), st), leaves, x, stash)}
    for name, fn in (("B_recompute", vjp_all), ("B_split_recompute", vjp_input), ("W_recompute", vjp_weights)):
        flops[name] = cost_of(fn, chunk, x)
    return flops


# ----------------------------------------------------------------------------------------------
# Plot


def plot(bubble: dict, mem: dict, ms: list[int], path: Path, note: str, tables: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = {"gpipe": "tab:blue", "circular_r2": "tab:green", "1f1b": "tab:red", "gpipe_remat_full": "tab:purple",
              "circular_r2_remat_full": "tab:olive", "interleaved_r2": "tab:orange", "zb_h1": "tab:brown",
              "1f1b_remat_full": "tab:pink"}
    styles = {"gpipe": "-", "circular_r2": "-.", "1f1b": "--"}
    names = {"gpipe": "GPipe", "circular_r2": "circular (r=2)", "1f1b": "1F1B", "gpipe_remat_full": "GPipe, remat full",
             "circular_r2_remat_full": "circular (r=2), remat full", "interleaved_r2": "interleaved 1F1B (v=2)",
             "1f1b_remat_full": "1F1B, remat full",
             "zb_h1": "ZB-H1"}
    fig, (ax, ax_mem) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.5, 1]})
    grid = np.linspace(min(ms), max(ms), 200)
    handles = []
    for label, res in bubble.items():
        color, r, pts = colors.get(label, "k"), res["repeats"], res["points"]
        xs = [p["m"] for p in pts]
        if label != "zb_h1":  # (its formula is drawn below, with its table's squares)
            (line,) = ax.plot(grid, (PIPE - 1) / (r * grid + PIPE - 1), styles.get(label, "-"), color=color, lw=1.5,
                              label=f"{names.get(label, label)}  (formula (p-1)/({'' if r == 1 else r}m+p-1))")
            handles.append(line)
        ax.plot(xs, [p["bubble_measured"] for p in pts], "o", color=color, ms=7)
        ax.plot(xs, [p["bubble_measured_cpu"] for p in pts], "x", color=color, ms=7, mew=1.5)
        # memory against m: the timed steps plus the m = 8p point of section [1]
        mem_pts = [(p["m"], p["temp_bytes"]) for p in pts]
        if label in mem and mem[label]["memory"] is not None and MEMORY_M not in xs:
            mem_pts.append((MEMORY_M, mem[label]["memory"]["temp_bytes"]))
        if all(t is not None for _, t in mem_pts):
            ax_mem.plot([m for m, _ in mem_pts], [t / MIB for _, t in mem_pts], "o" + styles.get(label, "-"),
                        color=color, label=names.get(label, label))
    for label, marker in (("gpipe_remat_full", "s"), ("circular_r2_remat_full", "D"), ("interleaved_r2", "^"),
                          ("zb_h1", "v"), ("1f1b_remat_full", "P")):
        full = mem.get(label, {}).get("memory")
        if full is not None:
            ax_mem.plot([MEMORY_M], [full["temp_bytes"] / MIB], marker, color=colors[label], ms=7,
                        label=f"{names[label]} (m={MEMORY_M} only)")
    # interleaved (not timed here) and ZB-H1: their formula (line) and their table's count (squares)
    for label, formula, text in (("interleaved_r2", lambda m: (PIPE - 1) / (2 * m + PIPE - 1), "(p-1)/(2m+p-1)"),
                                 ("zb_h1", lambda m: (PIPE - 1) / (3 * m + PIPE - 1), "(p-1)/(3m+p-1), F=B=W")):
        (line,) = ax.plot(grid, formula(grid), ":", color=colors[label], lw=1.5,
                          label=f"{names[label]}  ({text}; squares: table)")
        handles.append(line)
        pts = [(m, tables[f"{label}_m{m}"]["table"]) for m in ms if tables and f"{label}_m{m}" in tables]
        ax.plot([m for m, _ in pts], [b for _, b in pts], "s", color=colors[label], ms=6, mfc="none")
    handles += [
        Line2D([], [], color="0.3", marker="o", ls="", label="measured: wall-clock fit c/(am+c)"),
        Line2D([], [], color="0.3", marker="x", ls="", mew=1.5, label="measured: CPU-time fit"),
    ]
    ax.axhline(0, color="0.6", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.set_xlabel("microbatches per step, m (count)")
    ax.set_ylabel("bubble (fraction of step time)")
    ax.set_title(f"Pipeline bubble vs m, p={PIPE} stages (data={DATA} x pipe={PIPE})", fontsize=11)
    ax.grid(alpha=0.3)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + 0.6 * (hi - lo))  # headroom for the legend above the data
    ax.legend(handles=handles, fontsize=6.5, loc="upper right", ncol=2)
    mem_ms = sorted(set(ms) | {MEMORY_M})
    ax_mem.set_xscale("log", base=2)
    ax_mem.set_xticks(mem_ms, [str(m) for m in mem_ms])
    ax_mem.minorticks_off()
    ax_mem.set_xlabel("microbatches per step, m (count)")
    ax_mem.set_ylabel("compiled temp memory per device (MiB)")
    ax_mem.set_title("XLA temp memory per device vs m (remat none)", fontsize=11)
    ax_mem.grid(alpha=0.3)
    ax_mem.legend(fontsize=8, loc="upper left")
    fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=7, color="0.3")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model, m in {4, 8}, few reps: a ~1 minute smoke run")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help="microbatch counts to time (default 4 8 16; tiny 4 8)")
    ap.add_argument("--rows", type=int, default=1, help="rows per microbatch per data shard (default 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per configuration (default 2; tiny 1)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 7; tiny 3)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), metavar="DIR",
                    help="where pipeline_bubble.png goes (default experiments/results)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON")
    args = ap.parse_args(argv)
    ms = sorted(args.ms or ([4, 8] if args.tiny else [4, 8, 16]))
    warmup = max(1, args.warmup if args.warmup is not None else (1 if args.tiny else 2))
    rounds = args.rounds or (3 if args.tiny else 7)
    if any(m % PIPE for m in ms):
        ap.error(f"--ms: every m must be a multiple of p={PIPE} (the circular schedule needs it)")
    if len(ms) < 2:
        ap.error("--ms: at least two microbatch counts are needed for the fit")

    t_start = time.perf_counter()
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    if len(jax.devices()) < DATA * PIPE:
        print(f"error: needs {DATA * PIPE} devices, found {len(jax.devices())} {jax.devices()[0].platform} device(s); "
              f"run on CPU (JAX_PLATFORMS=cpu) so that XLA_FLAGS can simulate 8", file=sys.stderr)
        return 2
    mesh = make_mesh(MeshConfig(data=DATA, pipe=PIPE))
    cfg0 = make_config(args.tiny, MEMORY_CASES[0], MEMORY_M, args.rows)
    n_params = count_params(cfg0.model)["total"]
    mc = cfg0.model
    print(f"bench_pipeline  {now}  jax {jax.__version__}  python {platform.python_version()}  "
          f"{platform.machine()} ({os.cpu_count()} CPUs)")
    print(f"mesh: {describe(mesh)}   XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"model: d_model {mc.d_model}, {mc.n_layers} layers, {mc.n_heads} heads, d_ff {mc.d_ff}, "
          f"vocab {mc.vocab_size}, seq {cfg0.train.seq_len}, {mc.dtype}: {n_params / 1e6:.2f}M parameters; "
          f"{args.rows} row(s) per microbatch per data shard{'  [--tiny]' if args.tiny else ''}")
    print("note: 8 simulated CPU devices share this host's cores; timings measure executed work, "
          "not parallel idle time (see the docstring).")
    print()

    print(f"[1] memory: compiled train step at m = 8p = {MEMORY_M}, p = {PIPE}, global batch "
          f"{cfg0.train.global_batch} (XLA memory analysis, bytes per device)")
    mem = bench_memory(args.tiny, args.rows, mesh)
    ratio = temp_ratio(mem, "1f1b", "gpipe")
    ratio_full = temp_ratio(mem, "1f1b", "gpipe_remat_full")
    ratio_circ = temp_ratio(mem, "circular_r2", "gpipe")
    ratios = {}
    for a, b, target in MEMORY_RATIOS:
        r_ab = ratios[f"{a}_over_{b}"] = temp_ratio(mem, a, b)
        if r_ab is None:
            print(f"RESULT mem_ratio_{a}_over_{b}  n/a  target <= {target}  "
                  "(compiled.memory_analysis() unavailable on this backend)")
        else:
            print(f"RESULT mem_ratio_{a}_over_{b}  {r_ab:.4f}  target <= {target}  "
                  f"{verdict(r_ab, target)}  (temp bytes per device, remat none, m={MEMORY_M})")
    if ratio_full is not None:
        print(f"RESULT mem_ratio_1f1b_over_gpipe_remat_full  {ratio_full:.4f}  (1f1b remat none / gpipe remat full)")
    ratio_both_full = temp_ratio(mem, "1f1b_remat_full", "gpipe_remat_full") if "1f1b_remat_full" in mem else None
    if ratio_both_full is not None:
        print(f"RESULT mem_ratio_1f1b_remat_full_over_gpipe_remat_full  {ratio_both_full:.4f}")
    if ratio_circ is not None:
        print(f"RESULT mem_ratio_circular_r2_over_gpipe  {ratio_circ:.4f}")
    print()

    print(f"[4] compiled op costs: XLA cost_analysis flops of one stage chunk on one row (one device, not run)")
    op_costs = bench_op_costs(args.tiny)
    unit = op_costs["F"] or 1.0
    rel = {k: v / unit for k, v in op_costs.items()}
    print("  " + "   ".join(f"{k} {v / 1e6:.2f} MFLOP ({rel[k]:.2f} F)" for k, v in op_costs.items()))
    print(f"RESULT zb_h1_work_over_1f1b  {(rel['F'] + rel['B_split'] + rel['W']) / (rel['F'] + rel['B']):.3f}  "
          "(F + B + W of ZB-H1 over F + B of 1F1B, per chunk and microbatch, compiled flops, from F's residuals)")
    print(f"RESULT zb_h1_work_over_1f1b_recompute  "
          f"{(rel['F'] + rel['B_split_recompute'] + rel['W_recompute']) / (rel['F'] + rel['B_recompute']):.3f}  "
          "(the same, B and W recomputing the chunk: remat full)")
    print(f"RESULT 1f1b_work_kept_over_recompute  {(rel['F'] + rel['B']) / (rel['F'] + rel['B_recompute']):.3f}  "
          "(1F1B's F + B from F's residuals over recomputing the chunk in B)")
    print()
    table_ms = sorted(set(ms) | {MEMORY_M})
    print(f"[3] tables: ticks and bubble at p = {PIPE} from each schedule's table against the formula "
          f"(tick model: F:B = 1:2; ZB-H1 F:B:W = 1:1:1); lockstep = the same table under the compiled op costs of [4]")
    tables = bench_tables(table_ms, rel)
    for key, row in tables.items():
        extra = f"  lockstep {row['lockstep_compiled_costs']:.3f}" if "lockstep_compiled_costs" in row else ""
        print(f"RESULT table_{key}  ticks {row['ticks']}  table {row['table']:.4f}  formula {row['formula']:.4f}{extra}")
    print()

    print(f"[2] bubble vs m: p = {PIPE}, m in {ms}, {args.rows} row(s) per microbatch per data shard, "
          f"{warmup} warm-up step(s), median of {rounds} interleaved rounds")
    bubble = bench_bubble(args.tiny, args.rows, ms, mesh, warmup, rounds)
    print()
    print(f"  {'schedule':<12} {'m':>3} {'ticks':>5} {'step ms':>9} {'cpu ms':>9} {'temp MiB':>9} "
          f"{'measured':>9} {'meas.cpu':>9} {'formula':>8} {'table':>7}")
    for label, res in bubble.items():
        for p in res["points"]:
            temp = "n/a" if p["temp_bytes"] is None else f"{p['temp_bytes'] / MIB:.2f}"
            print(f"  {label:<12} {p['m']:>3} {p['ticks']:>5} {p['step_ms']:>9.1f} {p['cpu_ms']:>9.1f} {temp:>9} "
                  f"{p['bubble_measured']:>9.3f} {p['bubble_measured_cpu']:>9.3f} "
                  f"{p['bubble_formula']:>8.3f} {p['bubble_table']:>7.3f}")
        f, fc = res["fit_ms"], res["fit_cpu_ms"]
        print(f"  {label:<12} fit: step = {f['a_per_microbatch']:.1f} ms * m + {f['c_fixed']:.1f} ms   "
              f"(CPU time: {fc['a_per_microbatch']:.1f} ms * m + {fc['c_fixed']:.1f} ms)")
        if res["temp_fit_mib"] is not None:
            tf = res["temp_fit_mib"]
            print(f"  {label:<12} fit: temp = {tf['mib_per_microbatch']:.2f} MiB * m + {tf['mib_fixed']:.2f} MiB per device")
    for label, res in bubble.items():
        for p in res["points"]:
            print(f"RESULT bubble_{label}_m{p['m']}  measured {p['bubble_measured']:.3f}  "
                  f"formula {p['bubble_formula']:.3f}  table {p['bubble_table']:.3f}")
    # ZB-H1 against 1F1B, side by side in the same rounds: the same work (the split backward);
    # on simulated CPU devices an idle stage's op is skipped, so this is work and per-tick overhead
    # (ZB-H1 runs 3M + P - 1 ticks to 1F1B's M + 2P - 2), not the bubble a pod would see
    for zp, op in zip(bubble["zb_h1"]["points"], bubble["1f1b"]["points"]):
        print(f"RESULT step_ratio_zb_h1_over_1f1b_m{zp['m']}  {zp['step_ms'] / op['step_ms']:.3f}  "
              f"(wall; CPU time {zp['cpu_ms'] / op['cpu_ms']:.3f})")
    print("  (measured = c / (a m + c) from the wall-clock fit; on simulated CPU devices this is the fill/drain")
    print("   cost in executed work: GPipe/circular compute masked work in their bubble, 1F1B skips idle halves")
    print("   with lax.cond, so its CPU figure is per-step fixed cost, while on real accelerators it would follow the formula)")

    png = Path(args.out) / "pipeline_bubble.png"
    note = (f"{'tiny model' if args.tiny else 'd_model 128, 8 layers, seq 128'}, {args.rows} row/microbatch/shard; "
            f"8 simulated CPU devices on {os.cpu_count()} cores: measured = executed fill/drain work, "
            f"not parallel idle time; jax {jax.__version__}, {now[:10]}")
    plot(bubble, mem, ms, png, note, tables)
    print()
    print(f"wrote {png} ({png.stat().st_size} bytes)")
    total = time.perf_counter() - t_start
    print(f"total {total:.1f} s")

    if args.json:
        figures = {
            "date": now, "jax": jax.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "tiny": args.tiny, "mesh": {"data": DATA, "pipe": PIPE}, "rows_per_microbatch_per_shard": args.rows,
            "model": {"d_model": mc.d_model, "n_layers": mc.n_layers, "n_heads": mc.n_heads, "d_ff": mc.d_ff,
                      "vocab_size": mc.vocab_size, "seq_len": cfg0.train.seq_len, "params": n_params},
            "memory_m": MEMORY_M, "memory": mem,
            "mem_ratio_1f1b_over_gpipe": ratio, "mem_ratio_1f1b_over_gpipe_remat_full": ratio_full,
            "mem_ratio_circular_r2_over_gpipe": ratio_circ, "memory_target": MEMORY_TARGET,
            "mem_ratios": ratios, "op_flops": op_costs, "tables": tables,
            "memory_verdict": None if ratio is None else verdict(ratio, MEMORY_TARGET),
            "bubble_ms": ms, "warmup": warmup, "rounds": rounds, "bubble": bubble,
            "png": str(png), "total_s": total,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
