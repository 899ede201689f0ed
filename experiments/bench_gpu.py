"""Benchmark: tokens/s, TFLOP/s, MFU and peak memory of a ~1B-parameter model on ONE GPU, BF16 and FP8.

    python experiments/bench_gpu.py                      # one H100/H200: ~1B dense, BF16 + FP8, < 8 minutes
    python experiments/bench_gpu.py --json out.json      # also write the figures as JSON
    python experiments/bench_gpu.py --cases dense_bf16   # a subset of the cases
    python experiments/bench_gpu.py --tiny               # tiny model on CPU in seconds (tests/test_report.py)

With no GPU found (decided without importing JAX, as `parallax train` does) it runs `--tiny` on CPU by
itself: that checks the script, never the hardware, and its figures are CPU figures.

Cases (CASES below; adding one is one line):
- dense_bf16: llama-style dense model, bfloat16 compute, fp32 master weights, AdamW.
- dense_fp8:  the same model with FP8 matmuls (E4M3/E5M2, delayed scaling, history 1024).
- moe_bf16 / moe_fp8: the same attention stack with every block's FFN a MoE layer of 8 SwiGLU
  experts of d_ff 2816, top-2 (so the activated FFN equals the dense model's 5632), capacity
  factor 1.25 per sequence: ~1.0B activated of ~2.9B parameters (both printed). One GPU holds
  every expert (mesh.expert=1: no all-to-all; the exchange is the identity), so this measures the
  router, dispatch/combine gathers and the batched expert matmuls. MFU counts activated FLOPs.

Size (GPU): d_model 2048, 18 layers, 16 heads (head dim 128), 8 kv heads, SwiGLU d_ff 5632, vocab
32000: 0.98B parameters (computed by `parallax.model.transformer.count_params`, printed). Batch 8 x 2048 =
16,384 tokens per step (random tokens: speed, not learning), ~97 TFLOP per step (6N + causal
attention). model.attention auto: cuDNN flash attention on the GPU (no [N, T, T] scores). remat
`dots` was chosen when attention took XLA's path (about 160 GiB with remat none then); with cuDNN,
remat none compiles to 50.2 GiB for h200-1 (not run) and `dots` ran at 26.2 GiB (measured on the
H200, 2026-12-04: BUILD_NOTES.md, "First run on a GPU"); the figures recorded are `dots`'. The
recomputation is not counted in MFU (model FLOPs only). `predicted` is the cost model's memory for
the attention kernel the step runs.

Each case runs in its own child process (this script with --worker): a device's high-water mark
(`memory_stats()['peak_bytes_in_use']`) cannot be reset, so one process per case makes it that
case's peak, and an out-of-memory case cannot take the others down. In each child: build with
parallax's own `make_layout` / `init_state` / `make_train_step` on a data=1 mesh over one device,
lower + compile (timed), read XLA's memory analysis and the compiled HLO, run `--warmup` steps,
then `--rounds` rounds of `--steps` steps, blocking (`block_until_ready`) at the end of each round;
the median per-step time over rounds is the step time. The cases run one after the other in one
command; FP8 speedup = BF16 step / FP8 step.

FP8 GEMM check: the compiled HLO is searched (experiments/bench_fp8.py's `fp8_gemm_report`) for
cuBLASLt FP8 custom calls (`__cublas$lt$matmul$f8`) and dots on f8e4m3fn/f8e5m2 operands; an FP8
step should hold >= 12 (4 matmuls per block x forward, input and weight gradients). XLA:CPU
converts FP8 operands to float32 before each dot, so on CPU it reports "not present", by design.

Targets on one H200 (PASS/FAIL printed only on an H100/H200; elsewhere "n/a"):
dense BF16 MFU >= 50%, FP8 step >= 1.3x faster than BF16, MoE MFU >= 35%, total < 8 min.
A script, not a test: it exits 0 when every case ran, 1 when a case failed (its error is reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallax.config import Config, Fp8Config, MeshConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig

HERE = Path(__file__).resolve().parent
TARGETS = {"dense_bf16_mfu": 0.50, "fp8_speedup": 1.3, "moe_mfu": 0.35, "wall_s": 480.0}
TARGET_DEVICES = ("h100", "h200")  # the targets are stated for one H200; H100 has the same peaks


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str  # "dense" | "moe": picks the model shape in make_config
    fp8: bool
    mfu_target: float | None = None  # against the BF16 peak


CASES = [
    Case("dense_bf16", "dense", fp8=False, mfu_target=TARGETS["dense_bf16_mfu"]),
    Case("dense_fp8", "dense", fp8=True),
    Case("moe_bf16", "moe", fp8=False, mfu_target=TARGETS["moe_mfu"]),
    Case("moe_fp8", "moe", fp8=True),
]
PENDING: dict[str, str] = {}  # cases that cannot produce a figure yet (none)


def make_config(case: Case, tiny: bool) -> Config:
    if tiny:
        model = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=128, vocab_size=256,
                            dtype="bfloat16")
        moe = MoEConfig(num_experts=4, top_k=2, d_ff=64, capacity_factor=1.25)
        train, remat = TrainConfig(steps=1000, global_batch=4, seq_len=32, lr=1e-4), "none"
    else:
        model = ModelConfig(d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8, d_ff=5632, vocab_size=32000,
                            dtype="bfloat16")
        moe = MoEConfig(num_experts=8, top_k=2, d_ff=2816, capacity_factor=1.25)
        train, remat = TrainConfig(steps=1000, global_batch=8, seq_len=2048, lr=1e-4), "dots"
    if case.family == "moe":
        model = dataclasses.replace(model, moe=moe)
    return Config(name=f"bench_gpu_{case.name}", mesh=MeshConfig(data=1), model=model,
                  fp8=Fp8Config(enabled=case.fp8, amax_history_length=1024),
                  parallel=ParallelConfig(remat=remat), optim=OptimConfig(warmup_steps=1), train=train)


# ----------------------------------------------------------------------------------------------
# The worker: one case, one process


def run_case(case: Case, tiny: bool, warmup: int, rounds: int, steps: int) -> dict:
    import jax
    import numpy as np

    sys.path.insert(0, str(HERE))
    # One HLO parser and one single-device setup (random tokens) for both GPU scripts.
    from bench_fp8 import MIN_FP8_GEMMS, _setup, fp8_gemm_report

    from parallax.analysis.cost import Grid, Workload, memory_parts, memory_platform
    from parallax.parallel.mesh import available_devices
    from parallax.parallelism import attention_kernel
    from parallax.train.metrics import mfu, peak_flops, tflops_per_device
    from parallax.model.transformer import active_params, count_params, flops_per_token

    cfg = make_config(case, tiny)
    device = available_devices(1)[0]
    mesh, layout, state, batch, train_step = _setup(cfg, device)
    b, t = cfg.train.global_batch, cfg.train.seq_len

    t0 = time.perf_counter()
    compiled = train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    print(f"{case.name}: compiled in {compile_s:.1f} s", file=sys.stderr, flush=True)  # seen even if the case times out
    text = compiled.as_text()
    hlo = fp8_gemm_report(text)
    cost = compiled.cost_analysis() or {}  # XLA's own count; a list of one dict in older jax
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()  # as parallax.analysis.audit reads it: peak = arg + out - alias + temp
    xla_peak = None if mem is None else int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                            - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    platform = memory_platform(device.platform)  # as the audit picks it
    # the attention the step runs (cuDNN on a GPU): the XLA path's [N, T, T] scores are not there
    kernel = attention_kernel(cfg, device.platform)
    predicted = float(memory_parts(Workload.of(cfg), Grid.of(cfg, dict(mesh.shape)), platform, kernel)["total"])

    losses = []
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        per_round.append((time.perf_counter() - t0) / steps)
    losses.append(float(metrics["loss"]))
    step_s = statistics.median(per_round)

    flops = flops_per_token(cfg.model, t) * b * t
    kind = device.device_kind
    stats = device.memory_stats() or {}  # None on CPU
    m = cfg.model
    return {
        "case": case.name, "fp8": case.fp8, "device": f"{device.platform}:{kind}", "jax": jax.__version__,
        "model": {"d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                  "d_ff": m.d_ff, "vocab_size": m.vocab_size, "dtype": m.dtype, "remat": cfg.parallel.remat},
        "moe": dataclasses.asdict(m.moe) if m.moe.num_experts else None,
        "params": count_params(m)["total"], "active_params": active_params(m), "batch": b, "seq_len": t, "tokens_per_step": b * t,
        "model_flops_per_step": flops, "compile_s": compile_s, "step_s": step_s, "rounds_s": per_round,
        "tokens_per_s": b * t / step_s, "tflops_per_device": tflops_per_device(flops, step_s, 1),
        "mfu": mfu(flops, step_s, 1, peak_flops(kind)),
        "mfu_fp8_peak": mfu(flops, step_s, 1, peak_flops(kind, fp8=True)) if case.fp8 else None,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
        "xla_memory_bytes": xla_peak, "predicted_memory_bytes": predicted,
        "xla_bytes_accessed": cost.get("bytes accessed"), "xla_flops": cost.get("flops"),
        "attention": kernel, "cudnn_attention_calls": text.count("__cudnn$fmha"),
        "memory_parts": None if mem is None else {k: int(getattr(mem, f"{k}_size_in_bytes"))
                                                  for k in ("argument", "output", "alias", "temp")},
        "hlo": hlo, "fp8_gemm_present": hlo["fp8_gemms"] > 0, "fp8_gemms_expected": MIN_FP8_GEMMS if case.fp8 else 0,
        "losses": losses, "finite": all(np.isfinite(losses)),
    }


# ----------------------------------------------------------------------------------------------
# The driver: one child per case, then the table


def spawn(case: Case, args, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", case.name, "--worker-out", str(out),
               "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--steps", str(args.steps)]
        cmd += ["--tiny"] if args.tiny else []
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.case_timeout)
        except subprocess.TimeoutExpired:
            return {"case": case.name, "error": f"timed out after {args.case_timeout} s", "wall_s": args.case_timeout}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"case": case.name, "error": f"exit {proc.returncode}: {tail}", "wall_s": wall}
        return {**json.loads(out.read_text()), "wall_s": wall}


def verdict(value: float | None, target: float, on_target_device: bool, higher: bool = True) -> str:
    if value is None or not on_target_device:
        return "n/a"
    return "PASS" if (value >= target if higher else value <= target) else "FAIL"


def summarize(results: dict, wall_s: float, tiny: bool) -> dict:
    ok = [r for r in results.values() if "error" not in r]
    device = ok[0]["device"] if ok else "unknown"
    on_target = not tiny and any(k in device.lower() for k in TARGET_DEVICES)
    checks = {}
    for r in ok:
        case = next(c for c in CASES if c.name == r["case"])
        if case.mfu_target is not None:
            checks[f"{r['case']} MFU >= {case.mfu_target:.0%}"] = (r["mfu"], verdict(r["mfu"], case.mfu_target, on_target))
        if case.fp8:
            found = r["hlo"]["fp8_gemms"]
            state = (f"present ({found})" if found else "not present") + (
                " (CPU: XLA upcasts FP8 before each dot)" if device.startswith("cpu") else "")
            checks[f"{r['case']} FP8 GEMMs >= {r['fp8_gemms_expected']}"] = (
                state, verdict(found, r["fp8_gemms_expected"], on_target))
    bf, f8 = results.get("dense_bf16"), results.get("dense_fp8")
    speedup = bf["step_s"] / f8["step_s"] if bf and f8 and "error" not in bf and "error" not in f8 else None
    checks[f"FP8 speedup >= {TARGETS['fp8_speedup']}x"] = (speedup, verdict(speedup, TARGETS["fp8_speedup"], on_target))
    checks[f"total wall <= {TARGETS['wall_s']:.0f} s"] = (wall_s, verdict(wall_s, TARGETS["wall_s"], on_target, False))
    return {"device": device, "tiny": tiny, "on_target_device": on_target, "speedup_fp8_over_bf16": speedup,
            "checks": {k: {"value": v, "verdict": s} for k, (v, s) in checks.items()}}


def print_table(results: dict, summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    def gib(x):
        return "-" if x is None else f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB"

    title = f"bench_gpu on {summary['device']}" + (" (TINY, CPU: checks the script, not hardware)" if summary["tiny"] else "")
    table = Table(title=title)
    for col in ("case", "params", "step", "tokens/s", "TFLOP/s/dev", "MFU bf16 peak", "MFU fp8 peak",
                "peak mem", "XLA mem", "predicted", "fp8 gemm"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in results.values():
        if "error" in r:
            table.add_row(r["case"], "error: " + r["error"][:80], *["-"] * 9)
            continue
        size = (lambda n: f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n:,}")
        params = size(r["params"]) + (f" ({size(r['active_params'])} active)" if r["moe"] else "")
        table.add_row(r["case"], params,
                      f"{r['step_s'] * 1e3:.1f} ms", f(r["tokens_per_s"], ",.0f"), f(r["tflops_per_device"], ".3g"),
                      f(r["mfu"], ".1%"), f(r["mfu_fp8_peak"], ".1%"), gib(r["peak_bytes_in_use"]),
                      gib(r["xla_memory_bytes"]), gib(r["predicted_memory_bytes"]),
                      f"present ({r['hlo']['fp8_gemms']})" if r["fp8_gemm_present"] else "not present")
    for name in PENDING:
        table.add_row(name, "pending", *["-"] * 9)
    console = Console(width=200)
    console.print(table)
    for name, why in PENDING.items():
        console.print(f"{name}: no figure; {why}", markup=False, highlight=False)
    for name, c in summary["checks"].items():
        v = c["value"]
        unknown = "unknown (no peak for this device)" if "MFU" in name else "unknown (a case it needs did not run)"
        shown = (unknown if v is None else f"{v:.1%}" if "MFU" in name and isinstance(v, float)
                 else f"{v:.3g}" if isinstance(v, float) else v)
        console.print(f"RESULT {name}: {shown}  {c['verdict']}", markup=False, highlight=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (automatic without a GPU)")
    ap.add_argument("--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling (default 3; tiny 1)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; tiny 3)")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default 10; tiny 2)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")
    ap.add_argument("--case-timeout", type=int, default=300, help="seconds before a case is abandoned (default 300)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, full, tiny in (("warmup", 3, 1), ("rounds", 5, 3), ("steps", 10, 2)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)

    if args.worker:
        case = next(c for c in CASES if c.name == args.worker)
        result = run_case(case, args.tiny, args.warmup, args.rounds, args.steps)
        Path(args.worker_out).write_text(json.dumps(result, default=float))
        return 0

    from parallax.train.distributed import has_accelerator  # does not import JAX

    env = dict(os.environ)
    if not args.tiny and not has_accelerator():
        print("bench_gpu: no GPU found; running the tiny CPU size (this checks the script, not hardware)")
        args.tiny = True
        args.warmup, args.rounds, args.steps = 1, 3, 2
    if args.tiny:  # one CPU device; cheaper LLVM code generation halves the tiny compiles (as bench_pipeline)
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"])
    started = time.perf_counter()
    results = {}
    for case in (c for c in CASES if c.name in args.cases):
        print(f"bench_gpu: running {case.name} ({'tiny, CPU' if args.tiny else 'full size'})", flush=True)
        results[case.name] = spawn(case, args, env)
    wall = time.perf_counter() - started
    summary = summarize(results, wall, args.tiny)
    print_table(results, summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"summary": summary, "cases": results, "pending": PENDING,
                                               "targets": TARGETS, "wall_s": wall}, indent=2, default=float))
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
