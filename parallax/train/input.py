"""The input pipeline on grain: sources, a seeded shuffle, a weighted mixture, per-process rows,
packed documents, background prefetch.

A source is a token stream (the built-in corpus, a flat token file, or a prepared directory from
`parallax prepare`) split into train and validation. Its records are windows of T+1 tokens at
stride T (record i = tokens[i*T : i*T + T+1]): every token is a target once per epoch, and the
windows carry the end-of-document ids, so `data.split_batch` gives the segment ids, positions and
loss mask of packed documents. Each source is a `grain.MapDataset` over those windows, shuffled
with a seed of its own (`data.shuffle`: reshuffled every epoch by grain's index shuffle) and
repeated without end; several sources are interleaved by `MapDataset.mix` in proportion to
`data.weights` (windows all hold T+1 tokens, so the token shares are the weights).

The global batch at step s is records s*B .. s*B+B-1 of that dataset: random access, no iterator
state. A resumed run, on any mesh and any process count, reads exactly the batches an
uninterrupted one would; each process reads only the rows its devices hold (`data.process_rows`).
Evaluation reads validation batches 0..n-1 every time, so its loss is comparable across time.

The loop takes its batches from a `Feed`: grain's threads build the host rows of the next
`data.prefetch` steps while the current one runs, and `Feed.next` says how long the loop waited
(metrics.jsonl's `input_wait_s`). Setting PARALLAX_INPUT_TRACE=DIR makes every process append
what it fed to DIR/input.<process>.jsonl (step, rows, a CRC-32 per row), to compare data orders.

`eval_batches` serves `parallax eval`: every validation window once, in order.

grain imports JAX: this module imports it only inside functions (resolve_data runs before JAX is
configured).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
import zlib
from pathlib import Path

import numpy as np

from parallax.config import Config, check_data, data_sources
from parallax.train.data import (STDLIB_EOD, DataError, load_token_file, process_rows, split_batch,
                                 stdlib_tokens)
from parallax.train.prepare import check_vocab, open_prepared

TRACE_ENV = "PARALLAX_INPUT_TRACE"
TRAIN_STREAM, VAL_STREAM = 0, 1  # keep the splits' shuffles independent


# ----------------------------------------------------------------------------------------------
# Sources


def _label(src: str) -> str:
    if src == "stdlib":
        return "built-in corpus 'stdlib'"
    return f"prepared data {src!r}" if Path(src).is_dir() else f"data file {src!r}"


def _tokenizer_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolve_data(cfg: Config) -> Config:
    """`cfg` with data.eod_id taken from the prepared directories' manifests, after the checks that
    need the files: a vocabulary larger than model.vocab_size, a data.eod_id that is not the
    manifest's, a mixture of different tokenizers. One line naming the source; needs no JAX."""
    check_data(cfg)
    sources, _ = data_sources(cfg.data)
    key = "data.sources" if cfg.data.sources else "data.source"
    prepared = {}  # path -> (eod_id, vocab_size, tokenizer digest)
    for src in sources:
        if src != "stdlib" and Path(src).is_dir():
            p = open_prepared(src)  # a directory that is not a prepared one: its one line
            check_vocab(p, cfg.model.vocab_size)
            prepared[src] = (p.eod_id, p.vocab_size, _tokenizer_digest(p.tokenizer_path))
    if not prepared:
        return cfg
    (first, spec), *rest = prepared.items()
    for other, o in rest:
        if o != spec:
            raise DataError(f"{key}: {first!r} (vocab {spec[1]}, eod_id {spec[0]}) and {other!r} (vocab {o[1]}, "
                            f"eod_id {o[0]}) were prepared with different tokenizers; a mixture needs one")
    if "stdlib" in sources:
        raise DataError(f"{key}: the built-in corpus 'stdlib' (bytes) and {first!r} (its tokenizer.json) use "
                        "different tokenizers; a mixture needs one")
    eod = spec[0]
    if cfg.data.eod_id not in (-1, eod):
        raise DataError(f"data.eod_id={cfg.data.eod_id} but {first!r} ends its documents with eod_id={eod} "
                        f"(manifest.json); leave data.eod_id at -1 (the manifest's) or set it to {eod}")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eod_id=eod))


def with_source(cfg: Config, source: str) -> Config:
    """`cfg` reading `source` alone (a prepared directory, a token file or 'stdlib'), resolved:
    what `parallax eval WORKDIR --data DIR` evaluates on (the eod_id is the new source's)."""
    eod = cfg.data.eod_id  # a token file: the run's (the user's word for it)
    if Path(source).is_dir() or (source == "stdlib" and eod != STDLIB_EOD):
        eod = -1  # a prepared directory: its manifest's; 'stdlib': documents only if the run had them
    d = dataclasses.replace(cfg.data, source=source, sources=(), weights=(), eod_id=eod)
    return resolve_data(dataclasses.replace(cfg, data=d))


def read_splits(src: str, cfg: Config) -> tuple[np.ndarray, np.ndarray, str, str]:
    """(train tokens, validation tokens, train label, validation label) of one source of a
    resolved `cfg`; token files and prepared splits stay memory-mapped."""
    d, label = cfg.data, _label(src)
    if src == "stdlib":
        # (called without an argument when unpacked: lru_cache keys f() and f(False) apart)
        train, val = stdlib_tokens(True) if d.eod_id == STDLIB_EOD else stdlib_tokens()
        return train, val, f"{label} (train split)", f"{label} (validation split)"
    if Path(src).is_dir():
        p = open_prepared(src)
        return p.train.tokens, p.val.tokens, f"{label} (train.bin)", f"{label} (val.bin)"
    train, val = load_token_file(src, d.token_dtype, cfg.model.vocab_size, d.val_fraction)
    return train, val, f"{label} (train split)", f"{label} (validation split, data.val_fraction={d.val_fraction})"


class Windows:
    """grain random-access source: record i is tokens[i*T : i*T + T+1] as int32 [T+1]."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str):
        if len(tokens) < seq_len + 1:
            raise DataError(f"{name}: {len(tokens)} tokens is too short for one sequence of "
                            f"train.seq_len+1={seq_len + 1} tokens")
        self.tokens, self.seq_len, self.name = tokens, seq_len, name  # a memmap stays one: rows are read on demand

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        t = self.seq_len
        return np.asarray(self.tokens[i * t : i * t + t + 1], dtype=np.int32)

    def __repr__(self) -> str:  # grain names its sources in error notes
        return f"Windows({self.name}, {len(self)} x {self.seq_len + 1})"


def _seed32(seed: int, stream: int, index: int) -> int:
    """A grain shuffle seed (0..2**32-1) for one source of one split, from train.seed."""
    return int(np.random.SeedSequence([seed % 2**64, stream, index]).generate_state(1)[0])


def _records(windows: list[Windows], weights: tuple[float, ...], shuffle: bool, seed: int, stream: int):
    """The endless record stream: each source shuffled (per epoch) and repeated, then mixed."""
    import grain

    parts = []
    for i, w in enumerate(windows):
        ds = grain.MapDataset.source(w)
        if shuffle:
            ds = ds.shuffle(seed=_seed32(seed, stream, i))
        parts.append(ds.repeat())  # shuffle first: grain reseeds every epoch of a shuffled source
    return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, list(weights))


# ----------------------------------------------------------------------------------------------
# Batches


class BatchSource:
    """The global batches of one split: step s is records s*B .. s*B+B-1 of the mixed stream.
    Has Batcher's interface (`batch_rows`, `global_batch`, `seq_len`, `eod_id`), so
    `data.make_global_batch` lays its batches out on a mesh."""

    def __init__(self, windows: list[Windows], weights: tuple[float, ...], global_batch: int, seed: int,
                 stream: int, eod_id: int, shuffle: bool, name: str):
        self.windows, self.weights = windows, weights
        self.global_batch, self.seq_len, self.eod_id, self.name = global_batch, windows[0].seq_len, eod_id, name
        self.records = _records(windows, weights, shuffle, seed, stream)

    def batch_rows(self, step: int, rows: slice | range | np.ndarray | None = None) -> np.ndarray:
        """int32 [b, T+1]: the `rows` of the global batch at `step` (all B if None); only these are read."""
        b = self.global_batch
        index = np.arange(b)[rows] if rows is not None else np.arange(b)
        return np.stack([self.records[step * b + int(r)] for r in index])


def open_input(cfg: Config) -> tuple[BatchSource, BatchSource]:
    """(train, validation) batches of a resolved `cfg` (resolve_data): its source or mixture."""
    check_data(cfg)
    sources, weights = data_sources(cfg.data)
    t, d = cfg.train, cfg.data
    train, val = [], []
    for src in sources:
        tr, va, tr_name, va_name = read_splits(src, cfg)
        train.append(Windows(tr, t.seq_len, tr_name))
        val.append(Windows(va, t.seq_len, va_name))
    name = " + ".join(sources)
    return (BatchSource(train, weights, t.global_batch, t.seed, TRAIN_STREAM, d.eod_id, d.shuffle, name),
            BatchSource(val, weights, t.global_batch, t.seed, VAL_STREAM, d.eod_id, d.shuffle, name))


def _host_batch(source: BatchSource, rows: np.ndarray, step: int) -> tuple[int, dict, list[int]]:
    """(step, split_batch of this process's rows, a CRC-32 per row): one element of the Feed."""
    got = source.batch_rows(step, rows)  # [b, T+1]
    return step, split_batch(got, source.eod_id), [zlib.crc32(r.tobytes()) for r in got]


class Feed:
    """The training batches of steps start..end-1 as global arrays, built ahead on grain's threads
    (a MapDataset over step numbers, read through `to_iter_dataset` with `data.prefetch` buffered
    and `data.read_threads` threads) while the loop's step runs."""

    def __init__(self, source: BatchSource, start: int, end: int, sharding, prefetch: int, threads: int):
        import grain
        import jax

        self.source, self.sharding = source, sharding
        self.shape = (source.global_batch, source.seq_len)
        self.rows = process_rows(sharding, self.shape)
        steps = grain.MapDataset.range(start, end).map(functools.partial(_host_batch, source, self.rows))
        options = grain.ReadOptions(num_threads=threads if prefetch else 0, prefetch_buffer_size=prefetch)
        self._it = iter(steps.to_iter_dataset(options))
        self.step = start
        trace = os.environ.get(TRACE_ENV)
        self._trace = None
        if trace:
            Path(trace).mkdir(parents=True, exist_ok=True)
            self._trace = open(Path(trace) / f"input.{jax.process_index()}.jsonl", "a")

    def next(self) -> tuple[dict, float]:
        """(the batch of the next step, seconds the caller waited for it: queue and device layout)."""
        import jax

        t0 = time.perf_counter()
        step, local, crcs = next(self._it)
        if step != self.step:  # the MapDataset's order is the step order: anything else is a bug
            raise RuntimeError(f"input feed: expected the batch of step {self.step}, got step {step}")
        batch = {k: jax.make_array_from_process_local_data(self.sharding, np.ascontiguousarray(v), self.shape)
                 for k, v in local.items()}
        waited = time.perf_counter() - t0
        if self._trace is not None:
            self._trace.write(json.dumps({"step": step, "rows": self.rows.tolist(), "crc32": crcs}) + "\n")
            self._trace.flush()
        self.step += 1
        return batch, waited

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
        if self._trace is not None:
            self._trace.close()


# ----------------------------------------------------------------------------------------------
# Evaluation over a whole validation split


class EvalBatches:
    """Every validation window of one source once, in order, as host batches of B rows:
    `len()` batches, each {'inputs', 'targets'} (and with documents DOC_KEYS) int32 [b, T] for
    the `rows` asked for. With documents (eod_id >= 0) the last batch is filled up with rows
    whose loss_mask is 0 (they count for nothing), so every window counts once; without, the
    windows past the last full batch (fewer than B) are left out."""

    def __init__(self, windows: Windows, global_batch: int, eod_id: int, rows: np.ndarray | None = None):
        self.windows, self.global_batch, self.eod_id = windows, global_batch, eod_id
        self.rows = np.arange(global_batch) if rows is None else np.asarray(rows)
        n = len(windows)
        self.n_batches = -(-n // global_batch) if eod_id >= 0 else n // global_batch
        if self.n_batches == 0:
            raise DataError(f"{windows.name}: {n} windows of train.seq_len+1={windows.seq_len + 1} tokens are fewer "
                            f"than one batch of train.global_batch={global_batch}")
        self.tokens = (n if eod_id >= 0 else self.n_batches * global_batch) * windows.seq_len  # targets read

    def __len__(self) -> int:
        return self.n_batches

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.n_batches:
            raise IndexError(i)
        pad = np.full(self.windows.seq_len + 1, self.eod_id, np.int32)  # all eod: loss_mask 0 everywhere
        k = i * self.global_batch
        rows = [self.windows[k + r] if k + r < len(self.windows) else pad for r in self.rows]
        return split_batch(np.stack(rows), self.eod_id)

    def __iter__(self):
        return (self[i] for i in range(self.n_batches))


def eval_batches(cfg: Config, rows: np.ndarray | None = None) -> EvalBatches:
    """The validation batches of a resolved `cfg` with one source (`with_source(cfg, DIR)` makes
    one), B = train.global_batch rows of T = train.seq_len; `rows`: this process's
    (data.process_rows), all by default."""
    sources, _ = data_sources(cfg.data)
    if len(sources) != 1:
        raise DataError(f"data.sources: evaluation reads one source, got {len(sources)}; pick one with --data")
    _, val, _, va_name = read_splits(sources[0], cfg)
    return EvalBatches(Windows(val, cfg.train.seq_len, va_name), cfg.train.global_batch, cfg.data.eod_id, rows)
