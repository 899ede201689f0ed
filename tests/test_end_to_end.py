"""Real data in, a model out, as a user runs it: `parallax prepare` on a text corpus that ships
with every CPython (the standard library's `email` package, not written for this), then `parallax
train` on the prepared directory, `parallax sample` from the run and `parallax eval` of it on the
prepared validation split. Each step through the CLI, in-process; each must exit 0 and hand the
next what it needs (the tokenizer travels with the data: sample decodes with the prepared
directory's tokenizer.json)."""

import contextlib
import io
import json
import sysconfig
from pathlib import Path

from parallax.cli import main
from parallax.train.prepare import open_prepared
from parallax.train.tokenizer import load_tokenizer

QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.py"
CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "email"
VOCAB = 512
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
        f"model.vocab_size={VOCAB}", "train.seq_len=32", "train.global_batch=8", "train.steps=4", "train.eval_every=4",
        "train.eval_batches=2"]


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_prepare_train_sample_eval(tmp_path):
    data, run = tmp_path / "email", tmp_path / "run"
    code, _ = _run(["prepare", str(CORPUS), "--out", str(data), "--train-tokenizer", str(VOCAB), "--include", "*.py"])
    assert code == 0
    prepared = open_prepared(data)
    assert prepared.train.documents > 10 and prepared.val.documents >= 1 and prepared.vocab_size <= VOCAB

    sets = [a for o in [*TINY, f"data.source={data}"] for a in ("--set", o)]
    code, _ = _run(["train", str(QUICKSTART), *sets, "--workdir", str(run)])
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "eval_loss" in r]
    assert trained and trained[-1]["step"] == 4

    code, out = _run(["sample", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0",
                      "--json"])
    assert code == 0
    sampled = json.loads(out)
    tokenizer = load_tokenizer(data / "tokenizer.json")
    assert sampled["prompt_ids"] == tokenizer.encode("def ")
    assert len(sampled["token_ids"]) == 8 or sampled["token_ids"][-1] == prepared.eod_id  # stops at the eod
    assert sampled["completion"] == tokenizer.decode(sampled["token_ids"], skip_special=True)

    code, out = _run(["eval", str(run), "--json"])
    assert code == 0
    evaluated = json.loads(out)
    # the loop's own evaluation of the same validation batches, at the same step
    assert abs(evaluated["loss"] - trained[-1]["eval_loss"]) <= 1e-5 * trained[-1]["eval_loss"]
