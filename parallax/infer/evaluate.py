"""`parallax eval WORKDIR [--data SOURCE] [--batches N | --full] [--json] [--set mesh.AXIS=SIZE ...]`.

Loss and perplexity of a training workdir's newest checkpoint on held-out data: the validation
split of SOURCE (a prepared directory, a flat token file, or 'stdlib'; default the run's own data).
The program is the training loop's own evaluation step (train_step.make_eval_step) on the run's
layout (its mesh by default; `--set mesh.*` names another), FP8 scales included, so that:

- by default (or `--batches N`), the first N batches of the validation stream the loop evaluates
  on (N = train.eval_batches by default), and the loss is the loop's: the mean of the batch means.
  On the run's own data at its last step this is the eval_loss metrics.jsonl recorded;
- `--full`: every validation window once, in order (train/input.eval_batches), the loss the mean
  over every target token counted (packed documents: the loss mask's).

Perplexity is exp(loss). A progress bar runs on stderr; `--json` prints one JSON object on
stdout. No JAX at module load (cli.py imports this module to build its parser).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from parallax.config import UserError
from parallax.infer.sample import prepare_devices


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss and perplexity of a workdir's newest checkpoint on held-out data")
    p.add_argument("workdir", help="a training run's workdir (holding checkpoints/)")
    p.add_argument("--data", metavar="SOURCE",
                   help="a prepared directory, a token file or 'stdlib' (default: the run's data): "
                        "its validation split")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--batches", type=int, metavar="N",
                   help="the first N validation batches the training loop evaluates on (default train.eval_batches)")
    g.add_argument("--full", action="store_true", help="every validation window once, in order")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--set", action="append", default=[], metavar="mesh.AXIS=SIZE",
                   help="the mesh to evaluate on (default the run's)")


def _batches(cfg, full: bool, n: int | None, sharding):
    """(a callable i -> global batch, the number of batches, a label)."""
    import jax
    import numpy as np

    from parallax.train.data import make_global_batch, process_rows
    from parallax.train.input import eval_batches, open_input

    if full:
        shape = (cfg.train.global_batch, cfg.train.seq_len)
        host = eval_batches(cfg, process_rows(sharding, shape))

        def get(i: int):
            return {k: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v), shape)
                    for k, v in host[i].items()}

        return get, len(host), "every validation window"
    _, val = open_input(cfg)
    return (lambda i: make_global_batch(val, i, sharding)), n, "the training loop's validation batches"


def eval_command(args: argparse.Namespace) -> int:
    if args.batches is not None and args.batches < 1:
        raise UserError(f"--batches: must be >= 1, got {args.batches}")
    for s in args.set:
        if not s.strip().startswith("mesh."):
            raise UserError(f"--set {s!r}: only mesh.* may be set here (the model is the checkpoint's)")
    prepare_devices(args.workdir, args.set, sampling=False)

    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from parallax.config import apply_overrides
    from parallax.infer.decode import mesh_devices, restore_run, saved_config
    from parallax.parallel.mesh import available_devices, describe
    from parallax.train.input import resolve_data, with_source

    cfg, _ = saved_config(args.workdir)
    cfg = apply_overrides(cfg, args.set)
    cfg = with_source(cfg, args.data) if args.data else resolve_data(cfg)
    built, restored = restore_run(args.workdir, cfg, mesh_devices(cfg, available_devices()))
    get, n, label = _batches(cfg, args.full, args.batches or cfg.train.eval_batches, built.batch_sharding)
    step_fn, state = built.eval_step(), restored.state
    console = Console(file=sys.stderr)
    source = cfg.data.source
    console.print(f"parallax: evaluating checkpoint step {restored.step} on {describe(built.mesh)}: {n} batches "
                  f"({label}) of {cfg.train.global_batch} x {cfg.train.seq_len} from {source!r}")
    losses, weights = [], []
    t0 = time.perf_counter()
    columns = (TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("eval", total=n, loss="-")
        for i in range(n):
            batch = get(i)
            losses.append(float(step_fn(state.params, batch, state.fp8)))
            mask = batch.get("loss_mask")  # packed documents: only the counted targets weigh
            weights.append(float(np.sum(mask)) if mask is not None else float(np.prod(batch["targets"].shape)))
            progress.update(task, advance=1, loss=f"{np.mean(losses):.4f}")
    seconds = time.perf_counter() - t0
    if args.full:  # a mean over tokens: batches differ in counted tokens (the padded last one)
        loss = float(np.sum(np.multiply(losses, weights)) / max(np.sum(weights), 1.0))
    else:  # the training loop's eval_loss: the mean of the batch means
        loss = float(np.mean(losses))
    record = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "batches": n, "tokens": int(sum(weights)),
              "step": restored.step, "data": source, "mode": "full" if args.full else "stream",
              "mesh": describe(built.mesh), "seconds": seconds, "batch_losses": losses}
    if args.json:
        print(json.dumps(record), flush=True)
    else:
        print(f"step {restored.step}: loss {loss:.4f}, perplexity {record['perplexity']:.3f} over {n} batches "
              f"({record['tokens']:,} tokens) of {source!r} in {seconds:.1f} s", flush=True)
    return 0

