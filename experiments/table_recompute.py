"""What a table schedule's backward computes again, against the cost model (issues 15 and 20).

    python experiments/table_recompute.py [--target h100-8] [--cases 1f1b:1:full:4:xla:sp,...]

Compiles the train step of a tiny bf16 model (d 128, 4 heads on 2 kv heads, d_ff 256, vocab
256) on data 2 x tensor 2 x pipe 2, M = 4, ZeRO-1, 16 x 64 tokens, for a compile-only target
(nothing runs: "compiled for TARGET, not run"), one line per case
`schedule:repeats:remat:layers:attention[:sp]`. Each line gives the step's matmul FLOPs per
device read from the HLO (audit.executed_dot_flops: a table schedule's tick branches counted
once per busy tick) beside the cost model's, and the model's error on the tensor
bytes the audit reads. The recomputation differs by remat policy and chunk length
(pipeline_1f1b's backward_by_unit under remat full, the chunk's VJP elsewhere, ZB-H1's B and W),
so these are the rows to read when either changes.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend of their own (targets.py)

from parallax.analysis.audit import FAST_COMPILE, audit  # noqa: E402
from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402

CASES = ("1f1b:1:full:4:xla:sp,1f1b:1:full:8:xla:sp,interleaved_1f1b:2:full:8:xla:sp,zb_h1:1:full:4:xla,"
         "zb_h1:1:full:4:xla:sp,zb_h1:1:full:8:xla:sp,zb_h1:1:none:4:xla:sp,zb_h1:1:dots:8:xla:sp,"
         "zb_h1:1:save_attn_mlp:4:xla:sp,1f1b:1:save_attn_mlp_offload:4:xla:sp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100-8")
    ap.add_argument("--cases", default=CASES)
    args = ap.parse_args()
    for case in args.cases.split(","):
        schedule, repeats, remat, layers, attention, *sp = case.split(":")
        model = ModelConfig(d_model=128, n_layers=int(layers), n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256,
                            dtype="bfloat16", attention=attention)
        parallel = ParallelConfig(microbatches=4, schedule=schedule, repeats=int(repeats), remat=remat, zero=1,
                                  sequence_parallel=sp == ["sp"])
        cfg = Config(mesh=MeshConfig(data=2, tensor=2, pipe=2), model=model, parallel=parallel,
                     train=TrainConfig(global_batch=16, seq_len=64))
        a = audit(cfg, FAST_COMPILE, args.target)
        flops, measured = a["flops"]["executed_model"], a["flops"]["hlo_executed"]  # audit.executed_dot_flops
        print(f"{case:38s} compiled for {args.target}, not run ({a['attention']['kernel']} attention): matmul "
              f"{measured / 1e6:9.2f} MFLOP per device, model {flops['total'] / 1e6:9.2f} "
              f"({flops['total'] / measured - 1:+.1%}); tensor bytes {a['axes']['tensor']['error']:+.1%}")


if __name__ == "__main__":
    main()
