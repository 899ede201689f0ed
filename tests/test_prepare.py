"""`parallax prepare` and the prepared-directory format (parallax/train/prepare.py): every document
comes back whole from its split, the output is byte-identical run to run, a finished output is not
redone and never overwritten, bad input is one line and exit 2 with nothing written, and a real
corpus (the interpreter's own `email` package sources) prepares with a BPE trained on it."""

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from parallax.cli import main
from parallax.train.prepare import PrepareError, check_vocab, is_prepared, is_val, open_prepared, prepare
from parallax.train.tokenizer import DEFAULT_EOD, load_tokenizer, train_bpe

DOCS = {
    "corpus/a.txt": "The first document.\nIt has two lines.\n",
    "corpus/sub/b.md": "# A heading\n\nnaïve café — ✓ 日本語\n",
    "corpus/sub/deeper/c.txt": "def f(x):\n    return x * 2\n",
    "corpus/empty.txt": "",  # dropped: an empty document would be a lone eod
    "corpus/__pycache__/skip.txt": "never read",
    "corpus/.hidden": "never read",
}
RECORDS = [{"text": f"record {i}: " + "lorem ipsum dolor " * (i % 5), "id": i} for i in range(40)]
RECORDS[7]["text"] = f"spells {DEFAULT_EOD} inside the text"


def _corpus(root: Path) -> list[str]:
    for rel, text in DOCS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "\n")
    return [str(root / "corpus"), str(root / "records.jsonl")]


def _expected(root: Path, val_every: int) -> dict[str, list[str]]:
    """Each split's document texts in file order, as the module docstring promises."""
    docs = [(f"corpus/{r}", 0, DOCS[f"corpus/{r}"]) for r in ("a.txt", "sub/b.md", "sub/deeper/c.txt")]
    docs += [("records.jsonl", i, r["text"]) for i, r in enumerate(RECORDS)]
    out = {"train": [], "val": []}
    for key, i, text in docs:
        out["val" if is_val(key, i, val_every) else "train"].append(text)
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    sources = _corpus(root)
    line = prepare(sources, root / "out", train_vocab=300, val_every=4)
    return root, sources, line


def test_every_document_comes_back_whole(made):
    root, _, line = made
    p = open_prepared(root / "out")
    tok = load_tokenizer(p.tokenizer_path)
    # at most the asked 300: BPE stops early when no pair is seen twice more (this corpus is small)
    assert p.token_dtype == "uint16" and 257 < p.vocab_size == tok.vocab_size <= 300 and p.eod_id == tok.eod_id == 0
    assert p.train.tokens.dtype == np.uint16 and isinstance(p.train.tokens, np.memmap)
    expected = _expected(root, 4)
    assert expected["val"] and expected["train"]  # the split below is a real one
    for name, split in p.splits.items():
        got = [tok.decode(split.tokens[a:b - 1]) for a, b in zip(split.offsets[:-1], split.offsets[1:])]
        assert got == expected[name]
        assert np.count_nonzero(np.asarray(split.tokens) == p.eod_id) == split.documents  # no eod inside a document
    assert f"train {p.train.n_tokens:,} tokens in {p.train.documents:,} documents" in line
    # sorted by path below the directory; .hidden and __pycache__ left out; empty.txt read, its document dropped
    assert [Path(s["path"]).name for s in p.sources] == ["a.txt", "empty.txt", "b.md", "c.txt", "records.jsonl"]


def test_train_bin_stays_a_token_file(made):
    from parallax.train.data import load_token_file

    root, _, _ = made
    p = open_prepared(root / "out")
    train, val = load_token_file(root / "out" / "train.bin", "uint16", p.vocab_size, 0.0)
    assert np.array_equal(np.asarray(train), np.asarray(p.train.tokens)) and len(val) == 0


def test_output_is_byte_identical_and_not_redone(made, tmp_path):
    root, sources, _ = made
    first = _files(root / "out")
    assert prepare(sources, tmp_path / "out2", train_vocab=300, val_every=4).startswith("prepared")
    assert _files(tmp_path / "out2") == first  # the manifest too: it records no time, no host
    stamp = os.stat(root / "out" / "train.bin").st_mtime_ns
    assert main(["prepare", *sources, "--out", str(root / "out"), "--train-tokenizer", "300", "--val-every", "4"]) == 0
    assert os.stat(root / "out" / "train.bin").st_mtime_ns == stamp and _files(root / "out") == first


def test_rerun_prints_one_line(made, capsys):
    root, sources, _ = made
    assert prepare(sources, root / "out", train_vocab=300, val_every=4).endswith("already prepared from these inputs; "
                                                                                "nothing to do")
    # different inputs into a finished DIR: exit 2, nothing touched
    before = _files(root / "out")
    for change in (["--train-tokenizer", "301", "--val-every", "4"], ["--train-tokenizer", "300", "--val-every", "5"]):
        assert main(["prepare", *sources, "--out", str(root / "out"), *change]) == 2
        assert "already prepared from other inputs" in capsys.readouterr().err
    assert _files(root / "out") == before


def test_given_tokenizer_is_copied_and_used(tmp_path, capsys):
    sources = _corpus(tmp_path)
    tok = train_bpe([d for d in DOCS.values()] * 3, 280)
    (tmp_path / "tok.json").write_text(tok.to_json())
    assert main(["prepare", *sources, "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--val-every", "0"]) == 0
    assert "prepared" in capsys.readouterr().out
    p = open_prepared(tmp_path / "o")
    assert (tmp_path / "o" / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    assert p.val.n_tokens == 0 and p.val.documents == 0 and len(p.val.tokens) == 0  # --val-every 0: no validation
    assert list(p.train.tokens[: p.train.offsets[1]]) == tok.encode(DOCS["corpus/a.txt"]) + [tok.eod_id]


def test_check_vocab(made):
    p = open_prepared(made[0] / "out")
    v = p.vocab_size
    check_vocab(p, v)
    check_vocab(p, 512)
    with pytest.raises(PrepareError, match=rf"vocab_size={v} \(manifest.json\) > model.vocab_size={v - 1}; set "
                                           rf"model.vocab_size >= {v}"):
        check_vocab(p, v - 1)


def _one_line_exit_2(capsys, tmp_path, argv, match):
    out = tmp_path / "never"
    assert main(["prepare", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".never.partial-*"))  # nothing written, nothing left


@pytest.mark.parametrize("name,content,extra,match", [
    ("blob.txt", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", [], "holds a NUL byte: not a text file"),
    ("latin1.txt", "caf\xe9\n".encode("latin-1"), [], "not UTF-8 text (byte 3"),
    ("r.jsonl", b'{"text": "a"}\n{"body": "b"}\n', [], "line 2: no field 'text' (--field; it has ['body'])"),
    ("r.jsonl", b'{"text": "a"}\n{"text": \n', [], "line 2: not JSON"),
    ("r.jsonl", b'{"text": 3}\n', [], "field 'text' is int, not a string"),
    ("r.jsonl", b'{"body": "b"}\n', ["--field", "content"], "no field 'content'"),
    ("ok.txt", b"fine\n", ["--tokenizer", "BADTOK"], "does not parse as a Hugging Face tokenizer.json"),
    ("ok.txt", b"fine\n", ["--tokenizer", "GOODTOK", "--eod-token", "</s>"], "has no end-of-document token '</s>'"),
    ("ok.txt", b"fine\n", [], "give exactly one of --tokenizer"),
    ("ok.txt", b"fine\n", ["--train-tokenizer", "300", "--tokenizer", "GOODTOK"], "give exactly one of --tokenizer"),
    ("ok.txt", b"fine\n", ["--train-tokenizer", "300"], "left no val document at --val-every 20"),
    ("ok.txt", b"fine\n", ["--train-tokenizer", "300", "--val-every", "1"], "--val-every: one document in N"),
])
def test_bad_input(tmp_path, capsys, name, content, extra, match):
    (tmp_path / name).write_bytes(content)
    (tmp_path / "bad.json").write_text('{"version": "1.0", "truncated')
    (tmp_path / "good.json").write_text(train_bpe(["fine\n"] * 4, 260).to_json())
    extra = [{"BADTOK": str(tmp_path / "bad.json"), "GOODTOK": str(tmp_path / "good.json")}.get(a, a) for a in extra]
    if not any(a in ("--tokenizer", "--train-tokenizer") for a in extra) and match != "give exactly one of --tokenizer":
        extra += ["--train-tokenizer", "300"]
    _one_line_exit_2(capsys, tmp_path, [str(tmp_path / name), *extra], match)


def test_bad_input_names_the_file(tmp_path, capsys):
    (tmp_path / "blob.txt").write_bytes(b"\xff\xfe\0\0")
    assert main(["prepare", str(tmp_path / "blob.txt"), "--out", str(tmp_path / "o"), "--train-tokenizer", "300"]) == 2
    assert str(tmp_path / "blob.txt") in capsys.readouterr().err
    _one_line_exit_2(capsys, tmp_path, ["--train-tokenizer", "300"], "no sources given")
    _one_line_exit_2(capsys, tmp_path, [str(tmp_path / "nope.txt"), "--train-tokenizer", "300"], "nope.txt' does not exist")


def test_an_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    import parallax.train.prepare as prep

    sources = _corpus(tmp_path)
    stale = tmp_path / ".out.partial-4194999"  # above Linux's pid_max: a process that cannot be alive
    stale.mkdir()

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep._SplitWriter, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(sources, tmp_path / "out", train_vocab=300, val_every=4)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_output_inside_a_source_directory_is_not_read(tmp_path):
    sources = _corpus(tmp_path)
    out = tmp_path / "corpus" / "prepared"
    prepare(sources, out, train_vocab=300, val_every=4)
    assert "already prepared" in prepare(sources, out, train_vocab=300, val_every=4)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("vocab_size"), "field 'vocab_size' is missing"),
    (lambda m: m.update(format="other"), "field 'format' must be 'parallax-prepared'"),
    (lambda m: m.update(version=2), "field 'version' is 2"),
    (lambda m: m.update(token_dtype="int8"), "field 'token_dtype' must be 'uint16' or 'uint32'"),
    (lambda m: m.update(eod_id=m["vocab_size"]), "must be in [0, vocab_size="),
    (lambda m: m["splits"]["train"].update(tokens=5), "but field splits.train.tokens=5"),
    (lambda m: m["splits"]["val"].update(documents="2"), "field 'splits.val.documents' must be int"),
    (lambda m: m["splits"]["train"].update(documents=1), "must be int64 [2] (field splits.train.documents=1"),
    (lambda m: m["splits"].pop("val"), "field 'splits.val' is missing"),
    (lambda m: m.update(tokenizer="gone.json"), "field 'tokenizer' names"),
])
def test_open_prepared_checks_the_manifest(made, tmp_path, edit, match):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(made[0] / "out", d)
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PrepareError, match=r".*manifest.json'.*") as e:
        open_prepared(d)
    assert match in str(e.value) and "\n" not in str(e.value)
    assert is_prepared(d) == (m.get("format") == "parallax-prepared")


def test_parquet(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [r["text"] for r in RECORDS]
    pq.write_table(pa.table({"body": texts, "n": list(range(len(texts)))}), tmp_path / "t.parquet")
    prepare([str(tmp_path / "t.parquet")], tmp_path / "o", train_vocab=300, field="body", val_every=4)
    p = open_prepared(tmp_path / "o")
    tok = load_tokenizer(p.tokenizer_path)
    got = [tok.decode(p.train.tokens[a:b - 1]) for a, b in zip(p.train.offsets[:-1], p.train.offsets[1:])]
    assert got == [t for i, t in enumerate(texts) if not is_val("t.parquet", i, 4)]
    _one_line_exit_2(capsys, tmp_path, [str(tmp_path / "t.parquet"), "--train-tokenizer", "300"],
                     "no column 'text' (--field; it has ['body', 'n'])")
    _one_line_exit_2(capsys, tmp_path, [str(tmp_path / "t.parquet"), "--train-tokenizer", "300", "--field", "n"],
                     "column 'n' is int64, not a string")
    (tmp_path / "fake.parquet").write_bytes(b"just text\n")
    _one_line_exit_2(capsys, tmp_path, [str(tmp_path / "fake.parquet"), "--train-tokenizer", "300"], "not a Parquet file")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, capsys, monkeypatch):
    import sys

    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    _one_line_exit_2(capsys, tmp_path, [str(tmp_path / "t.parquet"), "--train-tokenizer", "300"],
                     "reading Parquet needs pyarrow, which is not installed: pip install 'parallax[parquet]'")


def test_a_real_corpus_with_a_bpe_trained_on_it(tmp_path):
    """The running interpreter's `email` package: 30 files (.py and one .rst) in subdirectories,
    written by CPython's authors, not for this test."""
    src = Path(sysconfig.get_paths()["stdlib"]) / "email"
    files = sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    line = prepare([str(src)], tmp_path / "o", train_vocab=512, val_every=10)
    p = open_prepared(tmp_path / "o")
    tok = load_tokenizer(p.tokenizer_path)
    assert p.train.documents + p.val.documents == len([f for f in files if f.stat().st_size]) >= 20
    assert p.val.documents >= 1 and p.vocab_size == 512
    texts = {f.read_text() for f in files}
    for split in p.splits.values():
        for a, b in zip(split.offsets[:-1], split.offsets[1:]):
            assert tok.decode(split.tokens[a:b - 1]) in texts  # every document whole, round-tripped
    n_bytes = sum(s["bytes"] for s in p.sources)
    assert n_bytes / (p.train.n_tokens + p.val.n_tokens) > 2.0, line  # a 512-token BPE compresses Python ~2.5x


def test_validation_choice_is_a_stable_one_in_n():
    picks = [is_val("corpus/x.jsonl", i, 20) for i in range(20000)]
    assert abs(sum(picks) / len(picks) - 1 / 20) < 0.005
    assert picks == [is_val("corpus/x.jsonl", i, 20) for i in range(20000)]
    assert picks != [is_val("corpus/y.jsonl", i, 20) for i in range(20000)]  # the source's key takes part
    assert not any(is_val("corpus/x.jsonl", i, 0) for i in range(100))
