"""Peak memory of the step with and without [B, T, V] buffers, side by side (issue 22).

    python experiments/bench_memory.py                      # CPU quickstart: memory, step time, losses
    python experiments/bench_memory.py --steps 5            # a quick look
    python experiments/bench_memory.py --llama7b v5p-32     # the 7B layout, compiled for 16 v5p chips, not run

Two models, laid out the same way (train_state.make_model) from the same config:
- `fused`: parallax as it is: the embedding a gather (vocab.param_take), the loss head fused and
  chunked over T (vocab.fused_cross_entropy, parallel.loss_chunk);
- `unfused`: the step before issue 22, kept here as the reference: the embedding a one-hot
  matmul [B, T, V] x [V, D] and the loss a float32 log-softmax of the whole [B, T, V] logits.

CPU quickstart (8 simulated devices, data 4 x tensor 2): the compiled step's temporaries and
arguments per device (XLA's memory analysis), the mean step time over `--steps` steps after one
warm-up, and the loss of every step from the same initial state and batches (the largest
|difference| printed: the change is meant to leave the loss curve alone).

`--llama7b TARGET`: the Llama-2-7B shape of issue 22 (d_model 4096, 32 layers, 32 heads, d_ff
11008, vocab 32000, bf16 compute, remat full, ZeRO-3 over all devices, 4 x 4096 tokens per
device) compiled for a named compile-only target (parallel/targets.py): "compiled for TARGET,
not run". Each compile takes minutes on a 2-core CPU; `--tokens-per-device` changes the 4 x 4096,
`--attention-chunk` sets parallel.attention_chunk (query blocks of XLA's attention), `--attention`
model.attention (default xla, the attention of the rows recorded before the fused kernels).
"""

from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # CPU devices; a --llama7b target brings its own compiler

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig, load_experiment  # noqa: E402
from parallax.model.layers import param_matmul  # noqa: E402
from parallax.model.logical import constrain  # noqa: E402
from parallax.model.transformer import NORMED, RESIDUAL, Transformer  # noqa: E402
from parallax.model.vocab import LOGITS, cross_entropy  # noqa: E402
from parallax.train.build import build  # noqa: E402
from parallax.train.data import make_global_batch, open_data  # noqa: E402
from parallax.train.train_state import init_state, make_model  # noqa: E402

HERE = Path(__file__).resolve().parent
GIB = 2**30


class Unfused(Transformer):
    """The reference: one-hot embedding matmul, float32 [B, T, V] logits and log-softmax."""

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        e = self.embed
        one_hot = constrain(jax.nn.one_hot(tokens, e.vocab_size, dtype=e.dtype), LOGITS)
        x = param_matmul(one_hot, e.embedding, (((2,), (0,)), ((), ())), e.NAMES, e.dtype, e.grad_dtype,
                         placer=e.placer)
        return constrain(constrain(x, NORMED), RESIDUAL)

    def head_loss(self, x: jax.Array, targets: jax.Array) -> jax.Array:
        return cross_entropy(self.head(x), targets)


VARIANTS = {"fused": Transformer, "unfused": Unfused}


def memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {"temp": m.temp_size_in_bytes, "args": m.argument_size_in_bytes, "out": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes}


def peak(m: dict[str, int]) -> int:
    """Arguments + temporaries (+ outputs not aliased to donated arguments), as MaxText's
    train_compile reports a step's footprint."""
    return m["args"] + m["temp"] + m["out"] - m["alias"]


def quickstart(steps: int) -> int:
    cfg = load_experiment(HERE / "quickstart.py")
    cfg = dataclasses.replace(cfg, name="bench_memory", train=dataclasses.replace(cfg.train, steps=steps))
    train, _ = open_data(cfg)
    results = {}
    for name, cls in VARIANTS.items():
        built = build(cfg, model=make_model(cfg, cls))
        step = built.train_step()
        state = init_state(cfg, built.layout)
        batches = [make_global_batch(train, i, built.batch_sharding) for i in range(steps + 1)]
        compiled = step.lower(state, batches[0]).compile()
        losses = []
        state, metrics = step(state, batches[0])  # warm-up (compiles again through the jit cache)
        losses.append(float(metrics["loss"]))
        started = time.perf_counter()
        for b in batches[1:]:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        seconds = (time.perf_counter() - started) / steps
        results[name] = {"mem": memory(compiled), "losses": np.asarray(losses), "seconds": seconds}
        m = results[name]["mem"]
        print(f"  {name:8s} temp {m['temp'] / 2**20:7.2f} MiB, args {m['args'] / 2**20:6.2f} MiB, "
              f"step {seconds * 1e3:6.1f} ms (mean of {steps}), final loss {losses[-1]:.5f}", flush=True)
    f, u = results["fused"], results["unfused"]
    diff = np.abs(f["losses"] - u["losses"])
    print(f"  temporaries fused / unfused: {f['mem']['temp'] / u['mem']['temp']:.3f}; "
          f"step time fused / unfused: {f['seconds'] / u['seconds']:.3f}")
    print(f"  max |loss difference| over {len(diff)} steps: {diff.max():.2e} (step {int(diff.argmax())})")
    return 0


def llama7b(target: str, tokens_per_device: int, attention_chunk: int = 0, seq: int = 4096,
            attention: str = "xla") -> Config:
    from parallax.parallel.targets import target as lookup

    t = lookup(target)
    return Config(
        name="llama2_7b",
        mesh=MeshConfig(data=t.devices),
        model=ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, vocab_size=32000,
                          dtype="bfloat16", attention=attention),
        parallel=ParallelConfig(zero=3, remat="full", attention_chunk=attention_chunk),
        train=TrainConfig(global_batch=t.devices * tokens_per_device // seq, seq_len=seq),
    )


def compiled_for(target: str, tokens_per_device: int, attention_chunk: int, seq: int, attention: str = "xla") -> int:
    from parallax.analysis.gemms import attention_kernels
    from parallax.parallel.targets import target as lookup, target_devices
    from parallax.parallelism import attention_kernel

    cfg = llama7b(target, tokens_per_device, attention_chunk, seq, attention)
    print(f"  Llama-2-7B shape, {tokens_per_device} tokens per device in sequences of {seq}, "
          f"model.attention={attention}, parallel.attention_chunk={attention_chunk}",
          flush=True)
    devices = target_devices(target)
    for name, cls in VARIANTS.items():
        started = time.perf_counter()
        # the attention kernel the target runs (make_model's default is XLA's)
        model = make_model(cfg, cls, attention=attention_kernel(cfg, lookup(target).platform))
        built = build(cfg, devices, model=model)
        compiled = built.train_step().lower(built.abstract_state(), built.abstract_batch()).compile()
        kernel = attention_kernels(compiled.as_text())["kernel"]
        m = memory(compiled)
        print(f"  {name:8s} compiled for {target}, not run, attention {kernel}: args {m['args'] / GIB:.2f} GiB, temp "
              f"{m['temp'] / GIB:.2f} GiB, peak {peak(m) / GIB:.2f} GiB per device "
              f"({time.perf_counter() - started:.0f} s to compile)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant on CPU (default 20)")
    ap.add_argument("--llama7b", metavar="TARGET", help="compile the 7B layout for TARGET (e.g. v5p-32) instead")
    ap.add_argument("--tokens-per-device", type=int, default=4 * 4096)
    ap.add_argument("--only", choices=tuple(VARIANTS), help="--llama7b: compile one variant only")
    ap.add_argument("--attention-chunk", type=int, default=0, help="--llama7b: parallel.attention_chunk (default 0)")
    ap.add_argument("--seq-len", type=int, default=4096, help="--llama7b: train.seq_len (default 4096)")
    ap.add_argument("--attention", default="xla", choices=("xla", "auto", "splash", "cudnn"),
                    help="--llama7b: model.attention (default xla: the rows recorded before fused attention)")
    args = ap.parse_args(argv)
    if args.only:
        VARIANTS.pop(next(k for k in VARIANTS if k != args.only))
    print(f"bench_memory: {datetime.datetime.now().isoformat(timespec='seconds')}, jax {jax.__version__}", flush=True)
    if args.llama7b:
        return compiled_for(args.llama7b, args.tokens_per_device, args.attention_chunk, args.seq_len, args.attention)
    print(f"  quickstart on {len(jax.devices())} {jax.devices()[0].platform} devices", flush=True)
    return quickstart(args.steps)


if __name__ == "__main__":
    sys.exit(main())
