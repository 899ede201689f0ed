"""FP8 dense training: the quickstart model with FP8 matmuls, against its BF16 run (same seed).

    parallax train experiments/fp8_dense.py                           # FP8, delayed scaling
    parallax train experiments/fp8_dense.py --set fp8.recipe=current  # FP8, current scaling
    parallax train experiments/fp8_dense.py --set fp8.enabled=False   # the BF16 baseline
    python experiments/fp8_dense.py [--steps N] [--json PATH]         # all three, compared

Mesh: data=4 x tensor=2 on 8 devices (simulated on a CPU-only machine), ZeRO-1, as quickstart.
Model: quickstart's (d_model 128, 4 layers, 4 heads, 2 kv heads, SwiGLU d_ff 512, vocab 256 bytes:
1.05M parameters) with bfloat16 compute; FP8 E4M3/E5M2 for the attention projections and the MLP
(`fp8.logits` stays off: the output projection is small and the most sensitive). Batch: 16 x 128 =
2,048 tokens per step; 100 steps = 204,800 tokens of the built-in corpus.

On CPU, FP8 is emulated (XLA upcasts the FP8 operands; the quantisation is real, the speed is not):
an FP8 step costs about 2x a BF16 step there (~1 s vs ~0.5 s on 2 cores), so one FP8 run is
~2 minutes and the comparison of three runs ~5. The script prints each run's final train loss
(mean of the last 10 steps, the same batches in every run) and final validation loss, and checks
FP8 against BF16 at 2% relative (PASS/FAIL; exit 0 either way, nonzero only on a crash).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from parallax.config import Config, Fp8Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig

TOLERANCE = 0.02  # |FP8 - BF16| / BF16, final losses


def get_config() -> Config:
    return Config(
        name="fp8_dense",
        mesh=MeshConfig(data=-1, tensor=2),
        model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256,
                          dtype="bfloat16"),
        fp8=Fp8Config(enabled=True, recipe="delayed"),
        parallel=ParallelConfig(zero=1, remat="none"),
        optim=OptimConfig(warmup_steps=30),
        train=TrainConfig(steps=100, global_batch=16, seq_len=128, lr=3e-3, eval_every=0, eval_batches=4,
                          log_every=1),
    )


VARIANTS = {
    "bf16": dict(enabled=False),
    "fp8_delayed": dict(enabled=True, recipe="delayed"),
    "fp8_current": dict(enabled=True, recipe="current"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 100)")
    ap.add_argument("--workdir", default="runs/fp8_dense", help="one subdirectory per run")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)

    from parallax.train.distributed import configure_host_devices
    from parallax.train.loop import run

    base = get_config()
    if args.steps:
        base = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=args.steps))
    print(configure_host_devices(base), flush=True)  # before JAX starts

    results = {}
    for name in args.variants:
        cfg = dataclasses.replace(base, name=f"fp8_dense_{name}",
                                  fp8=dataclasses.replace(base.fp8, **VARIANTS[name]))
        print(f"=== {name}", flush=True)
        workdir = Path(args.workdir) / name
        last = run(cfg, workdir, overwrite=True)
        records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        tail = [r["loss"] for r in records if r.get("loss") is not None][-10:]
        results[name] = {"train_loss_last10": sum(tail) / len(tail), "eval_loss": last["eval_loss"],
                         "step_time_s_median": sorted(r["step_time_s"] for r in records)[len(records) // 2]}

    print()
    ref = results.get("bf16")
    for name, r in results.items():
        line = (f"RESULT {name:<12} train_loss(last 10) {r['train_loss_last10']:.4f}  eval_loss {r['eval_loss']:.4f}"
                f"  step {r['step_time_s_median']:.2f} s")
        if ref is not None and name != "bf16":
            rel = {k: (r[k] - ref[k]) / ref[k] for k in ("train_loss_last10", "eval_loss")}
            r["rel_vs_bf16"] = rel
            r["pass"] = all(abs(v) <= TOLERANCE for v in rel.values())
            line += (f"  vs bf16: train {rel['train_loss_last10']:+.2%} eval {rel['eval_loss']:+.2%}"
                     f"  (tolerance {TOLERANCE:.0%}) {'PASS' if r['pass'] else 'FAIL'}")
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": base.train.steps, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
