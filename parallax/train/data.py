"""Token sources and deterministic, per-process batching into global jax.Arrays.

Two sources: the built-in corpus (the running interpreter's standard-library `.py` sources as
bytes, vocab 256; needs no download) and flat binary token files (uint16/uint32 ids, memory
mapped). A `Batcher` turns a 1-D token array into batches where the step number alone fixes the
global batch, so a resumed run sees exactly the batches it would have seen, on any mesh and any
process count. Each process reads only the rows its own devices hold.

A batch row holds T+1 tokens: inputs are `row[:-1]`, targets `row[1:]` (`split_batch`).

Packed documents (`data.eod_id` >= 0): each occurrence of the end-of-document id ends a document
(the built-in corpus appends byte 0 after each source file). A batch then also carries, per input
token, `segment_ids` (the document's index within its row, from 0), `positions` (restarting at 0
at each document start within the row; a row starting inside a document starts that fragment at
0) and `loss_mask` (0 where the input is the end-of-document token: its target is the first token
of the next document). All of it is computed from the row alone, so the batch stays a pure
function of the step.
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


STDLIB_EOD = 0  # the built-in corpus's end-of-document byte: Python refuses source holding a NUL


@functools.lru_cache(maxsize=2)
def stdlib_tokens(documents: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) uint8 token arrays (byte values, vocab 256); read-only, cached.
    `documents`: each file followed by one STDLIB_EOD byte (data.eod_id=0), one file a document."""
    train, val = stdlib_files()
    # Files are concatenated as-is: each already ends in a newline, so boundaries stay lines.
    sep = bytes([STDLIB_EOD]) if documents else b""

    def join(files: list[Path]) -> bytes:
        texts = [p.read_bytes() for p in files]
        if documents:
            for p, t in zip(files, texts):
                if bytes([STDLIB_EOD]) in t:
                    raise DataError(f"built-in corpus 'stdlib': {str(p)!r} holds a NUL byte, the end-of-document "
                                    "mark of data.eod_id=0; set data.eod_id=-1")
        return b"".join(t + sep for t in texts)

    return np.frombuffer(join(train), np.uint8), np.frombuffer(join(val), np.uint8)


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


DOC_KEYS = ("segment_ids", "positions", "loss_mask")  # the packed batch's keys besides inputs/targets


def split_batch(rows: np.ndarray, eod_id: int = -1) -> dict[str, np.ndarray]:
    """[B, T+1] windows -> {'inputs': [B, T], 'targets': [B, T]} (targets are inputs shifted by 1);
    with eod_id >= 0 also DOC_KEYS, int32 [B, T] each (the module docstring)."""
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    if eod_id < 0:
        return batch
    ends = rows[:, :-1] == eod_id  # [B, T]: the input ends its document
    t = ends.shape[1]
    # a new document starts after every end-of-document token: segment = ends strictly before
    segment = np.concatenate([np.zeros_like(ends[:, :1], np.int32), np.cumsum(ends[:, :-1], axis=1, dtype=np.int32)],
                             axis=1)
    starts = np.concatenate([np.ones_like(ends[:, :1]), ends[:, :-1]], axis=1)
    first = np.maximum.accumulate(np.where(starts, np.arange(t, dtype=np.int32), 0), axis=1)
    batch.update(segment_ids=segment, positions=(np.arange(t, dtype=np.int32) - first).astype(np.int32),
                 loss_mask=(~ends).astype(np.int32))
    return batch


class Batcher:
    """Random windows of seq_len+1 tokens from one split; the step number fixes the batch.

    Offsets come from `np.random.default_rng([seed, stream, step])`: no state to checkpoint, and
    any process can compute any step's batch. `stream` keeps the splits' draws independent.
    Evaluation can reuse steps 0..n-1 every time so that its loss is comparable across time.
    """

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int, name: str,
                 stream: int = 0, eod_id: int = -1):
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
        self.eod_id = eod_id  # >= 0: packed documents (split_batch)

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
    """{'inputs', 'targets'} (packed: and DOC_KEYS): int32 [B, T] global arrays laid out as
    `sharding`; each process reads only the rows its own devices hold (with one process, all)."""
    shape = (batcher.global_batch, batcher.seq_len)
    local = split_batch(batcher.batch_rows(step, process_rows(sharding, shape)), batcher.eod_id)  # [b, T] each
    # global_shape is explicit: the sequence dim is always read whole, so it must not be inferred.
    return {k: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v), shape)
            for k, v in local.items()}


def open_data(cfg: Config) -> tuple[Batcher, Batcher]:
    """(train, validation) batchers for `cfg.data.source`: 'stdlib' or a token file path."""
    check_data(cfg)
    src, tr = cfg.data.source, cfg.train
    if src == "stdlib":
        # (called without an argument when unpacked: lru_cache keys f() and f(False) apart)
        train, val = stdlib_tokens(True) if cfg.data.eod_id == STDLIB_EOD else stdlib_tokens()
        label, val_note = "built-in corpus 'stdlib'", "validation split"
    else:
        train, val = load_token_file(src, cfg.data.token_dtype, cfg.model.vocab_size, cfg.data.val_fraction)
        label, val_note = f"data file {src!r}", f"validation split, data.val_fraction={cfg.data.val_fraction}"
    # Separate streams: validation windows are drawn independently of the training ones.
    eod = cfg.data.eod_id
    return (
        Batcher(train, tr.global_batch, tr.seq_len, tr.seed, f"{label} (train split)", stream=0, eod_id=eod),
        Batcher(val, tr.global_batch, tr.seq_len, tr.seed, f"{label} ({val_note})", stream=1, eod_id=eod),
    )
