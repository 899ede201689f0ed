"""Per-tick pipeline sends against stage compute in the compiled step (issue 20).

    python experiments/pipeline_overlap.py [--target h100-8]

Compiles the train step of a small bf16 model on data 2 x tensor 2 x pipe 2 (M = 4) for a
compile-only target (nothing runs; "compiled for TARGET, not run") with GPipe, circular (R = 2),
1F1B, interleaved 1F1B (v = 2) and ZB-H1, and reads the scheduled HLO through the audit
(analysis/overlap.py): for every collective-permute over `pipe`, whether the compiler scheduled
compute (a GEMM, convolution or attention kernel, or a loop or call holding one) between its start
and its done (a decomposed permute: and its receiver's recv-done), and the share of the send bytes
that is so overlapped. The target compiles with the overlap flags a run sets
(distributed.GPU_FLAGS).

GPipe and circular send two half-microbatches per tick: the first behind the second half's
compute, the second at the next tick's start, behind that tick's first half
(pipeline.run_pipeline). 1F1B sends the tick's activation behind its B and the last tick's
cotangent at the tick's start, behind its F (pipeline_1f1b). Interleaved 1F1B runs the same tick
round a ring; circular's and its rings go as their chain and closing pair (pipeline.send_along).
A ZB-H1 tick runs one op, so each of its two sends follows that op.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend of their own (targets.py)

from parallax.analysis.audit import audit  # noqa: E402
from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100-8")
    args = ap.parse_args()
    model = ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=1024, vocab_size=512, dtype="bfloat16")
    for schedule, repeats in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        cfg = Config(mesh=MeshConfig(data=2, tensor=2, pipe=2), model=model,
                     parallel=ParallelConfig(microbatches=4, schedule=schedule, repeats=repeats),
                     train=TrainConfig(global_batch=16, seq_len=128))
        a = audit(cfg, None, args.target)
        sends = [r for r in a["collectives"] if r["axes"] == ["pipe"] and r["kind"] == "collective-permute"]
        total = sum(r["bytes"] for r in sends)
        hidden = sum(r["overlapped_bytes"] for r in sends)
        share = hidden / total if total else float("nan")
        name = f"circular_r{repeats}" if schedule == "circular" else schedule
        print(f"{name:16s} compiled for {args.target}, not run: {sum(r['ops'] for r in sends)} collective-permutes "
              f"over pipe, {total / 2**20:.2f} MiB per step; {share:.0%} of the bytes with a GEMM scheduled between "
              f"start and done")


if __name__ == "__main__":
    main()
