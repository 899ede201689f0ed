"""Checkpoints: Orbax async saves, restore onto any mesh, keep-last-N, fallback past damage.

One checkpoint is one Orbax step directory, WORKDIR/checkpoints/<step>, holding two items:
- `state`: the whole TrainState (step, params, optimizer state, and any field a feature adds to
  it, FP8 scales included), pipeline-stacked leaves reshaped to layer-major [L, ...] so that
  mesh.pipe and parallel.repeats may change between save and restore;
- `meta`: JSON with the step (which is also the data position: data.py's batches are a function
  of the step), the seed (the run's only RNG state: initialisation and data order derive from
  it), the fields that fix the state's shapes, the mesh it was written on, the skipped-step
  count and the flat config for the record.

Restore reads into an abstract target whose leaves carry the NEW layout's shardings, so each
process reads only the shards its devices hold, straight into their final placement: no gather
onto one host, no detour through the saved layout (orbax #648, flax #5110).

A save snapshots the state into host memory (`pinned_host`, one copy of each unique shard: the
replicas of a replicated array become distinct pieces) with one dispatch and returns; Orbax's
own save (its host copies, directory setup, writing, finalizing) then runs on a writer thread
at `checkpoint.background_nice`. The training loop waits only for the dispatch, and the
next step may donate the state: the snapshot was ordered before it. This is torchtitan's
`async_with_pinned_mem` staging, for Orbax.

Crash safety is Orbax's: a save is written into `<step>.orbax-checkpoint-tmp*` and renamed when
complete, listing ignores unrenamed directories, and a kill -9 mid-save leaves only such a
directory (removed when the next run opens the manager for writing). A finalized checkpoint that
later fails to read is moved to WORKDIR/checkpoints_damaged/, never deleted, and the next older
one is restored instead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import inspect
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import CheckpointConfig, Config, UserError, flatten
from parallax.parallel.mesh import describe
from parallax.parallel.pipeline import to_layer_major, to_stages
from parallax.model.logical import entry_axes
from parallax.train.train_state import Layout, TrainState

FORMAT = 1
# Fields that fix the state's shapes: a change makes the checkpoint unusable, so it is refused
# with the field's name. Shapes are also compared array by array (`check_shapes`), which catches
# what this list does not name (FP8 history length, optimizer chain changes). Dtypes are not
# compared: the restore reads each array into the dtype of the config's state (`DiskForm.target`),
# so a run saved with one optim.mu_dtype resumes under the other (bfloat16 -> float32 exactly,
# float32 -> bfloat16 rounded to nearest; tests/test_optim.py).
STRUCTURAL = (
    "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.d_ff",
    "model.vocab_size", "model.tie_embeddings", "model.moe.num_experts", "model.moe.every",
    "model.moe.d_ff", "model.moe.shared_experts",
)
# The seed fixes the data order and the initialisation: resuming under another seed would
# silently train on a different stream than the checkpoint's run.
IDENTITY = ("train.seed",)
DAMAGED_DIR = "checkpoints_damaged"
_STACKED_KEY = "layers"  # the scanned block stack: the leaves the pipeline reshapes to stages


class CheckpointError(UserError):
    """A checkpoint that does not fit the config, or none usable: one line, exit 2."""


@dataclass(frozen=True)
class Damaged:
    step: int
    reason: str


@dataclass
class Restored:
    state: TrainState
    step: int
    meta: dict
    damaged: list[Damaged] = field(default_factory=list)  # newer steps that failed to read


def make_meta(cfg: Config, step: int, mesh: jax.sharding.Mesh, **extra: Any) -> dict:
    flat = flatten(cfg)
    return {
        "format": FORMAT,
        "step": step,
        "data_position": step,
        "seed": cfg.train.seed,
        "fixed": {k: flat[k] for k in STRUCTURAL + IDENTITY},
        "mesh": describe(mesh),
        "config": flat,
        **extra,
    }


# ----------------------------------------------------------------------------------------------
# The on-disk form: layer-major, whatever the pipeline layout


def _is_stacked(path: tuple) -> bool:
    """A parameter (or optimizer moment) of the block stack, in stage layout when pipelined. The
    FP8 state's `layers` stay layer-major in the train state (pipeline.py reshapes them inside
    the loss), so they are not converted."""
    first = getattr(path[0], "name", None) if path else None
    return first != "fp8" and any(getattr(k, "key", None) == _STACKED_KEY for k in path)


def _layer_major_sharding(s: NamedSharding, layers: int) -> NamedSharding:
    """[R, P, Lc, ...] placement -> [L, ...]: L sharded over the axes of the three leading dims
    (in practice `pipe`). With R = 1 the reshape moves no data; with R > 1 XLA moves chunks
    between stages (layer v*Lc.. lives on stage v mod P, but on disk block s holds layers s*R*Lc..).
    Uneven stages (L not a multiple of those axes' size, e.g. 3 layers on 2 stages): the L
    dimension cannot be split evenly, so it is left unsharded (the snapshot's `_spread` still
    cuts the other dimensions)."""
    spec = tuple(s.spec) + (None,) * max(0, 3 - len(s.spec))
    lead = tuple(a for e in spec[:3] for a in entry_axes(e))
    if layers % math.prod(s.mesh.shape[a] for a in lead):
        lead = ()
    return NamedSharding(s.mesh, P(lead or None, *spec[3:]))


class DiskForm:
    """reshape_to_disk / from_disk between a layout's TrainState and its layer-major saved form, and the
    abstract saved form with shardings (the restore target). Identity when not pipelined."""

    def __init__(self, layout: Layout):
        self.pipelined = layout.schedule is not None
        self.units = layout.schedule.units if self.pipelined else 0  # uneven stages: saved without padding
        shapes = jax.eval_shape(self.reshape_to_disk, layout.abstract_state)
        shard_of = jax.tree_util.tree_map_with_path(
            lambda p, s, x: _layer_major_sharding(s, x.shape[0]) if self.pipelined and _is_stacked(p) else s,
            layout.state_shardings, shapes,
        )
        self.target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shard_of
        )
        if self.pipelined:
            schedule = layout.schedule
            self._from_disk = jax.jit(
                lambda st: jax.tree_util.tree_map_with_path(
                    lambda p, x: to_stages(x, schedule) if _is_stacked(p) else x, st),
                out_shardings=layout.state_shardings,
            )

    def reshape_to_disk(self, state: TrainState) -> TrainState:
        if not self.pipelined:
            return state
        units = self.units
        return jax.tree_util.tree_map_with_path(lambda p, x: to_layer_major(x, units) if _is_stacked(p) else x, state)

    def from_disk(self, state: TrainState) -> TrainState:
        return self._from_disk(state) if self.pipelined else state


def _spread(shape: tuple[int, ...], sharding: NamedSharding, memory_kind: str) -> NamedSharding:
    """`sharding` with each mesh axis it leaves unused added to the first dimension that it still
    divides, in `memory_kind`: a snapshot then holds each element once per process instead of
    once per replica (ZeRO-1's replicated parameters, norms). Cutting a replicated array needs no
    communication: each device keeps its piece of the copy it already has. What no dimension
    divides stays replicated (scalars, odd-sized vectors: small)."""
    mesh = sharding.mesh
    spec = [entry_axes(e) for e in tuple(sharding.spec)] + [()] * (len(shape) - len(sharding.spec))
    used = {a for e in spec for a in e}
    for axis in mesh.axis_names:
        if axis in used or mesh.shape[axis] == 1:
            continue
        for d, n in enumerate(shape):
            if n % (math.prod(mesh.shape[a] for a in spec[d]) * mesh.shape[axis]) == 0:
                spec[d], used = spec[d] + (axis,), used | {axis}
                break
    return NamedSharding(mesh, P(*(e[0] if len(e) == 1 else (e or None) for e in spec)), memory_kind=memory_kind)


def _host_memory_kind() -> str:
    """Pinned host memory where the backend offers it (jaxlib 0.10.2's CPU backend does; JAX
    documents it for accelerators, unverified here): the snapshot then takes no accelerator
    memory. Elsewhere the default memory kind: the snapshot costs that much device memory."""
    kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else jax.local_devices()[0].default_memory().kind


def make_snapshot(layout: Layout, disk: DiskForm) -> Any:
    """TrainState -> its layer-major saved form, copied into host memory with `_spread`
    shardings. One jitted dispatch; the copy is not aliased to the state (jnp.copy: jit would
    otherwise forward an unchanged input), so the next step may donate the state.

    Compiled here, with the run's other start-up compiles, rather than inside the first save
    (130 ms for the quickstart model); jit's cache serves the calls."""
    kind = _host_memory_kind()
    shardings = jax.tree.map(lambda x: _spread(x.shape, x.sharding, kind), disk.target)
    snapshot = jax.jit(lambda st: jax.tree.map(jnp.copy, disk.reshape_to_disk(st)), out_shardings=shardings)
    snapshot.lower(jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                layout.abstract_state, layout.state_shardings)).compile()
    return snapshot


# ----------------------------------------------------------------------------------------------
# Compatibility checks (read-only; they run before anything in the workdir is written)


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """'params/layers/mlp/wi/kernel' -> shape. Orbax stores namedtuples as dicts and tuples as
    lists, so attribute names, dict keys and indices all flatten to the same path strings."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(_key(k) for k in path): tuple(x.shape) for path, x in leaves if hasattr(x, "shape")}


def check_config(meta: dict, cfg: Config, where: str) -> None:
    flat = flatten(cfg)
    for key, saved in meta.get("fixed", {}).items():
        if key in flat and flat[key] != saved:
            why = "it fixes parameter shapes" if key in STRUCTURAL else "the data order and initialisation follow it"
            raise CheckpointError(
                f"{key}={flat[key]!r} but {where} was written with {key}={saved!r} ({why}); "
                f"set {key}={saved!r} to resume, or choose another --workdir"
            )


def check_shapes(saved: Any, target: Any, where: str) -> None:
    have, want = _shapes(saved), _shapes(target)
    for path in sorted(have.keys() | want.keys()):
        if have.get(path) != want.get(path):
            there = "absent" if path not in have else str(have[path])
            here = "absent" if path not in want else str(want[path])
            raise CheckpointError(
                f"{where} does not fit this config: {path} is {there} in the checkpoint and {here} here; "
                "resume with the config it was written with, or choose another --workdir"
            )


def _out_of_memory(e: BaseException) -> bool:
    """XLA's and the host's out-of-memory errors. TensorStore reports a full disk as
    RESOURCE_EXHAUSTED too, with the OS error code: that one is about the files."""
    text = str(e)
    return isinstance(e, MemoryError) or ("RESOURCE_EXHAUSTED" in text and "os_error_code" not in text
                                          and not _disk_errno(e) and "memory" in text.lower())


def _disk_errno(e: BaseException) -> int | None:
    for _ in range(10):
        if isinstance(e, OSError) and e.errno:
            return e.errno
        m = re.search(r"os_error_code='?(\d+)", str(e))
        if m:
            return int(m.group(1))
        if e.__cause__ is None and e.__context__ is None:
            return None
        e = e.__cause__ or e.__context__
    return None


def _raise_if_not_about_the_files(e: Exception) -> None:
    """Reading errors mark a checkpoint damaged; running out of memory says nothing about the
    files, so it propagates instead of moving a good checkpoint aside."""
    if _out_of_memory(e):
        raise e


def _reason(e: BaseException) -> str:
    """One line for the user. Orbax wraps TensorStore's error (which names the file and what is
    wrong with it) in a generic one that quotes a whole spec: report the innermost cause."""
    code = _disk_errno(e)
    for _ in range(10):
        if e.__cause__ is None:
            break
        e = e.__cause__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if code and not isinstance(e, OSError):  # TensorStore: "... [os_error_code='28']": say it in words
        where = re.search(r'local file "([^"]+)"', text)
        return f"{os.strerror(code)}, writing {where.group(1)}" if where else f"{os.strerror(code)}: {text[:300]}"
    text = text.split(" [tensorstore_spec")[0].split(" See full TensorStore details")[0]
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


# ----------------------------------------------------------------------------------------------
# The manager


def _handlers() -> dict:
    """Declared up front so that metadata can be read before any restore has named the items.

    Orbax's default on CPU/TPU cuts every replicated array into per-replica slices so that the
    replicas write in parallel; each slice is a device dispatch inside the blocking part of the
    save, which halves when it is off (quickstart: ~44 -> ~20 ms, experiments/bench_checkpoint.py).
    One writer per shard, as Orbax already does on GPU; ZeRO shards the large states anyway.
    """
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, th.NumpyHandler()),
        (np.number, th.ScalarHandler()),
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
    )
    return {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry), "meta": ocp.JsonCheckpointHandler()}


@contextlib.contextmanager
def _quiet_failed_reads():
    """Orbax leaves the per-array read coroutines of a failed restore to the garbage collector,
    which reports each one's error on stderr ("Exception ignored in <coroutine ...>" with the
    array's whole TensorStore spec: 27,000 lines for a tiny model with one truncated file), and
    late TensorStore callbacks hit the closed event loop. The failure is reported once, as one
    line, by `restore`; only those two kinds are dropped, anything else reaches the usual hook."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        loop_closed = isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value)
        if not (inspect.iscoroutine(unraisable.object) or loop_closed):
            previous(unraisable)

    sys.unraisablehook = hook
    failed: list[bool] = []
    try:
        yield failed
    finally:
        gc.collect()  # collect the abandoned coroutines while the hook is in place
        if not failed:  # after a failed read, TensorStore callbacks can still arrive: keep it
            sys.unraisablehook = previous


def _drop_closed_loop_errors() -> None:
    """From the first save on, for the process's life: a write that fails (a full disk) leaves
    TensorStore callbacks that reach Orbax's closed event loop and print one traceback each
    (55 for the tiny model) around the one-line error. Only that RuntimeError is dropped; every
    other unraisable error still reaches the previous hook. Installed once."""
    previous = sys.unraisablehook
    if getattr(previous, "_parallax_drops_closed_loop", False):
        return

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if not (isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)):
            previous(unraisable)

    hook._parallax_drops_closed_loop = True
    sys.unraisablehook = hook


def _thread_ids() -> set[int]:
    """This process's OS threads (Linux: /proc/self/task); empty where there is no such view."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _lower_priority(threads: set[int], nice: int) -> None:
    """Run the save's background threads (Orbax's writers, tensorstore's pool, and whatever they
    start, which inherits it) at a lower CPU priority, so that on a host whose cores the step
    also needs the write takes the idle cycles instead of the step's (BUILD_NOTES.md,
    "Checkpoints"). Best effort: a thread may already have exited."""
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


def _coordination_barriers(directory: Path) -> dict:
    """CheckpointManagerOptions that make every barrier of a multi-process save a wait at the
    coordination service (the distributed client's `wait_at_barrier`) instead of a device
    all-gather. Orbax's `sync_global_processes` takes that path when `active_processes` is set
    (here: all processes, so it means what None does); left None it calls `sync_global_devices`,
    a jitted collective, from whichever thread saves: our writer thread and Orbax's own. A
    collective launched beside the train step's is ordered differently on each process, and two
    processes hung for good at the first step after a periodic save (notes/savehang.md; Orbax's
    `MultihostSynchronizedValue` warns the same). `AsyncOptions.barrier_sync_fn` alone would not
    do: it covers only the async part, not the manager's and checkpointer's barriers.

    Orbax refuses `create=True` with `active_processes`: process 0 creates the directory here, on
    the main thread, behind a barrier. One process: no barriers at all, options unchanged."""
    if jax.process_count() == 1:
        return {}
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    multihost_utils.sync_global_devices("parallax_checkpoint_directory")  # main thread, no save in flight
    processes = set(range(jax.process_count()))
    return {"create": False, "multiprocessing_options": ocp.options.MultiprocessingOptions(active_processes=processes)}


class Checkpoints:
    """WORKDIR/checkpoints. Reading (`steps`, `restore`) writes nothing; `open` prepares saving."""

    def __init__(self, workdir: str | os.PathLike, cfg: CheckpointConfig | None = None):
        self.workdir = Path(workdir).absolute()
        self.directory = self.workdir / "checkpoints"
        self.cfg = cfg or CheckpointConfig()
        self.last_saved: int | None = None
        self._manager: ocp.CheckpointManager | None = None
        self._disk: DiskForm | None = None
        self._snapshot: Any = None  # jitted: TrainState -> host copy of its saved form
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._writing: concurrent.futures.Future | None = None  # Orbax's save of the last snapshot
        self._failed = False  # a save failed (and was reported)

    def _reader(self) -> ocp.CheckpointManager:
        # create=False and no tmp cleanup: reading never changes the workdir.
        options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    def reader(self) -> ocp.CheckpointManager:
        """A manager that only reads (as `steps` and `restore` do): for callers that restore parts
        of a checkpoint themselves (interop/hf.py exports one parameter at a time)."""
        return self._reader()

    def steps(self) -> list[int]:
        """Finalized checkpoint steps, oldest first (directories still being written are not)."""
        if not self.directory.is_dir():
            return []
        with self._reader() as manager:
            return sorted(manager.all_steps())

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def restore(self, cfg: Config, layout: Layout) -> Restored:
        """The newest readable checkpoint, restored into `layout`'s shardings.

        A step that fails to read is recorded as damaged and the next older one is tried; a
        checkpoint that reads but does not fit `cfg` raises CheckpointError at once (an older
        one would not fit either, and falling back would silently discard training).
        """
        disk = self._disk = DiskForm(layout)
        damaged: list[Damaged] = []
        with self._reader() as manager, _quiet_failed_reads() as failed:
            for step in sorted(manager.all_steps(), reverse=True):
                where = f"checkpoint {str(self.path(step))!r}"
                try:
                    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                    saved = manager.item_metadata(step)["state"]
                    if saved is None:
                        raise ValueError("no array metadata for item 'state'")
                except Exception as e:  # unreadable: damaged or partial; try the previous one
                    _raise_if_not_about_the_files(e)
                    damaged.append(Damaged(step, _reason(e)))
                    failed.append(True)
                    continue
                check_config(meta, cfg, where)
                check_shapes(getattr(saved, "tree", saved), disk.target, where)
                try:
                    restore_args = ocp.checkpoint_utils.construct_restore_args(disk.target)
                    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(disk.target, restore_args=restore_args))
                    state = jax.block_until_ready(manager.restore(step, args=args)["state"])
                except Exception as e:  # a truncated or missing array file
                    _raise_if_not_about_the_files(e)
                    damaged.append(Damaged(step, _reason(e)))
                    failed.append(True)
                    continue
                return Restored(disk.from_disk(state), step, meta, damaged)
        listed = "; ".join(f"step {d.step}: {d.reason}" for d in damaged)
        raise CheckpointError(
            f"no readable checkpoint in {str(self.directory)!r} ({listed}); "
            "move the directory away to start over, or choose another --workdir"
        )

    def open(self, layout: Layout, damaged: list[Damaged] = ()) -> list[tuple[Damaged, Path]]:
        """Move damaged steps aside (so a later save of the same step cannot collide with them),
        then create the writing manager. Returns (damaged, where it went) pairs."""
        moved = [(d, self._move_aside(d.step)) for d in damaged]
        if self._disk is None:
            self._disk = DiskForm(layout)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(self.cfg.keep),
            cleanup_tmp_directories=True,  # leftovers of a save that a kill interrupted
            enable_async_checkpointing=True,
            **_coordination_barriers(self.directory),
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        self._snapshot = make_snapshot(layout, self._disk)
        _drop_closed_loop_errors()
        # One writer: Orbax's saves run in order, and the threads they start inherit its priority.
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="parallax-checkpoint",
            initializer=lambda: _lower_priority({threading.get_native_id()}, self.cfg.background_nice)
            if self.cfg.background_nice else None,
        )
        return moved

    def _move_aside(self, step: int) -> Path:
        dest_dir = self.workdir / DAMAGED_DIR
        dest = dest_dir / str(step)
        n = 1
        while dest.exists():
            dest, n = dest_dir / f"{step}.{n}", n + 1
        if jax.process_index() == 0:
            dest_dir.mkdir(parents=True, exist_ok=True)
            os.replace(self.path(step), dest)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"parallax_checkpoint_move_{step}")
        return dest

    def save(self, step: int, state: TrainState, meta: dict) -> Path:
        """Snapshot `state` into host memory and hand it to the writer; returns after the dispatch,
        and the next step may donate `state`. The previous save is finished first (its errors are
        raised here), so at most one snapshot is held."""
        self.wait()
        snapshot = self._snapshot(state)
        self._writing = self._writer.submit(self._write, step, snapshot, meta)
        self.last_saved, self._failed = step, False
        return self.path(step)

    def _write(self, step: int, snapshot: TrainState, meta: dict) -> None:
        """On the writer thread: Orbax's async save of the snapshot (it returns once its own
        background threads have the data)."""
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(snapshot), meta=ocp.args.JsonSave(meta))
        before = _thread_ids() if self.cfg.background_nice else set()
        self._manager.save(step, args=args, force=True)
        if self.cfg.background_nice:  # threads of pools the writer did not start (tensorstore's)
            _lower_priority(_thread_ids() - before, self.cfg.background_nice)

    def wait(self) -> None:
        """Block until the last save is finalized (renamed into place, older ones removed). A save
        that failed (on the writer thread or in Orbax's background) is raised here as one line
        naming the step's directory; the checkpoints finalized before it are untouched."""
        writing, self._writing = self._writing, None
        try:
            if writing is not None:
                writing.result()
            if self._manager is not None and not self._failed:
                try:
                    self._manager.wait_until_finished()
                except Exception:
                    self._failed = True  # Orbax raises it again on every wait and at close: report it once
                    raise
        except Exception as e:
            _raise_if_not_about_the_files(e)
            raise CheckpointError(
                f"saving checkpoint {str(self.path(self.last_saved))!r} failed ({_reason(e)}); "
                "the checkpoints finalized before it are kept"
            ) from e

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the last save to be finalized (and old ones removed), then release."""
        if self._manager is None:
            return
        try:
            if not self._failed:
                self.wait()
        finally:
            manager, writer, self._manager, self._writer = self._manager, self._writer, None, None
            writer.shutdown(wait=True)
            try:
                manager.close()
            except Exception as e:  # after a failed save Orbax repeats that failure here: said once already
                if not self._failed:
                    _raise_if_not_about_the_files(e)
                    raise CheckpointError(f"closing the checkpoints in {str(self.directory)!r} failed ({_reason(e)})") from e
