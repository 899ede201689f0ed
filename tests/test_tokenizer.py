"""parallax.train.tokenizer: the byte tokenizer, tokenizer.json loading, the trained byte-level
BPE (round trip, determinism across processes), and `tokenizer_for`'s choice per data.source."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from parallax.config import Config, DataConfig, UserError
from parallax.train.tokenizer import (BYTE_EOD, DEFAULT_EOD, MANIFEST, TokenizerError, byte_tokenizer, load_tokenizer,
                                      tokenizer_for, tokenizer_from_json, train_bpe)

TEXTS = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog.\n",
         "naïve café — ünïcödé ✓ 日本語\n", "    indented\n\ttabbed\r\nwindows line\n"] * 20


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, 300)


def _cfg(source: str, eod_id: int = -1) -> Config:
    return dataclasses.replace(Config(), data=DataConfig(source=source, eod_id=eod_id))


def test_byte_tokenizer_round_trip_and_eod():
    from parallax.train.data import STDLIB_EOD  # the corpus's eod byte is the byte tokenizer's

    assert BYTE_EOD == STDLIB_EOD
    tok = byte_tokenizer()
    s = "héllo\n✓"
    ids = tok.encode(s)
    assert ids == list(s.encode()) and tok.vocab_size == 256 and tok.eod_id == 0
    assert tok.decode(ids) == s
    assert tok.decode([0x68, 0xFF, 0x69]) == "h\ufffdi"  # invalid UTF-8: replaced, never raised
    assert tok.decode([0x68, 300, 0x69]) == "h\ufffdi"  # an id a larger model vocab can sample
    assert tok.decode([0x61, 0, 0x62], skip_special=True) == "ab"
    assert tok.encode_batch(["a", "bc"]) == [[0x61], [0x62, 0x63]]


def test_bpe_round_trip_and_vocab(bpe):
    assert bpe.vocab_size == 300 and bpe.eod_id == 0 and bpe.eod_token == DEFAULT_EOD
    for s in set(TEXTS) | {"unseen: ΑΒΓ 🙂 \x00 bytes\n", " leading space"}:
        ids = bpe.encode(s)
        assert bpe.decode(ids) == s  # byte-level, no normalizer: exact
        assert max(ids) < bpe.vocab_size and DEFAULT_EOD not in bpe.decode(ids)
    s = TEXTS[0]
    assert len(bpe.encode(s)) < len(s.encode())  # merges were learnt and are used
    assert bpe.encode_batch(list(set(TEXTS))) == [bpe.encode(t) for t in set(TEXTS)]
    assert bpe.decode(bpe.encode(s) + [bpe.eod_id]) == s + DEFAULT_EOD
    assert bpe.decode(bpe.encode(s) + [bpe.eod_id], skip_special=True) == s
    # the eod text in a document stays text, never becomes the eod id
    assert bpe.eod_id not in bpe.encode(f"a{DEFAULT_EOD}b")


def test_bpe_is_deterministic_across_processes(bpe):
    # Rust HashMaps are seeded per process: only a fresh interpreter can show the order does not leak
    code = textwrap.dedent(f"""
        from parallax.train.tokenizer import train_bpe
        print(train_bpe({TEXTS!r}, 300).to_json(), end="")
    """)
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"RAYON_NUM_THREADS": str(n), "PATH": ""}).stdout for n in (1, 2)]
    assert out[0] == out[1] == bpe.to_json()
    assert train_bpe(TEXTS, 301).to_json() != bpe.to_json()  # the comparison can tell tokenizers apart


def test_load_tokenizer(tmp_path, bpe):
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.to_json())
    tok = load_tokenizer(path)
    assert tok.encode(TEXTS[2]) == bpe.encode(TEXTS[2]) and tok.path == str(path) and tok.eod_id == 0
    assert tokenizer_from_json(bpe.to_json()).encode(TEXTS[1]) == bpe.encode(TEXTS[1])
    assert load_tokenizer(path, eod_token=None).eod_id == -1


@pytest.mark.parametrize("content,match", [
    ('{"version": "1.0", "model": ', "does not parse as a Hugging Face tokenizer.json"),
    ("not json at all", "does not parse"),
    ('{"a": 1}', "does not parse"),
    (None, "does not exist"),
])
def test_load_tokenizer_bad_file(tmp_path, content, match):
    path = tmp_path / "tok.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenizerError, match=match) as e:
        load_tokenizer(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_eod_token_says_how_to_add(tmp_path, bpe):
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.to_json())
    with pytest.raises(TokenizerError, match=r"has no end-of-document token '</s>'.*--eod-token.*add_special_tokens"):
        load_tokenizer(path, eod_token="</s>")


def test_train_bpe_refuses_a_vocab_below_the_bytes():
    with pytest.raises(TokenizerError, match="vocab >= 257"):
        train_bpe(TEXTS, 100)


def test_tokenizer_for(tmp_path, bpe):
    assert tokenizer_for(_cfg("stdlib", 0)).eod_id == 0
    assert tokenizer_for(_cfg("stdlib")).eod_id == -1 and tokenizer_for(_cfg("stdlib")).vocab_size == 256
    # a prepared directory: only the manifest's tokenizer fields matter here (prepare.py writes the rest)
    d = tmp_path / "prep"
    d.mkdir()
    (d / "tokenizer.json").write_text(bpe.to_json())
    (d / MANIFEST).write_text(json.dumps({"tokenizer": "tokenizer.json", "eod_token": DEFAULT_EOD,
                                          "vocab_size": 300, "eod_id": 0}))
    (d / "train.bin").write_bytes(b"\0\0")
    tok = tokenizer_for(_cfg(str(d)))
    assert tok.encode(TEXTS[0]) == bpe.encode(TEXTS[0])
    with pytest.raises(UserError, match=r"a token file carries no tokenizer.*use data.source='.*prep'"):
        tokenizer_for(_cfg(str(d / "train.bin")))
    (tmp_path / "flat.bin").write_bytes(b"\0\0")
    with pytest.raises(UserError, match=r"data.source='.*flat.bin': a token file carries no tokenizer; make"):
        tokenizer_for(_cfg(str(tmp_path / "flat.bin")))
    (d / MANIFEST).write_text(json.dumps({"tokenizer": "tokenizer.json", "eod_token": DEFAULT_EOD,
                                          "vocab_size": 512, "eod_id": 0}))
    with pytest.raises(UserError, match="vocab_size=512.*has 300"):
        tokenizer_for(_cfg(str(d)))
    (d / MANIFEST).write_text("{}")
    with pytest.raises(UserError, match="manifest.json' lacks field 'tokenizer'"):
        tokenizer_for(_cfg(str(d)))
