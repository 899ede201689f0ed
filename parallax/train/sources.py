"""Sources of `parallax prepare`: the files named on its command line and the documents in them.

A text file is one document (UTF-8 without a NUL byte: anything else is refused as not text); a
JSONL line (.jsonl, .ndjson) is one, its `--field` a string; a Parquet row (.parquet) is one, its
`--field` column a string. A directory is walked recursively in sorted order of the path below it
(os.walk's order is the filesystem's), hidden entries and __pycache__ left out, `--include`
patterns narrowing the file names. Bad input is a PrepareError naming the file (and line).

Parquet needs pyarrow, an optional extra (`pip install 'parallax[parquet]'`: a 55 MB wheel, 170 MB
installed), imported only when a .parquet source is read. No JAX.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from parallax.config import UserError

_JSONL = (".jsonl", ".ndjson")
_HASH_CHUNK = 1 << 20


class PrepareError(UserError):
    """Bad input to `parallax prepare` or a damaged prepared directory; one line naming the file."""


@dataclass(frozen=True)
class Source:
    """One input file: `path` as found, `key` the name the split hash and the fingerprint use (the
    source argument's own name and the path below it: the same wherever the corpus lies)."""

    path: Path
    key: str
    kind: str  # "text" | "jsonl" | "parquet"
    sha256: str
    bytes: int


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in _JSONL else "parquet" if suffix == ".parquet" else "text"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def find_sources(args: list[str], include: list[str], out: Path) -> list[Source]:
    """The files of the source arguments, in order (a directory's sorted by relative path)."""
    if not args:
        raise PrepareError("prepare: no sources given; name text, JSONL or Parquet files or directories of them")
    out = out.resolve()
    found: list[tuple[Path, str]] = []
    for arg in args:
        p = Path(arg)
        if p.is_file():
            found.append((p, p.name))
        elif p.is_dir():
            files = []
            for dirpath, dirnames, filenames in os.walk(p):
                # hidden entries hold the output's own partial directories, .git and the like
                dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                               and Path(dirpath, d).resolve() != out]
                for f in filenames:
                    if not f.startswith(".") and (not include or any(fnmatch.fnmatch(f, g) for g in include)):
                        files.append(Path(dirpath, f))
            rel = sorted((f.relative_to(p).as_posix(), f) for f in files)  # os.walk order is the filesystem's
            if not rel:
                raise PrepareError(f"source {arg!r}: a directory with no files" + (
                    f" matching --include {' '.join(include)}" if include else ""))
            found += [(f, f"{p.resolve().name}/{r}") for r, f in rel]
        else:
            raise PrepareError(f"source {arg!r} does not exist" if not p.exists() else
                               f"source {arg!r} is not a file or directory")
    return [Source(f, key, _kind(f), sha256_file(f), f.stat().st_size) for f, key in found]


def _text(raw: bytes, label: str) -> str:
    if b"\0" in raw:
        raise PrepareError(f"{label}: holds a NUL byte: not a text file (text, .jsonl or .parquet); leave it out "
                           "or narrow a directory with --include")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{label}: not UTF-8 text (byte {e.start}: {e.reason}); text sources must be UTF-8, "
                           "JSONL must end in .jsonl, Parquet in .parquet") from None


def _jsonl(src: Source, field: str) -> Iterator[tuple[int, str]]:
    with open(src.path, "rb") as f:
        for n, line in enumerate(f, 1):
            label = f"source {str(src.path)!r} line {n}"
            if not line.strip():
                continue
            try:
                record = json.loads(_text(line, label))
            except json.JSONDecodeError as e:
                raise PrepareError(f"{label}: not JSON ({e.msg}); a .jsonl file holds one JSON object per line") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise PrepareError(f"{label}: no field {field!r} (--field; it has {keys})")
            if not isinstance(record[field], str):
                raise PrepareError(f"{label}: field {field!r} is {type(record[field]).__name__}, not a string")
            yield n - 1, record[field]


def _parquet(src: Source, field: str) -> Iterator[tuple[int, str]]:
    try:
        import pyarrow.parquet as pq  # optional: 170 MB installed, needed only here
    except ImportError:
        raise PrepareError(f"source {str(src.path)!r}: reading Parquet needs pyarrow, which is not installed: "
                           "pip install 'parallax[parquet]'") from None
    label = f"source {str(src.path)!r}"
    try:
        pf = pq.ParquetFile(src.path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends: a file that is not Parquet
        raise PrepareError(f"{label}: not a Parquet file ({str(e).splitlines()[0][:120]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise PrepareError(f"{label}: no column {field!r} (--field; it has {names[:8]})")
    import pyarrow as pa

    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise PrepareError(f"{label}: column {field!r} is {kind}, not a string")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield row, text
            row += 1


def documents(src: Source, field: str) -> Iterator[tuple[int, str]]:
    """(index in the file, text) of every document of `src`, empty ones included."""
    if src.kind == "text":
        yield 0, _text(src.path.read_bytes(), f"source {str(src.path)!r}")
    elif src.kind == "jsonl":
        yield from _jsonl(src, field)
    else:
        yield from _parquet(src, field)


def is_val(key: str, index: int, val_every: int) -> bool:
    """Whether document `index` of source `key` is validation: one in `val_every` by a hash."""
    if val_every <= 0:
        return False
    digest = hashlib.sha256(f"{key}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % val_every == 0
