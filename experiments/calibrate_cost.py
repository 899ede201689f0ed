"""Calibrate the XLA:CPU memory constants of parallax/analysis/cost.py against compiled train steps.

    python experiments/calibrate_cost.py            # ~80 compiles, ~8 minutes on a 2-core CPU
    python experiments/calibrate_cost.py --quick    # 12 compiles, ~1.5 minutes
    python experiments/calibrate_cost.py --moe      # the 11 MoE compiles, ~2 minutes
    python experiments/calibrate_cost.py --json out.json

A script, not a test: it compiles each calibration layout ahead of time on 8 simulated CPU devices
(`parallax.analysis.audit.compile_step`, no initialisation, nothing run), and prints XLA's peak memory
(arguments + unaliased outputs + temporaries) beside the cost model's parts, and the collective
bytes per step beside the model's. The constants CPU_FULL_SAVED, CPU_WORKING, CPU_LOGITS and
F1B_WORKING in cost.py were read off this table. The calibration model (d_model 64, d_ff 256,
vocab 256, seq 64, one factor varied at a time) is deliberately not one the validation tests
(tests/test_cost_validation.py) use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from parallax.analysis.audit import FAST_COMPILE, audit  # noqa: E402
from parallax.config import Config, MeshConfig, ModelConfig, MoEConfig, ParallelConfig, TrainConfig  # noqa: E402

MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256)
M42 = MeshConfig(data=4, tensor=2)
SHAPES = {  # one factor at a time
    "base": (M42, {}, {}),
    "L8": (M42, {"n_layers": 8}, {}),
    "D128": (M42, {"d_model": 128}, {}),
    "F512": (M42, {"d_ff": 512}, {}),
    "T128": (M42, {}, {"seq_len": 128}),
    "t1": (MeshConfig(data=8), {}, {}),
    "t4": (MeshConfig(data=2, tensor=4), {"n_kv_heads": 4}, {}),
    "V1024": (M42, {"vocab_size": 1024}, {}),
    "B32": (M42, {}, {"global_batch": 32}),
}
P222, P24 = MeshConfig(data=2, tensor=2, pipe=2), MeshConfig(data=2, pipe=4)
LAYOUTS = {  # (mesh, parallel, model overrides)
    "m2": (M42, ParallelConfig(microbatches=2), {}),
    "gpipe_p2_m4": (P222, ParallelConfig(microbatches=4), {}),
    "gpipe_p2_m8": (P222, ParallelConfig(microbatches=8), {}),
    "gpipe_p2_m4_L8": (P222, ParallelConfig(microbatches=4), {"n_layers": 8}),
    "gpipe_p4_m4": (P24, ParallelConfig(microbatches=4), {}),
    "gpipe_p2_m4_full": (P222, ParallelConfig(microbatches=4, remat="full"), {}),
    "circular_p2_m4_r2": (P222, ParallelConfig(microbatches=4, schedule="circular", repeats=2), {}),
    "1f1b_p2_m4": (P222, ParallelConfig(microbatches=4, schedule="1f1b"), {}),
    "1f1b_p2_m8": (P222, ParallelConfig(microbatches=8, schedule="1f1b"), {}),
    "1f1b_p4_m4": (P24, ParallelConfig(microbatches=4, schedule="1f1b"), {}),
    "gpipe_p2_d4_z3": (MeshConfig(data=4, pipe=2), ParallelConfig(microbatches=2, zero=3), {}),
    "gpipe_p2_d4_z1": (MeshConfig(data=4, pipe=2), ParallelConfig(microbatches=2, zero=1), {}),
    "z1": (M42, ParallelConfig(zero=1), {}),
    "z1_L8": (M42, ParallelConfig(zero=1), {"n_layers": 8}),
    "z3": (M42, ParallelConfig(zero=3), {}),
    "z3_full": (M42, ParallelConfig(zero=3, remat="full"), {}),
    "z3_full_L8": (M42, ParallelConfig(zero=3, remat="full"), {"n_layers": 8}),
}
# MoE (MOE_SLOT_D, MOE_SLOT_F, MOE_ROUTER, MOE_WORKING in cost.py): least squares over these 11
# compiles, one factor at a time around E=4 top-2 experts on data=2 x tensor=2 x expert=2.
_E = MoEConfig(num_experts=4, top_k=2)
_MOE = {"d_model": 96, "d_ff": 192, "moe": _E}
E222 = MeshConfig(data=2, tensor=2, expert=2)
MOE_CASES = {
    "moe_base": (E222, ParallelConfig(), {}, {}),
    "moe_cf4": (E222, ParallelConfig(), {"moe": dataclasses.replace(_E, capacity_factor=4.0)}, {}),
    "moe_Fe384": (E222, ParallelConfig(), {"moe": dataclasses.replace(_E, d_ff=384)}, {}),
    "moe_E8": (E222, ParallelConfig(), {"moe": dataclasses.replace(_E, num_experts=8)}, {}),
    "moe_full": (E222, ParallelConfig(remat="full"), {}, {}),
    "moe_dots": (E222, ParallelConfig(remat="dots"), {}, {}),
    "moe_every2": (E222, ParallelConfig(), {"moe": dataclasses.replace(_E, every=2)}, {}),
    "moe_shared": (E222, ParallelConfig(), {"moe": dataclasses.replace(_E, shared_experts=1)}, {}),
    "moe_d4e2": (MeshConfig(data=4, expert=2), ParallelConfig(), {}, {}),
    "moe_bf16": (E222, ParallelConfig(), {"dtype": "bfloat16"}, {}),
    "moe_B32": (E222, ParallelConfig(), {}, {"global_batch": 32}),
}
QUICK = ["base/none/float32", "L8/none/float32", "base/full/float32", "base/dots/bfloat16", "t1/none/float32",
         "m2", "gpipe_p2_m4", "gpipe_p4_m4", "1f1b_p2_m4", "1f1b_p4_m4", "z1", "z3_full"]


def cases():
    for remat in ("none", "full", "dots"):
        for dtype in ("float32", "bfloat16"):
            for name, (mesh, model, train) in SHAPES.items():
                yield f"{name}/{remat}/{dtype}", mesh, ParallelConfig(remat=remat), {**model, "dtype": dtype}, train
    for name, (mesh, parallel, model) in LAYOUTS.items():
        yield name, mesh, parallel, model, {}
    for name, (mesh, parallel, model, train) in MOE_CASES.items():
        yield name, mesh, parallel, {**_MOE, **model}, train


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 12-layout subset")
    ap.add_argument("--moe", action="store_true", help="only the 11 MoE layouts")
    ap.add_argument("--json", help="also write every row to this file")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'layout':28} {'XLA MiB':>8} {'model':>8} {'err':>7}  model parts (MiB)      collective bytes err (worst row)")
    for name, mesh, parallel, model, train in cases():
        if (args.quick and name not in QUICK) or (args.moe and name not in MOE_CASES):
            continue
        cfg = Config(mesh=mesh, model=dataclasses.replace(MODEL, **model), parallel=parallel,
                     train=dataclasses.replace(TrainConfig(global_batch=16, seq_len=64), **train))
        a = audit(cfg, FAST_COMPILE)
        mem = a["memory"]
        parts = " ".join(f"{k[:4]}={v / 2**20:.2f}" for k, v in mem["model"].items() if k != "total" and v)
        worst = max((abs(r["error"]) for r in a["collectives"] if r["error"] is not None), default=0.0)
        print(f"{name:28} {mem['xla']['peak'] / 2**20:8.2f} {mem['model']['total'] / 2**20:8.2f} "
              f"{mem['error'] * 100:6.1f}%  {parts}  {worst * 100:.2f}%", flush=True)
        rows.append({"layout": name, **a})
    errs = [abs(r["memory"]["error"]) for r in rows]
    print(f"memory |error|: mean {sum(errs) / len(errs) * 100:.1f}%, max {max(errs) * 100:.1f}% over {len(rows)} layouts")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
