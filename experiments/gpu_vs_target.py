"""The compile-only GPU target against the real GPU: the same bench_gpu cases compiled here for a
compile-only target, beside what the real device compiled and ran (a bench_gpu JSON from it).

    python experiments/gpu_vs_target.py experiments/results/h200_2026-12-04   # h200-1, every case found
    python experiments/gpu_vs_target.py DIR --target h100-1 --cases dense_bf16

DIR holds bench_gpu.py's JSON files from the GPU (the driver's {"cases": {...}} or one worker's
case). Each case is rebuilt from bench_gpu.make_config and compiled with `parallax audit`'s
compile_step for the target (no device; the CUDA plugin's compile-only devices), then printed
beside the real run: XLA's memory analysis (arguments, temporaries, peak), FP8 GEMMs, cuDNN
attention calls. The real figures came from whatever jax that machine had (recorded in the JSON);
the compile-only ones from the jax installed here, so a difference may be the compiler's version
as much as the target's description.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gpu  # noqa: E402


def real_cases(folder: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        for case in data.get("cases", {}).values() if "cases" in data else [data]:
            if isinstance(case, dict) and "case" in case and "error" not in case:
                found[case["case"]] = case
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--target", default="h200-1")
    ap.add_argument("--cases", nargs="+", default=None)
    args = ap.parse_args(argv)
    real = real_cases(args.folder)
    names = [n for n in (args.cases or [c.name for c in bench_gpu.CASES]) if n in real]
    if not names:
        print(f"gpu_vs_target: no bench_gpu case found in {args.folder}", file=sys.stderr)
        return 2

    from parallax.parallel.targets import target_devices

    target_devices(args.target)  # before JAX starts: a GPU target runs JAX on the CPU, its plugin compile-only
    from bench_fp8 import fp8_gemm_report

    from parallax.analysis.audit import compile_step

    gib = 2.0**30
    rows = []
    for name in names:
        case = next(c for c in bench_gpu.CASES if c.name == name)
        step = compile_step(bench_gpu.make_config(case, tiny=False), target=args.target)
        r, m = real[name], step.memory
        row = {"case": name, "real_device": r["device"], "real_jax": r["jax"], "target": args.target,
               "compile_s_here": step.compile_s, "compile_s_real": r["compile_s"],
               "real_peak_gib": r["peak_bytes_in_use"] / gib, "real_xla_gib": r["xla_memory_bytes"] / gib,
               "target_xla_gib": m["peak"] / gib,
               "real_temp_gib": r["memory_parts"]["temp"] / gib if r.get("memory_parts") else None,
               "target_temp_gib": m["temp"] / gib,
               "predicted_gib": r["predicted_memory_bytes"] / gib,
               "real_fp8_gemms": r["hlo"]["fp8_gemms"], "target_fp8_gemms": fp8_gemm_report(step.hlo)["fp8_gemms"],
               "real_cudnn_calls": r.get("cudnn_attention_calls"), "target_cudnn_calls": step.hlo.count("__cudnn$fmha")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'case':<11} {'peak real':>10} {'XLA real':>9} {'XLA target':>10} {'target/real':>11} "
          f"{'temp real':>9} {'temp target':>11} {'model':>7} {'FP8 GEMMs':>11} {'cuDNN calls':>11}")
    for r in rows:
        print(f"{r['case']:<11} {r['real_peak_gib']:>9.2f}G {r['real_xla_gib']:>8.2f}G {r['target_xla_gib']:>9.2f}G "
              f"{r['target_xla_gib'] / r['real_xla_gib']:>11.3f} "
              f"{r['real_temp_gib'] or 0:>8.2f}G {r['target_temp_gib']:>10.2f}G {r['predicted_gib']:>6.2f}G "
              f"{r['real_fp8_gemms']:>5} / {r['target_fp8_gemms']:<5} {r['real_cudnn_calls']:>5} / {r['target_cudnn_calls']:<5}")
    print(f"(real: {rows[0]['real_device']}, jax {rows[0]['real_jax']}, measured; target: {args.target}, "
          "compiled here, not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
