"""Real shapes on real compilers, compiled for TPU pods and GPU clusters with no device (issue 15).

    python experiments/targets.py --list
    python experiments/targets.py                 # every row (hours on 2 cores)
    python experiments/targets.py --only llama3-8b/h100-64 --only llama3-8b/v5p-128

Each row compiles the real train step of a published shape for a named compile-only target
(parallel/targets.py: libtpu's topologies, the CUDA plugin's GPU topologies) with the overlap flags
a run on it sets, and prints one line from `parallax audit`'s reading of the compiled program:
fits or not (XLA's peak against the device's memory), peak GiB per device (compiler, cost model),
collective GiB per step per device per axis, the share of those bytes the schedule overlaps
with compute, FP8 GEMMs per step, compile time. Every figure is "compiled for TARGET, not run":
nothing executes, kernels are not autotuned (XLA:GPU picks default tiles without a device).

Token arithmetic per row (global batch x sequence): Llama-3-8B 128 x 8,192 = 1M tokens; 70B
256 x 8,192 = 2M; Mixtral 256 x 4,096 = 1M; flagship 256 x 4,096 = 1M; the 1T dense 8,192 x 2,048
= 16.8M (Megatron's shape). Attention runs in query blocks of 1,024 (parallel.attention_chunk)
where T = 8,192, so no [B, N, T, T] score buffer (fused kernels: issue 17).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend of their own

from parallax.analysis.presets import DEVICES, PRESETS  # noqa: E402
from parallax.config import (Config, Fp8Config, MeshConfig, ModelConfig, MoEConfig, ParallelConfig,  # noqa: E402
                             TrainConfig)

GIB = 2**30
LLAMA3_8B = ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256,
                        dtype="bfloat16", rope_theta=500000.0)
LLAMA3_70B = ModelConfig(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256,
                         dtype="bfloat16", rope_theta=500000.0)
MIXTRAL = PRESETS["mixtral-8x7b"].model
# the flagship at real width: 4 axes, MoE blocks (every other) inside pipeline stages, FP8
FLAGSHIP = ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32000,
                       dtype="bfloat16", moe=MoEConfig(num_experts=8, top_k=2, every=2, capacity_factor=1.25))
DENSE_1T = PRESETS["dense-1t"].model


def _cfg(name, model, mesh, batch, seq, **parallel) -> Config:
    parallel = {"remat": "full", "attention_chunk": 1024 if seq > 4096 else 0, **parallel}
    fp8 = parallel.pop("fp8", False)
    return Config(name=name, model=model, mesh=MeshConfig(**mesh), parallel=ParallelConfig(**parallel),
                  fp8=Fp8Config(enabled=fp8), train=TrainConfig(global_batch=batch, seq_len=seq))


ROWS = {
    "llama3-8b/v5p-128": _cfg("llama3-8b", LLAMA3_8B, dict(data=64), 128, 8192, zero=3),
    "llama3-8b/h100-64": _cfg("llama3-8b", LLAMA3_8B, dict(data=8, tensor=8), 128, 8192, zero=3,
                              sequence_parallel=True),
    "llama3-70b/v5p-512": _cfg("llama3-70b", LLAMA3_70B, dict(data=64, tensor=4), 256, 8192, zero=3,
                               sequence_parallel=True),
    "mixtral-8x7b/v5p-256": _cfg("mixtral-8x7b", MIXTRAL, dict(data=16, expert=8), 256, 4096, zero=3),
    "flagship/tpu7x-256": _cfg("flagship", FLAGSHIP, dict(data=8, tensor=4, pipe=4, expert=2), 256, 4096, zero=1,
                               microbatches=16, fp8=True),
    "flagship/h100-64": _cfg("flagship", FLAGSHIP, dict(data=2, tensor=8, pipe=2, expert=2), 256, 4096, zero=1,
                             microbatches=8, fp8=True),
    "dense-1t/h100-16384": _cfg("dense-1t", DENSE_1T, dict(data=128, tensor=8, pipe=16), 8192, 2048, zero=1,
                                microbatches=64, sequence_parallel=True),
    # the same with 1F1B (live activations bounded by the stages, not M): Megatron's schedule
    "dense-1t-1f1b/h100-16384": _cfg("dense-1t", DENSE_1T, dict(data=128, tensor=8, pipe=16), 8192, 2048, zero=1,
                                     microbatches=64, sequence_parallel=True, schedule="1f1b"),
    # ... and with ZeRO-3 (masters sharded, stage weights gathered in bf16 once per step)
    "dense-1t-1f1b-z3/h100-16384": _cfg("dense-1t", DENSE_1T, dict(data=128, tensor=8, pipe=16), 8192, 2048,
                                        zero=3, microbatches=64, sequence_parallel=True, schedule="1f1b"),
}

# Issue 15, item 4: the cost model against the real compilers on 1B-class shapes over 8-16 devices,
# one row per layout family (a Llama-3.2-1B shape; a Mixtral-like MoE of 8 experts, top 2, at the
# same width). `--calibration` runs these and counts the rows within 10% (peak memory) and 5%
# (bytes over the links per parallelism).
LLAMA_1B = ModelConfig(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256,
                       dtype="bfloat16", rope_theta=500000.0)
MOE_1B = dataclasses.replace(LLAMA_1B, d_ff=4096, vocab_size=32000, moe=MoEConfig(num_experts=8, top_k=2))
CALIBRATION = {
    "1b dp x tp, ZeRO-1/h100-8": _cfg("1b", LLAMA_1B, dict(data=4, tensor=2), 32, 4096, zero=1),
    "1b FSDP/v5p-16": _cfg("1b", LLAMA_1B, dict(data=8), 32, 4096, zero=3),
    "1b dp x tp SP, ZeRO-3/h100-16": _cfg("1b", LLAMA_1B, dict(data=4, tensor=4), 32, 4096, zero=3,
                                          sequence_parallel=True),
    "1b GPipe, ZeRO-1/v5p-32": _cfg("1b", LLAMA_1B, dict(data=4, tensor=2, pipe=2), 32, 4096, zero=1, microbatches=8),
    "1b circular/h100-16": _cfg("1b", LLAMA_1B, dict(data=4, pipe=4), 32, 4096, zero=1, microbatches=8,
                                schedule="circular", repeats=2),
    "1b 1F1B/v5p-32": _cfg("1b", LLAMA_1B, dict(data=4, pipe=4), 32, 4096, zero=1, microbatches=8, schedule="1f1b"),
    "1b FP8 dp x tp/h100-8": _cfg("1b", LLAMA_1B, dict(data=4, tensor=2), 32, 4096, zero=1, fp8=True),
    "moe-1b ep, ZeRO-3/v5p-32": _cfg("moe-1b", MOE_1B, dict(data=4, expert=4), 32, 4096, zero=3),
    "moe-1b dp x tp x ep/h100-16": _cfg("moe-1b", MOE_1B, dict(data=2, tensor=2, expert=4), 32, 4096, zero=1),
}


def row(key: str, dump: str | None = None) -> dict:
    """Compile one row and read it back (audit.audit: collectives, overlap, memory, FP8 GEMMs);
    `dump`: a directory to write the compiled HLO text into, as ROW.hlo."""
    from parallax.analysis.audit import audit, compile_step
    from parallax.parallel.targets import target

    cfg, name = {**ROWS, **CALIBRATION}[key], key.split("/")[1]
    t = target(name)
    started = time.perf_counter()
    a = audit(cfg, None, name)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, key.replace("/", "_") + ".hlo"), "w") as f:
            f.write(compile_step(cfg, None, name).hlo)  # cached: the same compile
    out = {"row": key, "target": name, "devices": t.devices, "compile_s": time.perf_counter() - started,
           "device_kind": a["device_kind"], "memory": a["memory"], "axes": a["axes"], "overlap": a["overlap"],
           "fp8": a["fp8"]}
    # memory per JAX device from the planner's device table (a chip's HBM over its devices);
    # None where the table has no entry (tpu7x): fits is then '?'
    dev = DEVICES.get(t.device_type) if t.device_type else None
    out["hbm"] = dev.hbm_bytes * t.chips / t.devices if dev else None
    return out


def line(r: dict) -> str:
    mem = r["memory"]
    xla = mem["xla"]["peak"] / GIB if mem["xla"] else float("nan")
    model = mem["model"]["total"] / GIB
    fits = "?" if r["hbm"] is None or not mem["xla"] else ("fits" if mem["xla"]["peak"] <= r["hbm"] else "DOES NOT FIT")
    # compiled GiB per step per device, and the cost model's error against it: in result buffers,
    # then in bytes sent over the links (hlo.link_bytes: the same whatever kind the compiler chose)
    err = lambda e: f"{e * 100:+.0f}%" if e is not None else "-"  # noqa: E731
    axes = ", ".join(f"{k} {v['bytes'] / GIB:.2f} ({err(v['error'])}; links {v['links'] / GIB:.2f}, "
                     f"{err(v['links_error'])})" for k, v in r["axes"].items())
    hidden = ", ".join(f"{k} {v['overlapped_fraction']:.0%}" for k, v in r["overlap"].items()
                       if v["overlapped_fraction"] is not None)
    fp8 = f"; FP8 GEMMs {r['fp8']['fp8_gemms']} of {r['fp8']['fp8_dot_general']}" if r["fp8"] else ""
    return (f"{r['row']:<22} {fits:<12} peak {xla:6.1f} GiB (model {model:6.1f}); collectives GiB/step "
            f"(model error; sent over the links, model error): {axes}; "
            f"overlapped: {hidden}{fp8}; compiled in {r['compile_s']:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=sorted({**ROWS, **CALIBRATION}),
                    help="one row (repeatable); default: all")
    ap.add_argument("--list", action="store_true", help="print the rows and their layouts")
    ap.add_argument("--dump", metavar="DIR", help="also write each row's compiled HLO text into DIR")
    ap.add_argument("--calibration", action="store_true",
                    help="the cost model's validation set (1B-class layouts on 8-16 devices) instead of ROWS")
    args = ap.parse_args()
    rows = CALIBRATION if args.calibration else ROWS
    if args.list:
        for key, cfg in rows.items():
            mesh = " x ".join(f"{k} {v}" for k, v in dataclasses.asdict(cfg.mesh).items() if v > 1)
            print(f"{key:<22} {mesh} ({math.prod(v for v in dataclasses.asdict(cfg.mesh).values())} devices), "
                  f"ZeRO-{cfg.parallel.zero}, batch {cfg.train.global_batch} x {cfg.train.seq_len}")
        return
    print("compiled for the target, not run (jax 0.10.2; libtpu / jax-cuda12-plugin as installed)")
    done = []
    for key in args.only or list(rows):
        done.append(row(key, args.dump))
        print(line(done[-1]), flush=True)
    if args.calibration:
        print(calibration_summary(done))


def calibration_summary(rows: list[dict]) -> str:
    """How many rows the cost model gets within issue 15's bounds: peak memory within 10% of the
    compiler's, bytes over the links within 5% per parallelism (every family of the row)."""
    mem = [r for r in rows if r["memory"]["error"] is not None and abs(r["memory"]["error"]) <= 0.10]
    links = [r for r in rows if all(v["links_error"] is not None and abs(v["links_error"]) <= 0.05
                                    for v in r["axes"].values())]
    return (f"within 10% on peak memory: {len(mem)} of {len(rows)}; within 5% on the bytes over the links of "
            f"every parallelism: {len(links)} of {len(rows)}")


if __name__ == "__main__":
    main()
