"""What Muon adds to the compiled step (optim.name=muon against adamw), side by side per layout.

    python experiments/bench_muon.py                          # 8 simulated CPU devices (~2 minutes)
    python experiments/bench_muon.py --target v5e-8           # compiled for TPU v5e, not run (libtpu)

A model of real proportions but few layers (d_model 1024, 8 layers, 8 heads, d_ff 4096, vocab
32000, bf16, batch 16 x 512) on data 4 x tensor 2, ZeRO-1 and ZeRO-3. For each layout it compiles
the train step with AdamW and with Muon and prints the collective bytes per step by (kind, mesh
axes) as the partitioner emitted them, XLA's FLOP count, and the compiled temporaries and
arguments. The difference is the Newton-Schulz iterations on sharded matrices: GSPMD keeps each
matrix sharded as its momentum is (ZeRO over data, heads/mlp over tensor) and reduces the Gram
matrices X X^T over the sharded axis instead of gathering X; the largest Muon-only all-gather is
printed so that any whole-matrix gather shows. Nothing is timed: these are compiled-program figures.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend of their own (targets.py)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402

from parallax.analysis.audit import compile_step  # noqa: E402
from parallax.analysis.hlo import collectives, summarize  # noqa: E402
from parallax.config import (Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig,  # noqa: E402
                             TrainConfig)

MODEL = ModelConfig(d_model=1024, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=4096, vocab_size=32000, dtype="bfloat16")
MiB = 2**20


def _config(name: str, zero: int) -> Config:
    return Config(mesh=MeshConfig(data=4, tensor=2), model=MODEL, parallel=ParallelConfig(zero=zero),
                  optim=OptimConfig(name=name), train=TrainConfig(global_batch=16, seq_len=512))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="a compile-only target (parallax.parallel.targets), e.g. v5e-8")
    args = ap.parse_args()
    where = f"compiled for {args.target}, not run" if args.target else "compiled for 8 simulated CPU devices"
    print(f"Muon against AdamW, {where}: d_model {MODEL.d_model}, {MODEL.n_layers} layers, bf16, data 4 x tensor 2")
    for zero in (1, 3):
        steps = {name: compile_step(_config(name, zero), target=args.target) for name in ("adamw", "muon")}
        found = {name: collectives(s.hlo, s.mesh_shape) for name, s in steps.items()}
        rows = {name: summarize(f) for name, f in found.items()}
        print(f"\nZeRO-{zero}: collective MiB per step by (kind, axes): adamw -> muon")
        for key in sorted(set(rows["adamw"]) | set(rows["muon"])):
            a, m = (rows[n].get(key, {"bytes": 0, "executions": 0}) for n in ("adamw", "muon"))
            print(f"  {key[0]:>18} {'x'.join(key[1]) or '?':>12}: {a['bytes'] / MiB:9.2f} -> {m['bytes'] / MiB:9.2f}"
                  f"  ({a['executions']} -> {m['executions']} executions)")
        adam_shapes = {(c.kind, c.axes, c.bytes) for c in found["adamw"]}
        extra = [c for c in found["muon"] if c.kind == "all-gather" and (c.kind, c.axes, c.bytes) not in adam_shapes]
        biggest = max(extra, key=lambda c: c.bytes, default=None)
        print("  largest Muon-only all-gather: " + (f"{biggest.bytes / MiB:.2f} MiB over {'x'.join(biggest.axes)}"
                                                    if biggest else "none"))
        for name, s in steps.items():
            mem = s.memory or {}
            flops = (s.cost or {}).get("flops")
            print(f"  {name:>6}: flops {flops / 1e12 if flops else float('nan'):.3f} T, temp "
                  f"{mem.get('temp', 0) / MiB:.1f} MiB, arguments {mem.get('argument', 0) / MiB:.1f}"
                  f" MiB, compile {s.compile_s:.0f} s")


if __name__ == "__main__":
    main()
