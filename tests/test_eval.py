"""`parallax eval` (parallax/infer/evaluate.py): its loss is the training loop's eval loss on the
same batches (the one tiny run of this module, trained 2 steps on data=4 x tensor=2 and
evaluated at its last step), on the run's mesh and on another; `--full` over a token file's
validation split equals a plain single-device forward over the same windows; bad input is one
line, exit 2."""

import contextlib
import io
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.cli import main
from parallax.infer.decode import saved_config
from parallax.model.transformer import Transformer
from parallax.model.vocab import cross_entropy
from parallax.train.checkpoint import Checkpoints
from parallax.train.input import eval_batches, with_source

QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.py"
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
        "train.seq_len=16", "train.global_batch=8", "train.steps=2", "train.eval_every=2", "train.eval_batches=2"]


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    wd = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", str(QUICKSTART), *_sets(*TINY), "--workdir", str(wd)]) == 0
    return wd


def _eval(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", *argv, "--json"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_loss_equals_training_eval_loss(workdir):
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    eval_loss = [r["eval_loss"] for r in logged if "eval_loss" in r][-1]
    r = _eval(str(workdir))  # the run's data and mesh: the loop's own program and batches
    assert r["step"] == 2 and r["batches"] == 2 and r["mode"] == "stream"
    assert r["loss"] == pytest.approx(eval_loss, abs=1e-6)
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-9)
    other = _eval(str(workdir), "--set", "mesh.data=1", "--set", "mesh.tensor=1")  # one device
    assert other["mesh"].startswith("data=1 x tensor=1")
    assert other["loss"] == pytest.approx(eval_loss, abs=1e-5)  # float32 sums in another order


def test_full_split_of_a_token_file(workdir, tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, size=4000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    r = _eval(str(workdir), "--data", str(path), "--full")
    cfg, _ = saved_config(workdir)
    cfg = with_source(cfg, str(path))
    batches = eval_batches(cfg)
    assert r["mode"] == "full" and r["batches"] == len(batches) >= 1
    assert r["tokens"] == len(batches) * cfg.train.global_batch * cfg.train.seq_len
    # reference: the model's plain forward on one device over the same windows
    from parallax.train.build import build

    built = build(cfg)
    state = Checkpoints(workdir).restore(cfg, built.layout).state
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state.params)
    model = Transformer(cfg.model)
    losses = [float(cross_entropy(model.apply({"params": params}, jnp.asarray(b["inputs"])), jnp.asarray(b["targets"])))
              for b in batches]
    assert r["loss"] == pytest.approx(float(np.mean(losses)), abs=1e-5)
    one = _eval(str(workdir), "--data", "stdlib", "--batches", "1")
    assert one["batches"] == 1 and one["data"] == "stdlib" and one["loss"] == one["batch_losses"][0]


@pytest.mark.parametrize("extra, expect", [
    (["--batches", "0"], "--batches: must be >= 1"),
    (["--set", "train.steps=3"], "only mesh.* may be set"),
    (["--data", "/nonexistent/tokens.bin"], "does not exist"),
], ids=["batches", "not-mesh", "missing-data"])
def test_bad_input(workdir, capsys, extra, expect):
    assert main(["eval", str(workdir), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert expect in err and err.startswith("parallax: error:"), err


def test_no_checkpoint(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds no checkpoint" in err and str(tmp_path) in err, err
