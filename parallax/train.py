"""`parallax train EXPERIMENT.py [--set key=value ...] [--workdir DIR] [--debug]`.

Order matters: the config is read and the simulated CPU device count chosen before JAX is
imported (the XLA flag is read once, at backend start). Everything the user can get wrong (config,
mesh, data) is checked before the workdir is touched, so a bad invocation never overwrites
anything. User errors print one line and exit with status 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import math
import os
import sys
import time
import traceback
from pathlib import Path

from parallax.config import Config, UserError, apply_overrides, devices_needed, load_experiment

EXIT_USAGE = 2


class WorkdirError(UserError):
    """The workdir already holds a run that this one would overwrite."""


def has_accelerator() -> bool:
    """Whether JAX will find a GPU/TPU, decided without importing JAX."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return any(p in platforms for p in ("cuda", "gpu", "tpu", "rocm"))
    cuda = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    tpu = importlib.util.find_spec("libtpu") is not None
    return bool((cuda and glob.glob("/dev/nvidia[0-9]*")) or (tpu and glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")))


def configure_host_devices(cfg: Config) -> str:
    """On a CPU-only machine, simulate the devices the mesh needs. Returns the line to print."""
    if has_accelerator():
        return "parallax: using the accelerators JAX finds"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return "parallax: no accelerator; using the CPU device count set in XLA_FLAGS"
    n = devices_needed(cfg.mesh)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    return f"parallax: no accelerator found; simulating {n} CPU devices for the mesh (XLA_FLAGS overrides)"


def _layout_lines(cfg: Config, mesh) -> list[str]:
    from parallax.mesh import AXES, describe

    zero = {0: "", 1: "; ZeRO-1 optimizer state on embed", 3: "; ZeRO-3 params + optimizer state on embed"}
    roles = {
        "data": "batch" + zero[cfg.parallel.zero],
        "tensor": "heads, kv_heads, mlp, vocab (Megatron column/row split)",
        "pipe": "pipeline stages",
        "expert": "batch outside MoE layers",
    }
    lines = [f"mesh: {describe(mesh)}"]
    for a in AXES:
        role = roles[a] if mesh.shape[a] > 1 else "-"
        lines.append(f"  {a:<7}{mesh.shape[a]:>4}  {role}")
    return lines


def _params_per_device(abstract_params, shardings) -> int:
    import jax

    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape)
        total += math.prod(shard)
    return total


def _prepare_workdir(workdir: Path, overwrite: bool) -> None:
    metrics = workdir / "metrics.jsonl"
    if metrics.exists() and not overwrite:
        raise WorkdirError(
            f"workdir {str(workdir)!r} already holds a run ({metrics.name}); "
            "choose another --workdir or pass --overwrite to replace it"
        )
    workdir.mkdir(parents=True, exist_ok=True)


def run(cfg: Config, workdir: Path, overwrite: bool = False) -> dict:
    """Train `cfg`; returns the last metrics record. JAX is imported here, not at module load."""
    import jax
    import numpy as np

    from parallax.config import validate
    from parallax.data import make_global_batch, open_data
    from parallax.mesh import make_mesh
    from parallax.metrics import MetricsWriter, Progress, mfu, peak_flops, tflops_per_device
    from parallax.model import count_params, flops_per_token
    from parallax.train_state import init_state, make_layout
    from parallax.train_step import batch_sharding, make_eval_step, make_train_step

    mesh = make_mesh(cfg.mesh)
    validate(cfg, dict(mesh.shape))
    train_data, val_data = open_data(cfg)
    _prepare_workdir(workdir, overwrite)  # only now: every user input has been checked

    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    for line in _layout_lines(cfg, mesh):
        say(line)
    layout = make_layout(cfg, mesh)
    n_total = count_params(cfg.model)["total"]
    n_local = _params_per_device(layout.abstract_state.params, layout.param_shardings)
    say(f"params: {n_total:,} total, {n_local:,} per device; workdir {workdir}")

    state = init_state(cfg, layout)
    bsh = batch_sharding(mesh)
    train_step, eval_step = make_train_step(cfg, layout), make_eval_step(layout)
    t = cfg.train
    tokens_per_step = t.global_batch * t.seq_len
    flops_per_step = flops_per_token(cfg.model, t.seq_len) * tokens_per_step
    peak = peak_flops(mesh.devices.flat[0].device_kind)
    n_dev = mesh.devices.size

    def evaluate() -> float:
        losses = [eval_step(state.params, make_global_batch(val_data, i, bsh)) for i in range(t.eval_batches)]
        return float(np.mean([float(x) for x in losses]))

    started = time.perf_counter()
    batch = make_global_batch(train_data, 0, bsh)
    compiled = train_step.lower(state, batch).compile()
    say(f"compiled train step in {time.perf_counter() - started:.1f} s")

    record: dict = {}
    with MetricsWriter(workdir, enabled=lead) as writer, Progress(t.steps, enabled=lead) as progress:
        for step in range(t.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            if step + 1 < t.steps:  # build the next batch on the host while the device computes
                batch = make_global_batch(train_data, step + 1, bsh)
            metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
            dt = time.perf_counter() - t0
            done = step + 1
            record = {
                "step": done,
                "loss": metrics["loss"],
                "tokens_per_s": tokens_per_step / dt,
                "step_time_s": dt,
                "tflops_per_device": tflops_per_device(flops_per_step, dt, n_dev),
                "mfu": mfu(flops_per_step, dt, n_dev, peak),
                "lr": metrics["lr"],
                "grad_norm": metrics["grad_norm"],
            }
            if (t.eval_every > 0 and done % t.eval_every == 0) or done == t.steps:
                record["eval_loss"] = evaluate()
            if done % t.log_every == 0 or done == t.steps or "eval_loss" in record:
                writer.write(record)
            progress.update(done, record)
    say(f"done: step {record['step']} loss {record['loss']:.4f} eval_loss {record.get('eval_loss', float('nan')):.4f}")
    return record


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an experiment")
    p.add_argument("experiment", help="an experiment file defining get_config()")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--workdir", help="output directory (default runs/<experiment name>)")
    p.add_argument("--overwrite", action="store_true", help="replace metrics of an earlier run in the workdir")


def train_command(args: argparse.Namespace) -> int:
    cfg = apply_overrides(load_experiment(args.experiment), args.set)
    print(configure_host_devices(cfg), flush=True)
    workdir = Path(args.workdir) if args.workdir else Path("runs") / cfg.name
    run(cfg, workdir, overwrite=args.overwrite)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parallax", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    args = parser.parse_args(argv)
    try:
        return train_command(args)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"parallax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
