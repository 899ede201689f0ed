"""Text <-> token ids: the byte tokenizer of the built-in corpus and Hugging Face `tokenizers`.

One `Tokenizer` class serves both, so that `parallax prepare`, `parallax sample` and `parallax eval`
never ask which kind they hold. The byte tokenizer (vocab 256) is the built-in corpus's: UTF-8
bytes in, bytes out (an invalid sequence decodes to U+FFFD, never raises); its end-of-document id
is byte 0 (data.STDLIB_EOD) when data.eod_id=0. Any other tokenizer is a `tokenizer.json` read by
`tokenizers` (written by it, by `transformers`' fast tokenizers, or by `train_bpe` here).

`train_bpe` trains a GPT-2-style byte-level BPE offline: the ByteLevel pre-tokenizer maps every
byte to a printable symbol, so any text (any language, any bytes of valid UTF-8) encodes without
an unknown token and decodes back to itself. No normalizer: decode(encode(t)) == t exactly.

`tokenizer_for(cfg)` finds the tokenizer that goes with `data.source`: 'stdlib' has the byte one,
a prepared directory (train/prepare.py) carries its own `tokenizer.json`, a flat token file has
none. Imports no JAX (cli.py loads the prepare module, which imports this one, to build its parser).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from parallax.config import Config, UserError, data_sources

DEFAULT_EOD = "<|endoftext|>"  # GPT-2's end-of-document token, the special token train_bpe adds
BYTE_VOCAB = 256
BYTE_EOD = 0  # the built-in corpus's end-of-document byte: equals data.STDLIB_EOD (a test checks)
MANIFEST = "manifest.json"  # a prepared directory's manifest (the format is train/prepare.py's)
_REPLACEMENT = "\ufffd".encode()  # what an id outside 0..255 decodes to in the byte tokenizer


class TokenizerError(UserError):
    """A tokenizer that cannot be used; the one-line message names the file and what is wrong."""


@dataclass(frozen=True)
class Tokenizer:
    """encode/decode with a vocabulary size and an end-of-document id (-1: none).

    `path` is the tokenizer.json it came from (None for the byte tokenizer); `eod_token` the eod's
    text form (None for bytes). `hf` is the `tokenizers.Tokenizer` (None for bytes)."""

    vocab_size: int
    eod_id: int
    path: str | None = None
    eod_token: str | None = None
    hf: Any = field(default=None, repr=False, compare=False)

    @property
    def is_bytes(self) -> bool:
        return self.hf is None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special token is added (no BOS, no eod: callers append eod), and
        special tokens spelled in the text are encoded as text."""
        if self.hf is None:
            return list(text.encode("utf-8", errors="surrogateescape"))
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` over many texts at once: `tokenizers` spreads a batch over its threads."""
        if self.hf is None:
            return [self.encode(t) for t in texts]
        # encode_batch_fast skips the offsets that nothing here reads
        return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`. Bytes: invalid UTF-8 and ids outside 0..255 become U+FFFD.
        `skip_special`: leave out special tokens such as the eod (bytes: the eod byte)."""
        ids = [int(i) for i in ids]
        if self.hf is None:
            if skip_special and self.eod_id >= 0:
                ids = [i for i in ids if i != self.eod_id]
            raw = b"".join(bytes([i]) if 0 <= i < BYTE_VOCAB else _REPLACEMENT for i in ids)
            return raw.decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    def to_json(self) -> str:
        """The tokenizer.json text (`tokenizers`' own serialization); bytes have none."""
        if self.hf is None:
            raise TokenizerError("the byte tokenizer has no tokenizer.json")
        return self.hf.to_str()


def byte_tokenizer(eod_id: int = BYTE_EOD) -> Tokenizer:
    """The built-in corpus's tokenizer: UTF-8 bytes, vocab 256; `eod_id` -1 for no documents."""
    if not -1 <= eod_id < BYTE_VOCAB:
        raise TokenizerError(f"byte tokenizer: eod_id must be -1 or a byte 0..255, got {eod_id}")
    return Tokenizer(vocab_size=BYTE_VOCAB, eod_id=eod_id)


def _hf_tokenizer(hf: Any, path: str | None, eod_token: str | None, label: str) -> Tokenizer:
    eod_id = -1
    if eod_token is not None:
        found = hf.token_to_id(eod_token)
        if found is None:
            raise TokenizerError(
                f"{label}: has no end-of-document token {eod_token!r}; name the one it has with --eod-token, "
                f"or add it: tok = tokenizers.Tokenizer.from_file(PATH); tok.add_special_tokens([{eod_token!r}]); "
                "tok.save(PATH)")
        eod_id = int(found)
    # A document's text that spells a special token ("<|endoftext|>" in a page about GPT-2) stays
    # text: else it would end the document where none ends. Not part of tokenizer.json.
    hf.encode_special_tokens = True
    return Tokenizer(vocab_size=int(hf.get_vocab_size(with_added_tokens=True)), eod_id=eod_id, path=path,
                     eod_token=eod_token, hf=hf)


def load_tokenizer(path: str | os.PathLike, eod_token: str | None = DEFAULT_EOD) -> Tokenizer:
    """A tokenizer.json (Hugging Face `tokenizers` format). `eod_token`: the end-of-document token
    it must hold (None: no eod, eod_id -1). Raises TokenizerError, one line naming the file."""
    from tokenizers import Tokenizer as HFTokenizer  # a Rust extension: loaded only when used

    label = f"tokenizer {str(path)!r}"
    if not os.path.isfile(path):
        raise TokenizerError(f"{label} does not exist" if not os.path.exists(path) else f"{label} is not a file")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TokenizerError(f"{label} does not parse as a Hugging Face tokenizer.json: {first[:200]}") from None
    return _hf_tokenizer(hf, str(path), eod_token, label)


def tokenizer_from_json(text: str, eod_token: str | None = DEFAULT_EOD, label: str = "tokenizer") -> Tokenizer:
    """A tokenizer from tokenizer.json text (what `Tokenizer.to_json` wrote)."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_str(text)
    except Exception as e:
        raise TokenizerError(f"{label} does not parse as a Hugging Face tokenizer.json: {str(e)[:200]}") from None
    return _hf_tokenizer(hf, None, eod_token, label)


def train_bpe(texts: Iterable[str], vocab_size: int, eod_token: str = DEFAULT_EOD, min_frequency: int = 2,
              length: int | None = None, show_progress: bool = False) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (the eod special token, id 0, and the 256
    byte symbols included; fewer when no pair is left seen `min_frequency` times) trained on `texts`. Deterministic: the same texts in the same order give
    the same tokenizer.json, byte for byte (tests/test_tokenizer.py). `length`: how many texts,
    for the progress bar only."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    floor = BYTE_VOCAB + 1
    if vocab_size < floor:
        raise TokenizerError(f"--train-tokenizer: a byte-level BPE needs vocab >= {floor} (256 bytes + the eod "
                             f"token), got {vocab_size}")
    hf = HFTokenizer(models.BPE())
    # add_prefix_space=False: the text is encoded as it is (GPT-2 style; no space invented at its start)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eod_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    hf.train_from_iterator(_strings(texts), trainer=trainer, length=length)
    return _hf_tokenizer(hf, None, eod_token, "trained tokenizer")


def _strings(texts: Iterable[str]) -> Iterator[str]:
    for t in texts:
        if not isinstance(t, str):
            raise TypeError(f"train_bpe: texts must be str, got {type(t).__name__}")
        yield t


def read_manifest_tokenizer(directory: str | os.PathLike) -> tuple[Path, str | None, int, int]:
    """(tokenizer path, eod token, vocab_size, eod_id) as a prepared directory's manifest names them.
    The whole manifest is checked by prepare.open_prepared; this reads only what a tokenizer needs
    (this module sits above prepare.py in the import order)."""
    path = Path(directory) / MANIFEST
    try:
        m = json.loads(path.read_text())
        return Path(directory) / m["tokenizer"], m.get("eod_token"), int(m["vocab_size"]), int(m["eod_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = f"lacks field {e}" if isinstance(e, KeyError) else f"does not parse ({type(e).__name__})"
        raise TokenizerError(f"prepared data {str(path)!r} {what}") from None


def tokenizer_for(cfg: Config) -> Tokenizer:
    """The tokenizer of the run's data (`data.source`, or a mixture's first source: every prepared
    source of a mixture shares one tokenizer, input.resolve_data): 'stdlib' -> bytes (eod =
    data.eod_id), a prepared directory -> its tokenizer.json (checked against its manifest), a
    token file -> UserError."""
    src = data_sources(cfg.data)[0][0]
    if src == "stdlib":
        return byte_tokenizer(cfg.data.eod_id if cfg.data.eod_id >= 0 else -1)
    p = Path(src)
    if p.is_dir() and (p / MANIFEST).is_file():
        tok_path, eod_token, vocab, eod_id = read_manifest_tokenizer(p)
        tok = load_tokenizer(tok_path, eod_token)
        if (tok.vocab_size, tok.eod_id) != (vocab, eod_id):
            raise TokenizerError(f"prepared data {str(p / MANIFEST)!r}: vocab_size={vocab}, eod_id={eod_id} but "
                                 f"{str(tok_path)!r} has {tok.vocab_size}, {tok.eod_id}; was it replaced?")
        return tok
    if p.is_dir():
        raise TokenizerError(f"data.source={src!r}: a directory without {MANIFEST}; make one with `parallax prepare`")
    hint = ""
    if (p.parent / MANIFEST).is_file():  # DIR/train.bin of a prepared directory
        hint = f"; use data.source={str(p.parent)!r}, its prepared directory, which has one"
    raise TokenizerError(f"data.source={src!r}: a token file carries no tokenizer; make a prepared directory with "
                         f"`parallax prepare` and set data.source to it{hint}")
