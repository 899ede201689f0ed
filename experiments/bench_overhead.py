"""Benchmark: what parallax's step machinery costs on one device, and what depth costs to compile.

    python experiments/bench_overhead.py                 # full run, ~2 minutes on a 2-core CPU
    python experiments/bench_overhead.py --tiny          # ~15 s; what tests/test_bench_overhead.py runs
    python experiments/bench_overhead.py --json out.json # also write the figures as JSON

A script, not a timed test: it prints figures and PASS/FAIL against the targets and exits 0 either
way (a nonzero exit means it crashed). Everything runs on ONE device (a data=1 mesh over the first
device), so no collective is involved and any difference is the step machinery itself. Run it on an
otherwise idle machine: on a shared 2-core CPU other processes move single rounds by 2x, and
the paired ratio below is what keeps the figure usable there.

[1] Step overhead (target: parallax / plain <= 1.03 per step).
    - parallax: `make_train_step(cfg, layout)`: explicit in/out shardings, logical-name activation
      constraints, TrainState, donated state, metrics (loss, grad norm, lr).
    - plain: a hand-written `jax.jit` of value_and_grad + the same optax chain (`make_optimizer`),
      applying the same Flax `Transformer` with no mesh and no rules (its `constrain` calls are
      no-ops then), donating params and optimizer state, returning only the loss.
    Same parameters (copied from the parallax init) and the same batch; the first-step losses and
    updated parameters are compared. Both are compiled first, then timed in interleaved rounds
    (A B, B A, A B, ...) of `--steps` steps, blocking at the end of each round. Reported: the median
    per-step time of each, and as the ratio the median over rounds of (parallax round / adjacent
    plain round), which cancels drift and load bursts; ratio of medians, of mins and of process
    CPU time are printed as second opinions. The optimized HLO of both steps is compared by opcode.
    Size: d_model 256, 4 layers, 4 heads, d_ff 1024, vocab 256: 4.3M parameters; batch
    4 x 256 = 1,024 tokens per step, ~6 * 4.3M * 1024 = ~27 GFLOP per step (plus attention):
    ~0.6 s per step on a 2-core CPU, so per-call dispatch (tens of us) is far below 1%.

[2] Dispatch (full run only): the same comparison on the tiny model (~1 ms steps), reported as the
    absolute per-step difference in microseconds: the machinery's fixed cost per call.

[3] Compile time with depth (target: 32 layers / 4 layers <= 1.5). The block stack is one
    `nn.scan`, so the HLO holds one block body whatever the depth. For each depth a fresh layout and
    train step are lowered against the abstract state (ShapeDtypeStructs carrying their shardings)
    and compiled; `jax.clear_caches()` before each repetition (and the persistent compilation cache
    off) makes each one cold. Depths alternate (4, 32, 4, 32, ...); the min of lower + compile over
    `--compile-reps` repetitions is kept per depth.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from parallax.train.build import build
from parallax.config import Config, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from parallax.parallel.mesh import available_devices
from parallax.model.transformer import Transformer, count_params, flops_per_token
from parallax.train.optim import make_optimizer
from parallax.train.train_state import init_state

STEP_TARGET = 1.03
COMPILE_TARGET = 1.5


def make_config(tiny: bool, n_layers: int | None = None) -> Config:
    if tiny:
        model = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=128, vocab_size=256)
        train = TrainConfig(steps=1000, global_batch=2, seq_len=32)
    else:
        model = ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=1024, vocab_size=256)
        train = TrainConfig(steps=1000, global_batch=4, seq_len=256)
    if n_layers is not None:
        model = dataclasses.replace(model, n_layers=n_layers)
    # warmup 1: the learning rate is nonzero from the second step on, so the updates are real work.
    return Config(name="bench_overhead", mesh=MeshConfig(data=1), model=model,
                  optim=OptimConfig(warmup_steps=1), train=train)


def make_plain_step(cfg: Config):
    """The hand-written baseline: value_and_grad + optax under a bare jit, no shardings."""
    model = Transformer(cfg.model)
    tx = make_optimizer(cfg)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])  # [B, T, V] float32
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def jitted(step):
    """The `jax.jit` object behind a parallax step (older versions wrap it to set the mesh)."""
    return getattr(step, "jitted", step)


def host_copy(tree, device):
    """A fresh device copy through the host: never aliases the (donated) source buffers."""
    return jax.device_put(jax.tree.map(np.asarray, tree), device)


def hlo_opcodes(compiled) -> collections.Counter:
    """Instruction count per opcode in an optimized HLO module (all computations, fused ones too)."""
    ops = collections.Counter()
    for line in compiled.as_text().splitlines():
        lhs, sep, rhs = line.partition(" = ")
        if not sep or not lhs.strip().removeprefix("ROOT ").startswith("%"):
            continue
        if rhs.startswith("("):  # tuple type: skip to its closing parenthesis
            depth = 0
            for i, ch in enumerate(rhs):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    break
            rhs = rhs[i + 1:]
        else:
            rhs = rhs.partition(" ")[2]
        m = re.match(r"\s*([a-z][\w\-]*)\(", rhs)
        if m:
            ops[m.group(1)] += 1
    return ops


def interleave(runs: dict, rounds: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """Per-step wall and process-CPU seconds of each run, in alternating rounds of `steps` steps.

    The order flips every round so neither run always follows the other. CPU time (all threads of
    this process) is a second opinion that other processes on a shared machine disturb less.
    """
    out = {name: {"wall": [], "cpu": []} for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            w0, c0 = time.perf_counter(), time.process_time()
            runs[name](steps)
            out[name]["wall"].append((time.perf_counter() - w0) / steps)
            out[name]["cpu"].append((time.process_time() - c0) / steps)
    return out


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of round-by-round ratios: adjacent rounds share the machine's state, so slow drift
    and bursts of load from other processes cancel better than in a ratio of medians."""
    return statistics.median(x / y for x, y in zip(a, b))


def bench_step(cfg: Config, rounds: int, steps: int, check: bool = True) -> dict:
    """Time the parallax step against the plain step on the same params and batch."""
    device = available_devices(1)[0]
    built = build(cfg, devices=[device])
    mesh, layout = built.mesh, built.layout
    state = init_state(cfg, layout)
    par_step = built.train_step()
    plain_step = make_plain_step(cfg)

    b, t, v = cfg.train.global_batch, cfg.train.seq_len, cfg.model.vocab_size
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (b, t + 1), 0, v, jnp.int32))
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}  # [B, T] each
    par_batch = jax.device_put(host_batch, built.batch_sharding)
    plain_batch = jax.device_put(host_batch, device)

    # Same starting point: copy before the parallax step donates its state.
    params = host_copy(state.params, device)
    opt_state = host_copy(state.opt_state, device)

    # Compile both (timed, for information) and check they compute the same thing.
    t0 = time.perf_counter()
    state, metrics = par_step(state, par_batch)
    jax.block_until_ready(state)
    first_par = time.perf_counter() - t0
    t0 = time.perf_counter()
    params, opt_state, loss = plain_step(params, opt_state, plain_batch)
    jax.block_until_ready(params)
    first_plain = time.perf_counter() - t0
    loss_par, loss_plain = float(metrics["loss"]), float(loss)
    param_diff = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(params))
    )
    if check:
        print(f"  first step (compile + run): parallax {first_par:.2f} s, plain {first_plain:.2f} s")
        print(f"  first-step loss: parallax {loss_par:.7f}  plain {loss_plain:.7f}  "
              f"|diff| {abs(loss_par - loss_plain):.2e}; max |param diff| after step 1: {param_diff:.2e}")

    # One more untimed step each so both are in steady state (lr > 0, caches warm).
    state, _ = par_step(state, par_batch)
    params, opt_state, _ = plain_step(params, opt_state, plain_batch)
    jax.block_until_ready((state, params))

    def run_par(n):
        nonlocal state
        for _ in range(n):
            state, _ = par_step(state, par_batch)
        jax.block_until_ready(state)

    def run_plain(n):
        nonlocal params, opt_state
        for _ in range(n):
            params, opt_state, _ = plain_step(params, opt_state, plain_batch)
        jax.block_until_ready(params)

    times = interleave({"parallax": run_par, "plain": run_plain}, rounds, steps)
    par, plain = times["parallax"], times["plain"]
    result = {
        "step_ms_parallax": 1e3 * statistics.median(par["wall"]),
        "step_ms_plain": 1e3 * statistics.median(plain["wall"]),
        "step_ratio": paired_ratio(par["wall"], plain["wall"]),
        "step_ratio_of_medians": statistics.median(par["wall"]) / statistics.median(plain["wall"]),
        "step_ratio_of_mins": min(par["wall"]) / min(plain["wall"]),
        "step_cpu_ratio": paired_ratio(par["cpu"], plain["cpu"]),
        "step_ms_parallax_rounds": [1e3 * x for x in par["wall"]],
        "step_ms_plain_rounds": [1e3 * x for x in plain["wall"]],
        "first_step_s_parallax": first_par,
        "first_step_s_plain": first_plain,
        "loss_parallax": loss_par,
        "loss_plain": loss_plain,
        "max_param_diff_step1": param_diff,
    }
    if check:
        # HLO comparison of the two compiled steps (the same programs, so a compile-cache hit).
        with jax.set_mesh(mesh):
            par_ops = hlo_opcodes(jitted(par_step).lower(state, par_batch).compile())
        plain_ops = hlo_opcodes(plain_step.lower(params, opt_state, plain_batch).compile())
        diff = {k: par_ops[k] - plain_ops[k] for k in set(par_ops) | set(plain_ops) if par_ops[k] != plain_ops[k]}
        result.update({
            "hlo_instructions_parallax": sum(par_ops.values()),
            "hlo_instructions_plain": sum(plain_ops.values()),
            "hlo_opcode_diff": dict(sorted(diff.items())),
        })
    return result


def compile_seconds(cfg: Config) -> dict:
    """(lower, compile) wall seconds and process-CPU seconds of the parallax step, cold."""
    jax.clear_caches()  # so this is never a cache hit of an earlier repetition
    device = available_devices(1)[0]
    built = build(cfg, devices=[device])  # a fresh Transformer each time
    abstract, batch = built.abstract_state(), built.abstract_batch()
    step = built.train_step()
    with jax.set_mesh(built.mesh):
        c0, t0 = time.process_time(), time.perf_counter()
        lowered = jitted(step).lower(abstract, batch)
        t1 = time.perf_counter()
        lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0, "cpu_s": c2 - c0}


def bench_compile(tiny: bool, depths: tuple[int, int], reps: int) -> dict[int, dict]:
    """Min over `reps` interleaved repetitions (4, 32, 4, 32, ...) of each depth's figures."""
    samples: dict[int, list[dict]] = {n: [] for n in depths}
    for _ in range(reps):
        for n in depths:
            samples[n].append(compile_seconds(make_config(tiny, n_layers=n)))
    out = {}
    for n, runs in samples.items():
        best = min(runs, key=lambda r: r["total_s"])
        out[n] = {**best, "cpu_s": min(r["cpu_s"] for r in runs), "total_s_all": [r["total_s"] for r in runs]}
    return out


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "FAIL"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model, few steps: a seconds-long smoke run")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 12; tiny 4)")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default 3; tiny 3)")
    ap.add_argument("--compile-reps", type=int, default=None,
                    help="interleaved repetitions per depth, min kept (default 3; tiny 1)")
    ap.add_argument("--layers", type=int, nargs=2, default=(4, 32), metavar=("SHALLOW", "DEEP"))
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    rounds = args.rounds or (4 if args.tiny else 12)
    steps = args.steps or 3
    reps = args.compile_reps or (1 if args.tiny else 3)

    # Compile-time figures must not come from an on-disk cache.
    jax.config.update("jax_enable_compilation_cache", False)

    cfg = make_config(args.tiny)
    m, tr = cfg.model, cfg.train
    device = available_devices(1)[0]
    tokens = tr.global_batch * tr.seq_len
    date = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"date {date}  python {platform.python_version()}  jax {jax.__version__}  "
          f"flax {flax.__version__}  optax {optax.__version__}  numpy {np.__version__}")
    print(f"device {device.platform}:{device.device_kind} (1 of {len(jax.devices())})  "
          f"host {platform.machine()}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}")
    print(f"model d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} d_ff={m.d_ff} "
          f"vocab={m.vocab_size} params={count_params(m)['total']:,}; batch {tr.global_batch} x {tr.seq_len} "
          f"= {tokens:,} tokens, {flops_per_token(m, tr.seq_len) * tokens / 1e9:.1f} GFLOP/step")

    print(f"[1] step: {rounds} interleaved rounds x {steps} steps each")
    step = bench_step(cfg, rounds, steps)
    print("  per-round ms  parallax: " + " ".join(f"{x:.1f}" for x in step["step_ms_parallax_rounds"]))
    print("  per-round ms  plain:    " + " ".join(f"{x:.1f}" for x in step["step_ms_plain_rounds"]))
    print(f"  ratio: paired median {step['step_ratio']:.4f}, of medians {step['step_ratio_of_medians']:.4f}, "
          f"of mins {step['step_ratio_of_mins']:.4f}, process-CPU paired {step['step_cpu_ratio']:.4f}")
    print(f"  HLO instructions: parallax {step['hlo_instructions_parallax']}, plain "
          f"{step['hlo_instructions_plain']}; opcode differences (parallax - plain): "
          f"{step['hlo_opcode_diff'] or 'none'}")

    dispatch = None
    if not args.tiny:
        # The absolute per-step cost of the machinery (Python dispatch of the TrainState pytree,
        # sharding checks, extra metrics), seen where compute is small: the tiny model.
        print("[2] dispatch: the same comparison on the tiny model, 10 rounds x 30 steps")
        d = bench_step(make_config(True), 10, 30, check=False)
        dispatch = {
            "step_us_parallax": 1e3 * d["step_ms_parallax"], "step_us_plain": 1e3 * d["step_ms_plain"],
            "overhead_us": 1e3 * (d["step_ms_parallax"] - d["step_ms_plain"]), "ratio": d["step_ratio"],
        }
        print(f"  tiny model per step: parallax {dispatch['step_us_parallax']:.0f} us, plain "
              f"{dispatch['step_us_plain']:.0f} us, difference {dispatch['overhead_us']:+.0f} us "
              f"(paired ratio {dispatch['ratio']:.4f})")

    shallow, deep = args.layers
    print(f"[3] compile: {shallow} vs {deep} layers, {reps} interleaved cold repetitions, min kept")
    comp = bench_compile(args.tiny, (shallow, deep), reps)
    for n in (shallow, deep):
        c = comp[n]
        print(f"  {n:>3} layers: lower {c['lower_s']:.2f} s + compile {c['compile_s']:.2f} s = {c['total_s']:.2f} s "
              f"(all reps: {', '.join(f'{x:.2f}' for x in c['total_s_all'])}; min process CPU {c['cpu_s']:.2f} s)")
    compile_ratio = comp[deep]["total_s"] / comp[shallow]["total_s"]
    compile_cpu_ratio = comp[deep]["cpu_s"] / comp[shallow]["cpu_s"]

    print()
    print(f"RESULT step_ms_parallax     {step['step_ms_parallax']:.2f}")
    print(f"RESULT step_ms_plain        {step['step_ms_plain']:.2f}")
    print(f"RESULT step_ratio           {step['step_ratio']:.4f}  target <= {STEP_TARGET}  "
          f"{verdict(step['step_ratio'], STEP_TARGET)}")
    if dispatch:
        print(f"RESULT dispatch_overhead_us {dispatch['overhead_us']:+.0f}")
    print(f"RESULT compile_s_{shallow}L{'':<{11 - len(str(shallow))}}{comp[shallow]['total_s']:.2f}")
    print(f"RESULT compile_s_{deep}L{'':<{11 - len(str(deep))}}{comp[deep]['total_s']:.2f}")
    print(f"RESULT compile_ratio        {compile_ratio:.4f}  target <= {COMPILE_TARGET}  "
          f"{verdict(compile_ratio, COMPILE_TARGET)}  (process CPU ratio {compile_cpu_ratio:.4f})")

    if args.json:
        out = {
            "date": date, "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "device": f"{device.platform}:{device.device_kind}", "cpus": os.cpu_count(),
            "tiny": args.tiny, "rounds": rounds, "steps_per_round": steps,
            "model": dataclasses.asdict(m), "batch": [tr.global_batch, tr.seq_len],
            **step,
            "step_target": STEP_TARGET, "step_pass": step["step_ratio"] <= STEP_TARGET,
            "dispatch": dispatch,
            "compile": {f"{n}_layers": comp[n] for n in (shallow, deep)},
            "compile_ratio": compile_ratio, "compile_cpu_ratio": compile_cpu_ratio,
            "compile_target": COMPILE_TARGET, "compile_pass": compile_ratio <= COMPILE_TARGET,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
