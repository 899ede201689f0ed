"""MoE against a dense model with the same activated FLOPs, same data, same steps: losses and
tokens/s side by side.

    python experiments/bench_moe.py                 # 150 steps each (~5 minutes on a 2-core CPU)
    python experiments/bench_moe.py --steps 20      # a quick look

Dense: experiments/quickstart.py (data=4 x tensor=2). MoE: experiments/moe_ep.py (data=2 x
tensor=2 x expert=2; every 2nd block's FFN is 8 experts of d_ff 256, top-2, so a token's FFN work
equals the dense d_ff 512). Both see the same batches in the same order (the data stream depends
only on the seed, never on the mesh) under the same schedule, so the loss gap is the model's.
Each runs through `parallax train` in its own process, one after the other; the figures come from
their metrics.jsonl. On CPU tokens/s compares the two programs on this machine, not hardware speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {"dense": HERE / "quickstart.py", "moe": HERE / "moe_ep.py"}


def run(name: str, steps: int, workdir: Path) -> dict:
    eval_every = max(steps // 3, 1)
    cmd = [sys.executable, "-m", "parallax", "train", str(RUNS[name]), "--workdir", str(workdir),
           "--set", f"train.steps={steps}", "--set", f"train.eval_every={eval_every}", "--set", "train.log_every=1"]
    print(f"bench_moe: {name}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        records[r["step"]] = r  # the last record of a step counts
    last = records[max(records)]
    times = [r["tokens_per_s"] for s, r in records.items() if s > 1]  # step 1 left out: first-run warm-up
    evals = [r["eval_loss"] for r in records.values() if "eval_loss" in r]
    return {"loss": last["loss"], "eval_loss": evals[-1] if evals else None,
            "tokens_per_s": statistics.median(times) if times else None,
            "moe": {k: v for k, v in last.items() if k.startswith("moe_") and "_layer" not in k}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    from parallax.config import load_experiment
    from parallax.model.transformer import active_params, count_params, flops_per_token

    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, args.steps, Path(tmp) / name) for name in RUNS}
    for name, path in RUNS.items():
        m = load_experiment(path).model
        results[name].update(params=count_params(m)["total"], active_params=active_params(m),
                             flops_per_token=flops_per_token(m, load_experiment(path).train.seq_len))
    print(f"{'':8} {'params':>10} {'active':>10} {'MFLOP/token':>12} {'loss':>8} {'eval':>8} {'tokens/s':>10}")
    for name, r in results.items():
        print(f"{name:8} {r['params']:>10,} {r['active_params']:>10,} {r['flops_per_token'] / 1e6:>12.2f} "
              f"{r['loss']:>8.4f} {r['eval_loss'] or float('nan'):>8.4f} {r['tokens_per_s'] or float('nan'):>10,.0f}")
    d, m = results["dense"], results["moe"]
    print(f"RESULT moe_minus_dense_loss {m['loss'] - d['loss']:+.4f}  eval {(m['eval_loss'] or 0) - (d['eval_loss'] or 0):+.4f}")
    if d["tokens_per_s"] and m["tokens_per_s"]:
        print(f"RESULT moe_over_dense_tokens_per_s {m['tokens_per_s'] / d['tokens_per_s']:.3f}")
    print("RESULT moe_routing " + " ".join(f"{k}={v:.4f}" for k, v in m["moe"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
