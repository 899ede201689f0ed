"""The gradient-reduction dtype on the GPU compiler, compiled for 8 compile-only H100s (nothing runs).

    python -m venv /tmp/gpuvenv && /tmp/gpuvenv/bin/pip install -e . "jax[cuda12-local]==0.10.2"
    /tmp/gpuvenv/bin/python experiments/gpu_grad_reduce.py

For each ZeRO stage and `parallel.grad_reduce_dtype`, the train step of a tiny bf16 model on
data 4 x tensor 2 is compiled by XLA's GPU compiler, and every all-reduce / reduce-scatter over
`data` in the scheduled program is listed by result dtype and size. The matmul weights' gradients
(rank >= 2) must come out in grad_reduce_dtype; `--plain` compiles with the plain-autodiff path
(`grad_dtype=None`, what c7513aa did) for the comparison.

Why a script and a separate environment, not a test: with the CUDA plugin installed, every
`import jax` prints 8 absl lines ("Could not find cuda drivers") even with JAX_PLATFORMS=cpu,
which the CLI's one-line-error promise and its tests cannot live with (BUILD_NOTES.md).
The device facts are XLA's public H100 SXM spec (xla/backends/gpu/target_config/specs/
h100_sxm.txtpb), the subset jaxlib 0.10.2's proto accepts.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 8 minor: 9 patch: 4 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
_RESULT = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) (?:all-reduce|reduce-scatter)(?:-start)?\(")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", action="store_true", help="also compile the plain-autodiff path (c7513aa's)")
    args = ap.parse_args(argv)

    import jax
    from jax.experimental import topologies

    from parallax.analysis.hlo import collectives
    from parallax.train.build import build
    from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
    from parallax.model.fp8 import transformer_dot_generals
    from parallax.model.transformer import Transformer
    from parallax.parallel.sharding import param_placer

    devices = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=H100_SXM,
                                           topology="1x1x8").devices
    model = ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256, dtype="bfloat16")
    b, t = 8, 64
    print(f"gpu_grad_reduce: {time.strftime('%Y-%m-%dT%H:%M:%S')}, jax {jax.__version__}, {len(devices)} x "
          f"{devices[0].device_kind} (compile-only), bf16 model d128 L2, data 4 x tensor 2, remat full")
    cases = [(z, g) for z in (0, 1, 3) for g in ("float32", "bfloat16")] + ([(z, None) for z in (0, 3)] if args.plain else [])
    for zero, grad in cases:
        cfg = Config(mesh=MeshConfig(data=4, tensor=2), model=model, train=TrainConfig(global_batch=b, seq_len=t),
                     parallel=ParallelConfig(zero=zero, remat="full", grad_reduce_dtype=grad or "bfloat16"))
        net = Transformer(cfg.model, remat=cfg.parallel.remat, grad_dtype=grad, placer=param_placer(cfg.parallel),
                          **transformer_dot_generals(cfg.fp8))
        built = build(cfg, devices, model=net)
        mesh, state, batch = built.mesh, built.abstract_state(), built.abstract_batch()
        start = time.perf_counter()
        hlo = built.train_step().lower(state, batch).compile().as_text()
        seconds = time.perf_counter() - start
        results = {m.group(1): m.group(2) for m in map(_RESULT.match, hlo.splitlines()) if m}
        found = Counter()
        for c in collectives(hlo, dict(mesh.shape)):
            if "data" in c.axes and c.kind in ("all-reduce", "reduce-scatter"):
                for dtype, dims in re.findall(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]", results.get(c.name, "")):
                    if dtype in ("f32", "bf16"):
                        rank = len([d for d in dims.split(",") if d])
                        found["matrix" if rank >= 2 else "vector/scalar", dtype] += 1
        label = f"grad_reduce_dtype={grad}" if grad else "plain autodiff (c7513aa)"
        rows = ", ".join(f"{k[0]} {k[1]} x{n}" for k, n in sorted(found.items()))
        print(f"  ZeRO-{zero} {label:<28} data-axis reductions: {rows}  (compile {seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
