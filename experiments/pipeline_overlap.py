"""Per-tick pipeline sends against stage compute in the compiled step (issue 20).

    python experiments/pipeline_overlap.py [--target h100-8]

Compiles the train step of a small bf16 model on data 2 x tensor 2 x pipe 2 (M = 4) for a
compile-only target (nothing runs; "compiled for TARGET, not run") with GPipe, 1F1B, interleaved
1F1B (v = 2) and ZB-H1, and
reads the scheduled HLO: for every asynchronous collective-permute (start/done pair) over `pipe`,
whether the compiler scheduled compute (a fusion, custom call, convolution or dot) between its
start and its done, and the share of the send bytes that is so overlapped.

GPipe sends two half-microbatches per tick, the first behind the second half's compute
(pipeline.run_pipeline). 1F1B sends the tick's activation and its cotangent: both are produced at
the tick's end, so at most one can run behind the other's compute within the tick. Interleaved
1F1B runs the same tick; a ZB-H1 tick runs one op, so each of its two sends follows that op.
"""

from __future__ import annotations

import argparse
import re

from parallax.analysis.audit import compile_step
from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig

_START = re.compile(r"%(\S+) = (.*?) collective-permute-start\(")
_DONE = re.compile(r"collective-permute-done\(.*?%(\S+?)\)")
_WORK = re.compile(r" (fusion|custom-call|convolution|dot)\(")
_BYTES = {"bf16": 2, "f32": 4, "f16": 2, "s32": 4}


def _payload(shape: str) -> int:
    """Bytes of the first array in a start's result shape, e.g. (bf16[4,128,256], ...)."""
    m = re.search(r"(bf16|f32|f16|s32)\[([0-9,]*)\]", shape)
    n = 1
    for d in (m.group(2).split(",") if m and m.group(2) else []):
        n *= int(d)
    return n * _BYTES[m.group(1)] if m else 0


def overlap(hlo: str) -> tuple[int, int, int, int]:
    """(pairs, pairs with compute between, bytes, overlapped bytes) over every computation."""
    pairs = overlapped = total = hidden = 0
    for comp in re.split(r"\n(?=\S.*\{\s*$)", hlo):
        lines = comp.splitlines()
        starts = {}
        for i, line in enumerate(lines):
            if m := _START.search(line):
                starts[m.group(1)] = (i, _payload(m.group(2)))
            if (m := _DONE.search(line)) and m.group(1) in starts:
                at, size = starts[m.group(1)]
                busy = any(_WORK.search(x) for x in lines[at + 1:i])
                pairs, overlapped = pairs + 1, overlapped + busy
                total, hidden = total + size, hidden + size * busy
    return pairs, overlapped, total, hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100-8")
    args = ap.parse_args()
    model = ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=1024, vocab_size=512, dtype="bfloat16")
    for schedule, repeats in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        cfg = Config(mesh=MeshConfig(data=2, tensor=2, pipe=2), model=model,
                     parallel=ParallelConfig(microbatches=4, schedule=schedule, repeats=repeats),
                     train=TrainConfig(global_batch=16, seq_len=128))
        pairs, busy, total, hidden = overlap(compile_step(cfg, None, args.target).hlo)
        share = hidden / total if total else float("nan")
        print(f"{schedule:16s} compiled for {args.target}, not run: {pairs} collective-permute start/done pairs in the "
              f"step, {busy} with compute scheduled between; {share:.0%} of their bytes overlapped")


if __name__ == "__main__":
    main()
