"""The kernel checks that need a real GPU: cuDNN attention against XLA's, and FP8 GEMMs against their emulation.

    python experiments/gpu_checks.py --json out.json    # one GPU: ~1 minute
    python experiments/gpu_checks.py --tiny             # CPU: checks the script only (XLA attention only)

A script, not a test: it prints each figure with PASS/FAIL where a bound is stated, writes them as
JSON, and exits 1 only when a check ran and failed (a check that crashed is reported and counted
as failed). Every figure comes from the device it names; on CPU the cuDNN checks are skipped.

[1] Attention numerics. parallax's cuDNN kernel (model/kernels.py `cudnn_attention`, what
    model.attention=auto runs on a GPU) and XLA's attention (model/attention.py
    `causal_attention`, the CPU path), both in bfloat16, against XLA's attention in float32 on
    the same bfloat16 inputs: outputs and the gradients of q, k and v (cotangent: a fixed random
    [B, T, N, H]), unpacked rows (cuDNN's causal mask type) and packed rows (three documents per
    row: the same-document mask). Shape: B 2, T 2048, N 16 query heads, K 8 kv heads, H 128.
    Bound: cuDNN's relative error (Frobenius) within 2x XLA bfloat16's plus 1e-3: the fused
    kernel may round differently, not worse.
[2] Attention cost at T = 8192 (B 1, N 16, K 8, H 128, causal, forward + backward): step time
    (median of 10 after 3 warm-ups) and the compiled temporary bytes, cuDNN against XLA.
[3] FP8 GEMMs against their emulation. One FP8 matmul (Fp8DotGeneral, current scaling,
    [4096, 4096] x [4096, 4096]) compiled for the GPU: the HLO must hold an FP8 GEMM
    (experiments/bench_fp8.py's `fp8_gemm_report`), and its output must agree with the same FP8
    matmul computed on the CPU (XLA:CPU converts the E4M3 operands to float32 and multiplies in
    float32): relative error <= 5e-3, an eighth of E4M3's own rounding error (its error against
    the float64 product, printed beside: ~0.037), so a GEMM fed the wrong scale or operand fails.
    The first bound, 1e-5 (float32 accumulation order only), failed on the first H200 run
    (2026-12-04: 1.33e-3 at K = 4096, cuBLASLt's FP8 GEMM), most likely because Hopper's FP8
    tensor cores accumulate with fewer bits than float32 (DeepSeek-V3's report measured about 14;
    not established here: BUILD_NOTES.md, "First run on a GPU"); 5e-3 was set after that figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fp8 import fp8_gemm_report, fp8_matmul  # noqa: E402

from parallax.model.attention import causal_attention  # noqa: E402
from parallax.model.kernels import cudnn_attention  # noqa: E402

FP8_EMULATION_REL_MAX = 5e-3  # the docstring's [3]: set after the first H200 run
ATTENTION_SLACK = 1e-3


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def attention_inputs(b: int, t: int, n: int, k: int, h: int, packed: bool, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, k, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, k, h), jnp.bfloat16)
    dout = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
    seg = None
    if packed:  # three documents per row, boundaries at different places in each row
        cuts = np.array([[t // 5, t // 2], [t // 3, 3 * t // 4]])[:b]
        pos = np.arange(t)
        seg = jnp.asarray(sum((pos[None] >= cuts[:, i:i + 1]).astype(np.int32) for i in range(2)))
    return q, kk, v, dout, seg


def out_and_grads(fn, q, k, v, dout, seg, dtype):
    def loss(q, k, v):
        out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), seg)
        return jnp.sum(out.astype(jnp.float32) * dout), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return jax.device_get((out, *grads))


def check_attention_numerics(device, tiny: bool) -> dict:
    b, t, n, k, h = (2, 128, 4, 2, 64) if tiny else (2, 2048, 16, 8, 128)
    xla = lambda q, k, v, s: causal_attention(q, k, v, segment_ids=s)  # noqa: E731
    result = {"shape": {"B": b, "T": t, "N": n, "K": k, "H": h}}
    with jax.default_device(device):
        for packed in (False, True):
            inputs = attention_inputs(b, t, n, k, h, packed)
            ref = out_and_grads(xla, *inputs, jnp.float32)
            row = {"xla_bf16": [rel(x, r) for x, r in zip(out_and_grads(xla, *inputs, jnp.bfloat16), ref)]}
            if device.platform == "gpu":
                row["cudnn_bf16"] = [rel(x, r) for x, r in zip(out_and_grads(cudnn_attention, *inputs, jnp.bfloat16), ref)]
                row["pass"] = all(c <= 2 * x + ATTENTION_SLACK for c, x in zip(row["cudnn_bf16"], row["xla_bf16"]))
            result["packed" if packed else "unpacked"] = row
    return result


def check_attention_cost(device, tiny: bool) -> dict:
    b, t, n, k, h = (1, 256, 4, 2, 64) if tiny else (1, 8192, 16, 8, 128)
    q, kk, v, dout, _ = attention_inputs(b, t, n, k, h, packed=False)
    kernels = {"xla": lambda q, k, v: causal_attention(q, k, v)}
    if device.platform == "gpu":
        kernels["cudnn"] = lambda q, k, v: cudnn_attention(q, k, v)
    result = {"shape": {"B": b, "T": t, "N": n, "K": k, "H": h}}
    for name, fn in kernels.items():
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * dout), argnums=(0, 1, 2)))
        args = jax.device_put((q, kk, v), device)
        compiled = step.lower(*args).compile()
        for _ in range(3):
            jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        mem = compiled.memory_analysis()
        result[name] = {"step_ms": statistics.median(times) * 1e3,
                        "temp_bytes": None if mem is None else int(mem.temp_size_in_bytes),
                        "cudnn_calls": compiled.as_text().count("__cudnn$fmha")}  # which kernel really ran
    return result


def check_fp8_gemm(device, tiny: bool) -> dict:
    m = 256 if tiny else 4096
    rng = np.random.default_rng(0)
    x = rng.normal(size=(m, m)).astype(np.float32)
    w = (rng.normal(size=(m, m)) * 0.05).astype(np.float32)
    fn = jax.jit(fp8_matmul)
    args = jax.device_put((x, w), device)
    compiled = fn.lower(*args).compile()
    y = np.asarray(compiled(*args))
    cpu = jax.devices("cpu")[0]
    y_cpu = np.asarray(jax.jit(fp8_matmul).lower(*jax.device_put((x, w), cpu)).compile()(*jax.device_put((x, w), cpu)))
    hlo = fp8_gemm_report(compiled.as_text())
    emulation = rel(y, y_cpu)
    return {"m": m, "device": device.platform, "fp8_gemms": hlo["fp8_gemms"], "hlo": hlo,
            "rel_vs_cpu_emulation": emulation, "rel_vs_float64": rel(y, np.asarray(x, np.float64) @ w),
            "pass": device.platform != "gpu" or (hlo["fp8_gemms"] >= 1 and emulation <= FP8_EMULATION_REL_MAX)}


CHECKS = {"attention_numerics": check_attention_numerics, "attention_cost": check_attention_cost,
          "fp8_gemm": check_fp8_gemm}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (the CPU check of the script)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    results = {"device": f"{device.platform}:{device.device_kind}", "jax": jax.__version__}
    print(f"gpu_checks on {results['device']} (jax {jax.__version__})", flush=True)
    failed = 0
    for name, check in CHECKS.items():
        t0 = time.perf_counter()
        try:
            results[name] = check(device, args.tiny)
        except Exception as e:  # a crash in one check must not hide the others' figures
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "pass": False}
        results[name]["wall_s"] = time.perf_counter() - t0
        ok = results[name].get("pass", all(r.get("pass", True) for r in results[name].values() if isinstance(r, dict)))
        failed += not ok
        print(f"RESULT {name}: {'PASS' if ok else 'FAIL'} {json.dumps(results[name], default=float)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
