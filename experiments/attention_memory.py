"""Compiled memory of the train step at T = 8192 with the fused attention kernel (model.attention
auto: cuDNN on a GPU target, splash on a TPU target) against XLA's attention (issue 17).

    python experiments/attention_memory.py [--targets h100-8,v5p-16] [--layouts base,sp,pipe] [--t 8192]

A ~1.1B model (TinyLlama's shape: d_model 2048, 22 layers, 32 heads of 64 on 4 kv heads, d_ff
5632, vocab 32000, bf16), batch 4 x T, remat full (both kernels), compiled for each compile-only
target (nothing runs: "compiled for TARGET, not run") on three layouts of 8 devices:
  base: data 4 x tensor 2;  sp: the same with sequence parallelism;
  pipe: data 2 x tensor 2 x pipe 2, GPipe with 2 microbatches.
Prints per layout and target the compiled temporary and peak bytes per device
(memory_analysis(): temp_size, and arguments + outputs - aliased + temp), the kernel the audit
reads from the program, and the ratio auto / xla. A compile the compiler refuses (the program
does not fit the device) is reported as such, with the compiler's first line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend of their own (targets.py)

from parallax.analysis.audit import FAST_COMPILE, compile_step  # noqa: E402
from parallax.analysis.gemms import attention_kernels  # noqa: E402
from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402

MODEL = ModelConfig(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, vocab_size=32000,
                    dtype="bfloat16")
LAYOUTS = {
    "base": (MeshConfig(data=4, tensor=2), ParallelConfig(remat="full")),
    "sp": (MeshConfig(data=4, tensor=2), ParallelConfig(remat="full", sequence_parallel=True)),
    "pipe": (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(remat="full", microbatches=2)),
}
GiB = 2**30


def config(layout: str, attention: str, t: int) -> Config:
    mesh, parallel = LAYOUTS[layout]
    return Config(name=f"attention_memory_{layout}", mesh=mesh, parallel=parallel,
                  model=dataclasses.replace(MODEL, attention=attention), train=TrainConfig(global_batch=4, seq_len=t))


def measure(layout: str, attention: str, target: str, t: int) -> dict:
    started = time.perf_counter()
    try:
        step = compile_step(config(layout, attention, t), FAST_COMPILE, target)
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the figure (does not fit)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                "compile_s": time.perf_counter() - started}
    m = step.memory or {}
    return {"kernel": attention_kernels(step.hlo)["kernel"], "temp": m.get("temp"), "peak": m.get("peak"),
            "compile_s": step.compile_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="h100-8,v5p-16")
    p.add_argument("--layouts", default="base,sp,pipe")
    p.add_argument("--t", type=int, default=8192)
    args = p.parse_args()
    print(f"compiled for TARGET, not run; model {MODEL.d_model}x{MODEL.n_layers}, heads {MODEL.n_heads}/"
          f"{MODEL.n_kv_heads}, batch 4 x {args.t}, remat full, bf16")
    print(f"{'target':<8} {'layout':<5} {'auto kernel':<11} {'auto temp GiB':>13} {'xla temp GiB':>12} "
          f"{'ratio':>6} {'auto peak GiB':>13} {'xla peak GiB':>12}  compile s (auto/xla)")
    for target in args.targets.split(","):
        for layout in args.layouts.split(","):
            a, x = measure(layout, "auto", target, args.t), measure(layout, "xla", target, args.t)
            if "error" in a or "error" in x:
                print(f"{target:<8} {layout:<5} auto: {a.get('error', a.get('kernel'))} | xla: "
                      f"{x.get('error', 'compiled')}", flush=True)
                continue
            print(f"{target:<8} {layout:<5} {a['kernel']:<11} {a['temp'] / GiB:>13.2f} {x['temp'] / GiB:>12.2f} "
                  f"{a['temp'] / x['temp']:>6.3f} {a['peak'] / GiB:>13.2f} {x['peak'] / GiB:>12.2f}  "
                  f"{a['compile_s']:.0f}/{x['compile_s']:.0f}", flush=True)


if __name__ == "__main__":
    main()
