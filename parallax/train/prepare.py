"""`parallax prepare SOURCES... --out DIR`: text, JSONL and Parquet in, a prepared directory out.

A prepared directory is what training reads (through `open_prepared` only):

    DIR/manifest.json   {"format": "parallax-prepared", "version": 1, "token_dtype", "vocab_size", "eod_id",
                         "eod_token", "splits": {"train": {"file", "docs", "tokens", "documents"}, "val": ...},
                         "sources": [{"path", "sha256", "bytes"}], "tokenizer": "tokenizer.json",
                         "fingerprint", "command"}
    DIR/train.bin, val.bin            flat token ids (uint16 when vocab <= 65536, else uint32), each
                                      document followed by eod_id: today's token-file format, so
                                      data.source=DIR/train.bin keeps working
    DIR/train.docs.npy, val.docs.npy  int64 [documents+1]: where each document starts (last: tokens)
    DIR/tokenizer.json                the tokenizer (a given one copied byte for byte, or trained here)

Sources and their documents are train/sources.py's (a text file, a JSONL line, a Parquet row);
empty documents are dropped.

Validation is chosen per whole document: by a hash of the document's key (the source's name, the
path below it, the record's index), one in `--val-every`, so the choice never splits a document,
never depends on the other sources, and is the same on every run. Output is byte-identical for
the same inputs; it is written to a hidden sibling directory renamed into place at the end, so a
killed run leaves no DIR at all. The fingerprint (source contents and split keys, the tokenizer,
the options) tells a finished DIR made from the same inputs (exit 0, nothing redone) from one
made from others (exit 2, nothing touched).

No JAX: cli.py imports this module to build its parser.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from parallax.train.sources import PrepareError, Source, documents, find_sources, is_val, sha256_file
from parallax.train.tokenizer import DEFAULT_EOD, MANIFEST, Tokenizer, load_tokenizer, train_bpe

FORMAT, VERSION = "parallax-prepared", 1
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_BATCH_CHARS = 1 << 20  # characters per encode_batch call: keeps tokenizers' threads busy (4 MB: no faster, +80 MB)


# ----------------------------------------------------------------------------------------------
# The prepared directory, read


@dataclass(frozen=True)
class Split:
    """One split: `tokens` [N] (memory-mapped, read-only) and `offsets` int64 [documents+1], the
    start of each document in `tokens` (offsets[-1] == N; document i is tokens[offsets[i]:offsets[i+1]],
    its last token the eod)."""

    file: Path
    docs_file: Path
    tokens: np.ndarray
    offsets: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def documents(self) -> int:
        return int(len(self.offsets) - 1)


@dataclass(frozen=True)
class Prepared:
    """A prepared directory's manifest fields, its splits and where its tokenizer is."""

    path: Path
    version: int
    token_dtype: str
    vocab_size: int
    eod_id: int
    eod_token: str | None
    train: Split
    val: Split
    sources: tuple[dict, ...]
    tokenizer_path: Path
    fingerprint: str
    command: tuple[str, ...]

    @property
    def splits(self) -> dict[str, Split]:
        return {"train": self.train, "val": self.val}


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding a manifest.json of this format (not yet validated)."""
    m = Path(path) / MANIFEST
    if not m.is_file():
        return False
    try:
        return json.loads(m.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _field(manifest: dict, key: str, kind: type, label: str, where: str = ""):
    if key not in manifest:
        raise PrepareError(f"{label}: field {where + key!r} is missing")
    value = manifest[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PrepareError(f"{label}: field {where + key!r} must be {kind.__name__}, got {value!r}")
    return value


def _open_split(root: Path, name: str, spec: dict, dtype: np.dtype, eod_id: int, label: str) -> Split:
    where = f"splits.{name}."
    file = root / _field(spec, "file", str, label, where)
    docs_file = root / _field(spec, "docs", str, label, where)
    n = _field(spec, "tokens", int, label, where)
    docs = _field(spec, "documents", int, label, where)
    for f in (file, docs_file):
        if not f.is_file():
            raise PrepareError(f"{label}: {where[:-1]} names {str(f)!r}, which does not exist")
    size = file.stat().st_size
    if size != n * dtype.itemsize:
        raise PrepareError(f"{label}: {str(file)!r} holds {size} bytes, but field {where}tokens={n} "
                           f"x {dtype.itemsize} bytes is {n * dtype.itemsize}")
    # np.memmap cannot map an empty file (a --val-every 0 validation split)
    tokens = np.memmap(file, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
    try:
        offsets = np.load(docs_file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise PrepareError(f"{label}: {str(docs_file)!r} is not a .npy array ({str(e)[:100]})") from None
    if offsets.dtype != np.int64 or offsets.shape != (docs + 1,):
        raise PrepareError(f"{label}: {str(docs_file)!r} must be int64 [{docs + 1}] (field {where}documents={docs} "
                           f"+ 1), got {offsets.dtype} {list(offsets.shape)}")
    if offsets[0] != 0 or offsets[-1] != n or (docs and np.any(np.diff(offsets) <= 0)):
        raise PrepareError(f"{label}: {str(docs_file)!r} must rise strictly from 0 to {where}tokens={n}")
    if docs and np.any(tokens[offsets[1:] - 1] != eod_id):  # [documents] gather: each ends in the eod
        raise PrepareError(f"{label}: a document in {str(file)!r} does not end in eod_id={eod_id}; damaged?")
    return Split(file, docs_file, tokens, offsets)


def open_prepared(path: str | os.PathLike) -> Prepared:
    """Open and check a prepared directory: every manifest field, file sizes, document offsets.
    Raises PrepareError, one line naming the file and the field."""
    root = Path(path)
    label = f"prepared data {str(root / MANIFEST)!r}"
    if not (root / MANIFEST).is_file():
        raise PrepareError(f"{label} does not exist; make it with `parallax prepare`")
    try:
        m = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise PrepareError(f"{label} does not parse: {str(e)[:120]}") from None
    if not isinstance(m, dict):
        raise PrepareError(f"{label}: expected a JSON object")
    if m.get("format") != FORMAT:
        raise PrepareError(f"{label}: field 'format' must be {FORMAT!r}, got {m.get('format')!r}")
    version = _field(m, "version", int, label)
    if version != VERSION:
        raise PrepareError(f"{label}: field 'version' is {version}; this parallax reads version {VERSION}")
    token_dtype = _field(m, "token_dtype", str, label)
    if token_dtype not in _DTYPES:
        raise PrepareError(f"{label}: field 'token_dtype' must be 'uint16' or 'uint32', got {token_dtype!r}")
    dtype = np.dtype(_DTYPES[token_dtype])
    vocab = _field(m, "vocab_size", int, label)
    if not 0 < vocab <= np.iinfo(dtype).max + 1:
        raise PrepareError(f"{label}: field 'vocab_size'={vocab} does not fit token_dtype={token_dtype!r}")
    eod_id = _field(m, "eod_id", int, label)
    if not 0 <= eod_id < vocab:
        raise PrepareError(f"{label}: field 'eod_id'={eod_id} must be in [0, vocab_size={vocab})")
    splits = _field(m, "splits", dict, label)
    opened = {}
    for name in SPLITS:
        if not isinstance(splits.get(name), dict):
            raise PrepareError(f"{label}: field 'splits.{name}' is missing")
        opened[name] = _open_split(root, name, splits[name], dtype, eod_id, label)
    tok = root / _field(m, "tokenizer", str, label)
    if not tok.is_file():
        raise PrepareError(f"{label}: field 'tokenizer' names {str(tok)!r}, which does not exist")
    sources = _field(m, "sources", list, label)
    eod_token = m.get("eod_token")
    return Prepared(root, version, token_dtype, vocab, eod_id, eod_token, opened["train"], opened["val"],
                    tuple(sources), tok, str(m.get("fingerprint", "")), tuple(m.get("command", ())))


def check_vocab(prepared: Prepared, vocab_size: int) -> None:
    """Refuse to train a model of `vocab_size` (model.vocab_size) on `prepared`: its ids must fit."""
    if prepared.vocab_size > vocab_size:
        raise PrepareError(
            f"data.source={str(prepared.path)!r}: its tokenizer has vocab_size={prepared.vocab_size} (manifest.json) "
            f"> model.vocab_size={vocab_size}; set model.vocab_size >= {prepared.vocab_size}")


def token_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# ----------------------------------------------------------------------------------------------
# Writing a prepared directory


def _progress():
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    # quiet when stdout is not a terminal (CI logs, pipes): the summary line says what was done
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    disable=not sys.stdout.isatty())


def _walk(sources: list[Source], field: str, progress, what: str) -> Iterator[tuple[Source, int, str]]:
    """(source, index, text) of every non-empty document, the bar advanced by the bytes read."""
    task = progress.add_task(what, total=sum(s.bytes for s in sources))
    for src in sources:
        done = 0
        for index, text in documents(src, field):
            step = min(len(text), src.bytes - done)  # characters: near enough to bytes for a bar
            done += step
            progress.advance(task, step)
            if text:
                yield src, index, text
        progress.advance(task, src.bytes - done)


class _SplitWriter:
    """Appends documents (ids + eod) to one split's .bin and records where each starts."""

    def __init__(self, root: Path, name: str, dtype: np.dtype, eod_id: int):
        self.file, self.docs = f"{name}.bin", f"{name}.docs.npy"
        self.root, self.dtype, self.eod = root, dtype, eod_id
        self.f = open(root / self.file, "wb")
        self.offsets = [0]

    def write(self, ids: list[int]) -> None:
        tokens = np.asarray(ids + [self.eod], self.dtype)  # [n+1]
        self.f.write(tokens.tobytes())
        self.offsets.append(self.offsets[-1] + len(tokens))

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        np.save(self.root / self.docs, np.asarray(self.offsets, np.int64))
        return {"file": self.file, "docs": self.docs, "tokens": self.offsets[-1], "documents": len(self.offsets) - 1}


def fingerprint(sources: list[Source], tokenizer: str, field: str, val_every: int, eod_token: str) -> str:
    """What decides the output: the sources' split keys and contents, the tokenizer (a file's
    sha256 or the BPE vocab to train), the options. Not the paths: a moved corpus is the same."""
    spec = {"sources": [[s.key, s.sha256] for s in sources], "tokenizer": tokenizer, "field": field,
            "val_every": val_every, "eod_token": eod_token}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _remove_stale_partials(out: Path) -> None:
    """Partial directories of killed runs into `out` (their process is gone) take disk; remove them."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        try:
            os.kill(int(p.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError):
            pass  # not ours by name, or a live process of another user


def prepare(source_args: list[str], out: str | os.PathLike, tokenizer: str | None = None,
            train_vocab: int | None = None, field: str = "text", val_every: int = 20, include: list[str] = (),
            eod_token: str = DEFAULT_EOD, command: list[str] = ()) -> str:
    """Write the prepared directory `out` (the module docstring); returns the line to print."""
    out = Path(out)
    if (tokenizer is None) == (train_vocab is None):
        raise PrepareError("prepare: give exactly one of --tokenizer tokenizer.json and --train-tokenizer VOCAB")
    if val_every < 0 or val_every == 1:
        raise PrepareError(f"--val-every: one document in N is validation; N must be >= 2 (or 0: none), got {val_every}")
    sources = find_sources(source_args, list(include), out)
    tok: Tokenizer | None = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer, eod_token)  # before anything is written: it must parse
        tok_spec = "file:" + sha256_file(Path(tokenizer))
    else:
        tok_spec = f"train_bpe:{train_vocab}"
    fp = fingerprint(sources, tok_spec, field, val_every, eod_token)
    if out.exists():
        if is_prepared(out):
            if open_prepared(out).fingerprint == fp:
                return f"{out}: already prepared from these inputs; nothing to do"
            raise PrepareError(f"--out {str(out)!r}: already prepared from other inputs (sources, tokenizer or options "
                               "differ); nothing overwritten: choose another --out or remove it")
        if not out.is_dir() or any(out.iterdir()):
            raise PrepareError(f"--out {str(out)!r}: exists and is not a prepared directory; nothing overwritten")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        with _progress() as progress:
            if tok is None:  # trained on the training split only: validation text stays unseen
                texts = (t for s, i, t in _walk(sources, field, progress, "training tokenizer")
                         if not is_val(s.key, i, val_every))
                tok = train_bpe(texts, train_vocab, eod_token)
                (partial / TOKENIZER_FILE).write_text(tok.to_json())
            else:
                shutil.copyfile(tokenizer, partial / TOKENIZER_FILE)  # byte for byte: what the user gave
            dtype = token_dtype_for(tok.vocab_size)
            writers = {name: _SplitWriter(partial, name, np.dtype(_DTYPES[dtype]), tok.eod_id) for name in SPLITS}
            batch: list[tuple[str, str]] = []  # (split, text)

            def flush() -> None:
                for (name, _), ids in zip(batch, tok.encode_batch([t for _, t in batch])):
                    writers[name].write(ids)
                batch.clear()

            chars = 0
            for s, i, text in _walk(sources, field, progress, "tokenizing"):
                batch.append(("val" if is_val(s.key, i, val_every) else "train", text))
                chars += len(text)
                if chars >= _BATCH_CHARS:
                    flush()
                    chars = 0
            flush()
            splits = {name: w.close() for name, w in writers.items()}
        for name in SPLITS if val_every else ("train",):
            if splits[name]["documents"] == 0:
                raise PrepareError(f"prepare: {splits['train']['documents'] + splits['val']['documents']} document(s) "
                                   f"left no {name} document at --val-every {val_every}; give more documents, or "
                                   "--val-every 0 for no validation split")
        manifest = {"format": FORMAT, "version": VERSION, "token_dtype": dtype, "vocab_size": tok.vocab_size,
                    "eod_id": tok.eod_id, "eod_token": eod_token, "splits": splits,
                    "sources": [{"path": str(s.path), "sha256": s.sha256, "bytes": s.bytes} for s in sources],
                    "tokenizer": TOKENIZER_FILE, "fingerprint": fp, "command": list(command)}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        open_prepared(partial)  # what training will read: check it before it is in place
        if out.exists():
            out.rmdir()  # the empty directory checked above
        os.rename(partial, out)  # atomic: DIR is complete or absent
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    tr, va = splits["train"], splits["val"]
    return (f"prepared {out}: train {tr['tokens']:,} tokens in {tr['documents']:,} documents, validation "
            f"{va['tokens']:,} in {va['documents']:,}; vocab {tok.vocab_size} ({dtype}), eod_id {tok.eod_id}, "
            f"from {len(sources)} file(s)")


def add_prepare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text, JSONL or Parquet into a prepared directory for data.source",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="*", metavar="SOURCE",
                   help="text files (one document each), .jsonl (a document per line), .parquet (a document per "
                        "row), or directories of them (recursive, sorted)")
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared directory to write (data.source=DIR)")
    p.add_argument("--tokenizer", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json to use")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB tokens on the sources' training documents")
    p.add_argument("--field", default="text", help="the JSONL field / Parquet column holding the text (default text)")
    p.add_argument("--val-every", type=int, default=20, metavar="N",
                   help="one document in N (by a hash of its name) is validation; 0: none (default 20)")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="in directories, read only files whose name matches (fnmatch, e.g. '*.py'); repeatable")
    p.add_argument("--eod-token", default=DEFAULT_EOD,
                   help=f"the end-of-document special token appended after each document (default {DEFAULT_EOD})")


def prepare_command(args: argparse.Namespace) -> int:
    command = ["parallax", "prepare", *args.sources, "--out", args.out]
    for flag in ("tokenizer", "train_tokenizer", "field", "val_every", "eod_token"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))] if getattr(args, flag) is not None else []
    for g in args.include:
        command += ["--include", g]
    print(prepare(args.sources, args.out, args.tokenizer, args.train_tokenizer, args.field, args.val_every,
                  args.include, args.eod_token, command), flush=True)
    return 0
