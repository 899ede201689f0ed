"""`parallax train EXPERIMENT.py [--set key=value ...] [--workdir DIR] [--fresh] [--stop-at STEP] [--profile-steps A:B] [--debug]`.

The command line: it parses the arguments, checks what can be checked before JAX starts, hands
over to the training run (loop.py), `parallax audit` or `parallax plan`, and maps errors to exit
codes.

Order matters: the config is read, checked in full (every field's range, the mesh against the
device count where that is known, batch divisibility, ...) and the simulated CPU device count
chosen before JAX is imported (the XLA flag is read once, at backend start). Everything the user
can get wrong (config, mesh, data, workdir) is checked before the workdir is touched, so a bad
invocation never overwrites anything. User errors print one line and exit with status 2;
`--debug` shows the traceback. Exit 3: `train.max_bad_steps` consecutive non-finite steps stopped
the run (its last good checkpoint is kept). Out of memory on the devices is the user's to fix:
one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import math
import os
import sys
import traceback
from pathlib import Path

from parallax.config import Config, UserError, apply_overrides, check_data, check_fields, check_optim, default_workdir, \
    load_experiment, resolve_mesh_shape
from parallax.train.distributed import (StopSignals, accelerator_platform, configure_host_devices, error_prefix, initialize,
                                  known_device_count, process_spec)
from parallax.train.loop import TrainingDiverged, check_workdir_path, run
from parallax.train.profiler import parse_window
from parallax.train.tracker import check_tracker
from parallax.parallelism import check

EXIT_USAGE = 2
EXIT_DIVERGED = 3  # distinct from user errors: a scheduler should not blindly restart it


def preflight(cfg: Config, n_devices: int | None) -> None:
    """Everything that can be checked from the config alone, before JAX starts: every field's
    range, then, with mesh sizes known (the device count, or no -1 axis), the mesh and every rule
    of `parallelism.check` (a mesh of 100,000 simulated CPU devices would otherwise be created
    before its batch was found indivisible), the data settings (config.check_data) and the
    optimizer's names (config.check_optim), the tracker (metrics.wandb on: the package imports).
    The same checks run again on the real mesh."""
    check_fields(cfg)
    check_data(cfg)
    check_optim(cfg)
    check_tracker(cfg)
    sizes = dataclasses.asdict(cfg.mesh)
    if n_devices is None:
        fixed = math.prod(v for v in sizes.values() if v > 0)
        resolved = resolve_mesh_shape(cfg.mesh, fixed)  # the checks of the sizes themselves
        if -1 in sizes.values():
            return  # an accelerator's count is JAX's to find: the rest waits for the mesh
    else:
        resolved = resolve_mesh_shape(cfg.mesh, n_devices)
    check(cfg, resolved)


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an experiment")
    p.add_argument("experiment", help="an experiment file defining get_config()")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--workdir", help="output directory (default runs/<experiment name>)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace metrics.jsonl of an earlier run that left no checkpoint")
    p.add_argument("--fresh", action="store_true",
                   help="start from step 0; refuse (exit 2) if the workdir holds a checkpoint")
    p.add_argument("--stop-at", type=int, metavar="STEP",
                   help="save and exit 0 after this step, as if preempted; the next run resumes")
    p.add_argument("--profile-steps", metavar="A:B",
                   help="write a jax.profiler trace of steps A..B (1-based, inclusive) to WORKDIR/profile "
                        "(TensorBoard's profile plugin, xprof) and print each step's time breakdown")
    g = p.add_argument_group("multi-process (one process per host; SLURM, Open MPI and Cloud TPU are detected)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env PARALLAX_COORDINATOR)")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the run (env PARALLAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (env PARALLAX_PROCESS_ID)")
    g.add_argument("--heartbeat-timeout", type=int, metavar="S",
                   help="a peer silent this long counts as dead and stops the run (env PARALLAX_HEARTBEAT_TIMEOUT; "
                        "default 100)")


def train_command(args: argparse.Namespace, signals: StopSignals | None = None) -> int:
    # From here on (from the interpreter's start, when __main__ passes them) a signal gets its line.
    with contextlib.nullcontext(signals) if signals is not None else StopSignals() as signals:
        cfg = apply_overrides(load_experiment(args.experiment), args.set)
        if args.stop_at is not None and args.stop_at <= 0:
            raise UserError(f"--stop-at: must be a positive step, got {args.stop_at}")
        window = None if args.profile_steps is None else parse_window(args.profile_steps, cfg.train.steps, args.stop_at)
        platform = accelerator_platform()
        spec = process_spec(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout,
                            platform=platform)
        processes = (spec and spec.num_processes) or 1
        workdir = Path(args.workdir) if args.workdir else default_workdir(cfg)
        preflight(cfg, known_device_count(cfg, processes, platform))  # before JAX starts
        check_workdir_path(workdir)
        print(configure_host_devices(cfg, processes), flush=True)
        if spec is not None:  # before JAX's first computation, after the XLA flags are final
            print(initialize(spec, platform), flush=True)
        run(cfg, workdir, overwrite=args.overwrite, fresh=args.fresh, stop_at=args.stop_at, signals=signals,
            profile=window)
    return 0


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or ("RESOURCE_EXHAUSTED" in text and "memory" in text.lower()
                                          and "os_error_code" not in text)


# Subcommands besides `train`: (module, name); the module defines `add_NAME_parser(sub)` and
# `NAME_command(args) -> exit status` (a dash in NAME is an underscore there). Each command sizes
# the simulated CPU devices before JAX starts, as train does.
_SUBCOMMANDS = (
    ("parallax.analysis.audit", "audit"),
    ("parallax.analysis.plan", "plan"),
    ("parallax.train.prepare", "prepare"),
    ("parallax.interop.hf", "import-hf"),
    ("parallax.interop.hf", "export-hf"),
    ("parallax.infer.sample", "sample"),
    ("parallax.infer.evaluate", "eval"),
)

# Libraries' own lines around parallax's one line (Orbax's absl errors for a failed save, its
# CheckpointHandlerRegistry advice, asyncio's "Future exception was never retrieved" for the
# writes a full disk abandoned): silenced unless --debug; for the CLI's process, to its end.
_QUIET_LOGGERS = ("absl", "asyncio")


def main(argv: list[str] | None = None, signals: StopSignals | None = None) -> int:
    """The CLI; returns the exit status. `signals`: already watching (parallax.__main__)."""
    parser = argparse.ArgumentParser(prog="parallax", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    commands = {"train": lambda args: train_command(args, signals)}
    for module, name in _SUBCOMMANDS:  # none of these modules imports JAX at module load
        mod = importlib.import_module(module)
        getattr(mod, f"add_{name.replace('-', '_')}_parser")(sub)
        commands[name] = getattr(mod, f"{name.replace('-', '_')}_command")
    args = parser.parse_args(argv)
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    if not args.debug:
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return commands[args.command](args)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"{error_prefix()}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as e:
        print(f"{error_prefix()}: error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if _out_of_memory(e) and not args.debug:  # too big for the devices: the user's to fix
            print(f"{error_prefix()}: error: out of memory ({first[:300]}); reduce train.global_batch, train.seq_len "
                  "or the model, or use more devices (`parallax plan` estimates the memory per device)", file=sys.stderr)
            return EXIT_USAGE
        if error_prefix() == "parallax":
            raise
        # Several processes: a normal exit would wait in jax.distributed's shutdown barrier (300 s)
        # while the peers wait in a collective; exiting at once stops the heartbeats, so the peers
        # are stopped within the heartbeat timeout instead.
        traceback.print_exc()
        print(f"{error_prefix()}: error: {type(e).__name__}: {first} (in a multi-process run this often means "
              "another process died first: its log has the cause)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    finally:
        if argv is not None:  # called in-process (tests): leave the loggers as they were
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
