"""Weight gradients reduced over `data` in float32 or bfloat16 (parallel.grad_reduce_dtype), side by side.

    python experiments/bench_grad_reduce.py               # 60 steps each (~3 minutes on a 2-core CPU)
    python experiments/bench_grad_reduce.py --steps 20    # a quick look

The quickstart model (experiments/quickstart.py: data=4 x tensor=2, ZeRO-1) in bfloat16, trained
twice from the same initial parameters on the same batches (the data stream depends only on the
seed), once per setting: the loss of every step, the final loss and the largest |difference|, and
the bytes per step of the data-axis gradient reductions (all-reduce or reduce-scatter over
`data`) as the partitioner emits them, which is what a GPU or TPU compiler receives.

On CPU (8 simulated devices) XLA:CPU promotes bfloat16 collectives to float32 after partitioning,
so the bfloat16 run's numerics here differ from the float32 run's only by the rounding of each
device's partial sum and of the result to bfloat16, not by bfloat16 additions inside the
reduction; its bytes on this machine are float32 ones. The bytes printed are the partitioned
program's, not a measurement of a network.
"""

from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from parallax.analysis.hlo import collectives  # noqa: E402
from parallax.train.build import build  # noqa: E402
from parallax.config import Config, load_experiment, stack_length  # noqa: E402
from parallax.train.data import make_global_batch, open_data  # noqa: E402
from parallax.parallel.mesh import make_mesh  # noqa: E402
from parallax.train.train_state import init_state  # noqa: E402

HERE = Path(__file__).resolve().parent
SETTINGS = ("float32", "bfloat16")
_BYTES = {"f32": 4, "bf16": 2}
_TYPE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]", re.M)


def make_config(grad: str, steps: int) -> Config:
    cfg = load_experiment(HERE / "quickstart.py")
    return dataclasses.replace(
        cfg, name=f"bench_grad_reduce_{grad}", model=dataclasses.replace(cfg.model, dtype="bfloat16"),
        parallel=dataclasses.replace(cfg.parallel, grad_reduce_dtype=grad),
        train=dataclasses.replace(cfg.train, steps=steps))


def reduction_bytes(cfg: Config, state, batch, step) -> dict[str, int]:
    """Bytes per step per dtype of the data-axis gradient reductions after SPMD partitioning.
    That HLO has no loop trip counts yet: a reduction inside the scanned stack runs once per
    scanned unit (config.stack_length)."""
    with tempfile.TemporaryDirectory() as dump:
        step.lower(state, batch).compile({"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        (path,) = Path(dump).glob("*after_spmd-partitioning*.txt")
        hlo = path.read_text()
    types = {name: (dtype, dims) for name, dtype, dims in _TYPE.findall(hlo)}
    mesh_shape = dict(make_mesh(cfg.mesh).shape)
    out: dict[str, int] = {}
    for c in collectives(hlo, mesh_shape):
        if "data" not in c.axes or c.kind not in ("all-reduce", "reduce-scatter") or "transpose(" not in c.op_name:
            continue
        dtype, dims = types[c.name]
        trips = stack_length(cfg.model) if "while/body" in c.op_name else 1
        out[dtype] = out.get(dtype, 0) + _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d])) * trips
    return out


def run(grad: str, steps: int) -> dict:
    cfg = make_config(grad, steps)
    built = build(cfg)
    mesh, layout = built.mesh, built.layout
    state = init_state(cfg, layout)
    train, _ = open_data(cfg)
    step = built.train_step()
    sharding = built.batch_sharding
    nbytes = reduction_bytes(cfg, state, make_global_batch(train, 0, sharding), step)
    losses, started = [], time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, make_global_batch(train, i, sharding))
        losses.append(float(metrics["loss"]))
    return {"losses": np.asarray(losses), "bytes": nbytes, "seconds": time.perf_counter() - started, "mesh": mesh}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps per setting (default 60)")
    args = ap.parse_args(argv)
    print(f"bench_grad_reduce: {datetime.datetime.now().isoformat(timespec='seconds')}, jax {jax.__version__}, "
          f"quickstart model in bfloat16, {args.steps} steps per setting", flush=True)
    results = {}
    for grad in SETTINGS:
        results[grad] = run(grad, args.steps)
        r = results[grad]
        shape = " x ".join(f"{k}={v}" for k, v in r["mesh"].shape.items())
        print(f"  grad_reduce_dtype={grad:8s} ({shape}, {r['mesh'].devices.flat[0].platform}): final loss "
              f"{r['losses'][-1]:.4f}, {r['seconds']:.0f} s; data-axis gradient reductions per step after "
              f"partitioning: " + ", ".join(f"{v:,} B {k}" for k, v in sorted(r["bytes"].items())), flush=True)
    a, b = results["float32"]["losses"], results["bfloat16"]["losses"]
    diff = np.abs(a - b)
    worst = int(np.argmax(diff))
    total = {g: sum(r["bytes"].values()) for g, r in results.items()}
    print(f"  max |loss(float32) - loss(bfloat16)| over {len(a)} steps: {diff[worst]:.2e} (step {worst + 1}); "
          f"final {a[-1]:.4f} vs {b[-1]:.4f}")
    print(f"  reduction bytes per step bfloat16 / float32: {total['bfloat16'] / total['float32']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
