"""Token sources and deterministic, per-process batching into global jax.Arrays.

Two sources: the built-in corpus (the running interpreter's standard-library `.py` sources as
bytes, vocab 256; needs no download) and flat binary token files (uint16/uint32 ids, memory
mapped). A `Batcher` turns a 1-D token array into batches where the step number alone fixes the
global batch, so a resumed run sees exactly the batches it would have seen, on any mesh and any
process count. Each process reads only the rows its own devices hold.

A batch row holds T+1 tokens: inputs are `row[:-1]`, targets `row[1:]` (`split_batch`).
"""

from __future__ import annotations

import functools
import os
import sysconfig
import zlib
from pathlib import Path

import jax
import numpy as np

from parallax.config import Config, UserError, check_data


class DataError(UserError):
    """A user-facing data error; the one-line message names the file and the constraint."""


# ----------------------------------------------------------------------------------------------
# Built-in corpus: the standard library's Python sources

# Startup must stay fast and the corpus must not depend on what happens to be pip-installed.
_STDLIB_TRAIN_CAP = 24 << 20  # bytes of training text; later files are left out
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_STDLIB_VAL_EVERY = 20  # one file in ~20 is validation


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, validation) source files of the built-in corpus, in corpus order.

    The split is by whole file, chosen by a hash of the relative path, so no text is shared by
    construction and the choice does not move when files are added or removed elsewhere.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                p = Path(dirpath, f)
                found.append((p.relative_to(root).as_posix(), p))
    found.sort()  # os.walk order is filesystem-dependent; the relative posix path is not
    train: list[Path] = []
    val: list[Path] = []
    train_bytes = 0
    for rel, p in found:
        if zlib.crc32(rel.encode()) % _STDLIB_VAL_EVERY == 0:
            val.append(p)
        else:
            train.append(p)
            train_bytes += p.stat().st_size
            if train_bytes >= _STDLIB_TRAIN_CAP:
                break
    if not train or not val:
        raise DataError(
            f"built-in corpus 'stdlib': too few .py files under '{root}'; set data.source to a token file"
        )
    return train, val


@functools.lru_cache(maxsize=1)
def stdlib_tokens() -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) uint8 token arrays (byte values, vocab 256); read-only, cached."""
    train, val = stdlib_files()
    # Files are concatenated as-is: each already ends in a newline, so boundaries stay lines.
    train_bytes = b"".join(p.read_bytes() for p in train)
    val_bytes = b"".join(p.read_bytes() for p in val)
    return np.frombuffer(train_bytes, np.uint8), np.frombuffer(val_bytes, np.uint8)


# ----------------------------------------------------------------------------------------------
# Token files

_TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN_CHUNK = 16 << 20  # tokens per chunk when checking ids: bounds memory on huge files


def load_token_file(path: str | os.PathLike, token_dtype: str, vocab_size: int, val_fraction: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) views of a flat binary file of token ids; the last `val_fraction` of
    tokens is validation. Memory-mapped read-only: only the windows a batch touches are read.
    Split lengths are checked by `Batcher`, which knows the sequence length."""
    label = f"data file {str(path)!r}"
    if token_dtype not in _TOKEN_DTYPES:
        raise DataError(f"{label}: data.token_dtype must be 'uint16' or 'uint32', got {token_dtype!r}")
    dtype = np.dtype(_TOKEN_DTYPES[token_dtype])
    if not os.path.exists(path):
        raise DataError(f"{label} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"{label} is not a regular file")
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise DataError(
            f"{label}: size {size} bytes is not a multiple of {token_dtype} ({dtype.itemsize} bytes)"
        )
    if size == 0:  # np.memmap cannot map an empty file
        raise DataError(f"{label} is empty")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    # JAX gathers never raise on an out-of-range id (they clamp or fill), so a bad file would train
    # on garbage without a word; check every id once, here.
    if vocab_size <= np.iinfo(dtype).max:
        for start in range(0, len(tokens), _SCAN_CHUNK):
            chunk = tokens[start : start + _SCAN_CHUNK]
            if chunk.max() >= vocab_size:
                at = int(np.argmax(chunk >= vocab_size))
                raise DataError(
                    f"{label} holds token id {int(chunk[at])} >= model.vocab_size={vocab_size} "
                    f"(at token {start + at}; is data.token_dtype={token_dtype!r} right?)"
                )
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


# ----------------------------------------------------------------------------------------------
# Batching


def split_batch(rows: np.ndarray) -> dict[str, np.ndarray]:
    """[B, T+1] windows -> {'inputs': [B, T], 'targets': [B, T]} (targets are inputs shifted by 1)."""
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


class Batcher:
    """Random windows of seq_len+1 tokens from one split; the step number fixes the batch.

    Offsets come from `np.random.default_rng([seed, stream, step])`: no state to checkpoint, and
    any process can compute any step's batch. `stream` keeps the splits' draws independent.
    Evaluation can reuse steps 0..n-1 every time so that its loss is comparable across time.
    """

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int, name: str,
                 stream: int = 0):
        if len(tokens.shape) != 1:
            raise DataError(f"{name}: expected a 1-D token array, got shape {tokens.shape}")
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{name}: {len(tokens)} tokens is too short for one sequence of "
                f"train.seq_len+1={seq_len + 1} tokens"
            )
        self.tokens = tokens  # kept as given: a memmap must stay a memmap, not be read in full
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.seed = seed % 2**64  # SeedSequence rejects negative entropy; train.seed may be negative
        self.stream = stream
        self.name = name

    def offsets(self, step: int) -> np.ndarray:
        """[B] window starts of the global batch at `step`, uniform in [0, len - (T+1)]."""
        rng = np.random.default_rng([self.seed, self.stream, step])
        return rng.integers(0, len(self.tokens) - (self.seq_len + 1), size=self.global_batch, endpoint=True)

    def batch_rows(self, step: int, rows: slice | range | np.ndarray | None = None) -> np.ndarray:
        """int32 [b, T+1]: the `rows` of the global batch at `step` (all B rows if None).

        All B offsets are drawn so that every process agrees on the batch, but only the
        selected rows' tokens are read.
        """
        off = self.offsets(step)
        if isinstance(rows, range):
            rows = slice(rows.start, rows.stop, rows.step)
        if rows is not None:
            off = off[rows]
        idx = off[:, None] + np.arange(self.seq_len + 1)  # [b, T+1]
        return np.asarray(self.tokens[idx], dtype=np.int32)


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, int]) -> np.ndarray:
    """Global batch rows this process's devices hold, in the order that
    `jax.make_array_from_process_local_data` expects: distinct row blocks sorted by start."""
    starts = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        start, stop, _ = index[0].indices(shape[0])
        starts[start] = stop
    return np.concatenate([np.arange(a, starts[a]) for a in sorted(starts)])


def make_global_batch(batcher: Batcher, step: int, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """{'inputs', 'targets'}: int32 [B, T] global arrays laid out as `sharding`; each process
    reads only the rows its own devices hold (with one process, all of them)."""
    shape = (batcher.global_batch, batcher.seq_len)
    local = split_batch(batcher.batch_rows(step, process_rows(sharding, shape)))  # [b, T] each
    # global_shape is explicit: the sequence dim is always read whole, so it must not be inferred.
    return {k: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v), shape)
            for k, v in local.items()}


def open_data(cfg: Config) -> tuple[Batcher, Batcher]:
    """(train, validation) batchers for `cfg.data.source`: 'stdlib' or a token file path."""
    check_data(cfg)
    src, tr = cfg.data.source, cfg.train
    if src == "stdlib":
        train, val = stdlib_tokens()
        label, val_note = "built-in corpus 'stdlib'", "validation split"
    else:
        train, val = load_token_file(src, cfg.data.token_dtype, cfg.model.vocab_size, cfg.data.val_fraction)
        label, val_note = f"data file {src!r}", f"validation split, data.val_fraction={cfg.data.val_fraction}"
    # Separate streams: validation windows are drawn independently of the training ones.
    return (
        Batcher(train, tr.global_batch, tr.seq_len, tr.seed, f"{label} (train split)", stream=0),
        Batcher(val, tr.global_batch, tr.seq_len, tr.seed, f"{label} ({val_note})", stream=1),
    )
