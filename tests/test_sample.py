"""`parallax sample` and the KV-cache decoder (parallax/infer/decode.py).

One tiny run, trained 2 steps through the CLI on data=4 x tensor=2, is shared by the module. The
decoder's greedy tokens must equal the argmax of the full training forward at every step, with
the logits within float32 rounding (no drift from the cache), on 1 device, on tensor=2 and on
data=2 x tensor=2; an MoE model decodes too (dropless, as decode.py states). Seeds fix the text.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.cli import main
from parallax.config import Config, apply_overrides
from parallax.infer.decode import (Decoder, Sampling, decode_model, mesh_devices, restore_run, sample_logits,
                                   sampling_config, saved_config)
from parallax.train.build import build
from parallax.train.train_state import init_state

QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.py"
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
        "train.seq_len=32", "train.global_batch=8", "train.steps=2", "train.eval_every=2"]
PROMPTS = np.array([list(b"def f(x):"), list(b"import os")], np.int32)  # [2, 9]
NEW = 12
LOGIT_ATOL = 1e-4  # float32: the cached attention sums the same terms in another order (seen: 6e-8)


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    wd = tmp_path_factory.mktemp("sample") / "run"
    assert main(["train", str(QUICKSTART), *_sets(*TINY), "--workdir", str(wd)]) == 0
    return wd


def _reference(cfg: Config, params, prompts: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Full-forward logits [B, N, V] at the positions that chose each new token (no cache)."""
    model = decode_model(cfg).clone(decode=False)  # MoE: the same dropless routing as decoding
    host = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)  # one device, unsharded
    full = model.apply({"params": host}, jnp.asarray(np.concatenate([prompts, new[:, :-1]], axis=1)))
    return np.asarray(full)[:, prompts.shape[1] - 1:]


def _check_greedy(built, params, cfg) -> Decoder:
    dec = Decoder(built, params, len(PROMPTS), cfg.train.seq_len)
    gen = dec.generate(PROMPTS, NEW, Sampling(temperature=0.0), keep_logits=True)
    assert gen.tokens.shape == (2, NEW)
    ref = _reference(cfg, params, PROMPTS, gen.tokens)
    np.testing.assert_array_equal(gen.tokens, ref.argmax(-1))  # every step: the full forward's argmax
    np.testing.assert_allclose(np.stack(gen.logits, axis=1), ref, atol=LOGIT_ATOL, rtol=0)
    return dec


@pytest.mark.parametrize("mesh", [["mesh.tensor=1"], [], ["mesh.data=2", "mesh.tensor=2"]],
                         ids=["1device", "tensor2", "data2xtensor2"])
def test_greedy_equals_full_forward(workdir, mesh):
    cfg, step = saved_config(workdir)
    assert step == 2
    scfg = sampling_config(cfg, mesh, len(jax.devices()))
    built, restored = restore_run(workdir, scfg, mesh_devices(scfg, jax.devices()))
    dec = _check_greedy(built, restored.state.params, cfg)
    # the cache is laid out by the rules: batch over data, kv heads over tensor ([L, B, S, K, H])
    spec = dec.cache_shardings["layers"]["attn"]["key"].spec
    assert "tensor" in jax.tree.leaves(spec[3]) if built.mesh.shape["tensor"] > 1 else True
    assert "data" in jax.tree.leaves(spec[1]) if built.mesh.shape["data"] > 1 else True


def test_moe_decodes_dropless():
    """Random-init MoE (capacity routing in training): decoding routes each token dropless and
    equals the dropless full forward."""
    cfg = apply_overrides(Config(), [*TINY, "model.moe.num_experts=4", "model.moe.top_k=2", "model.n_layers=1",
                                     "mesh.data=1", "mesh.tensor=2"])
    scfg = sampling_config(cfg, [], len(jax.devices()))
    built = build(scfg, mesh_devices(scfg, jax.devices()))
    _check_greedy(built, init_state(scfg, built.layout).params, cfg)


def test_sample_logits_cuts():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]], np.float32))  # order by probability: 1, 3, 2, 0
    keys = jax.random.split(jax.random.key(0), 400)

    def draw(t, k, p):
        f = jax.vmap(lambda key: sample_logits(logits, key, np.float32(t), np.int32(k), np.float32(p))[0])
        return np.asarray(f(keys))

    assert set(draw(0.0, 0, 1.0)) == {1}  # greedy
    assert set(draw(1.0, 1, 1.0)) == {1}  # top-k 1
    assert set(draw(1.0, 2, 1.0)) == {1, 3}  # top-k 2
    assert set(draw(1.0, 0, 0.5)) == {1, 3}  # 0.4 < 0.5, then 0.4 + 0.3 >= 0.5: two kept
    assert set(draw(1.0, 0, 0.4)) == {1}  # the first alone reaches 0.4
    assert set(draw(1.0, 0, 1.0)) == {0, 1, 2, 3}


def _sample(workdir, *extra) -> tuple[int, dict | None]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["sample", str(workdir), "--json", *extra])
    return rc, (json.loads(out.getvalue().strip().splitlines()[-1]) if rc == 0 else None)


def test_cli_seeds_and_greedy(workdir):
    prompt = ["--prompt", "def f(x):", "--max-new-tokens", "10"]
    rc, a = _sample(workdir, *prompt, "--temperature", "1", "--seed", "1")
    _, b = _sample(workdir, *prompt, "--temperature", "1", "--seed", "1")
    _, c = _sample(workdir, *prompt, "--temperature", "1", "--seed", "2")
    assert rc == 0 and a["token_ids"] == b["token_ids"] and a["completion"] == b["completion"]
    assert a["token_ids"] != c["token_ids"]
    assert a["prompt_ids"] == list(b"def f(x):") and len(a["token_ids"]) == 10
    assert set(a["timing"]) >= {"compile_s", "prefill_s", "decode_s", "tokens_per_s"}


def test_cli_streams_text(workdir, capfd):
    """The completion streams as it is decoded (to stderr under --json, stdout holding the JSON);
    the default --max-new-tokens is what the context leaves after the prompt (30 + 2 = seq_len)."""
    assert main(["sample", str(workdir), "--prompt", "x" * 30, "--temperature", "0", "--json"]) == 0
    captured = capfd.readouterr()
    record = json.loads(captured.out.strip().splitlines()[-1])
    assert len(record["token_ids"]) == 2
    assert record["completion"] + "\n" in captured.err  # streamed, then a newline


@pytest.mark.parametrize("extra, expect", [
    (["--prompt", ""], "--prompt: empty"),
    (["--prompt", "x" * 32, "--max-new-tokens", "1"], "(32 tokens) + --max-new-tokens 1 = 33 exceeds the context"),
    (["--prompt", "x" * 20, "--max-new-tokens", "13"], "= 33 exceeds the context of 32"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["--prompt", "x", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (["--prompt", "x", "--set", "model.d_model=64"], "only mesh.* may be set"),
    (["--prompt", "x", "--set", "mesh.tensor=4"], "must divide model.n_kv_heads=2"),
    (["--prompt", "x", "--set", "mesh.pipe=2"], "mesh.pipe=2"),
    (["--prompt", "x", "--num-samples", "3", "--set", "mesh.data=2"], "do not split over the mesh's 2 batch shards"),
], ids=["empty", "too-long", "too-long-with-new", "temperature", "top-p-0", "top-p-big", "not-mesh", "kv-heads",
        "pipe", "batch"])
def test_bad_input(workdir, capsys, extra, expect):
    if "--max-new-tokens" not in extra:
        extra = [*extra, "--max-new-tokens", "4"]
    assert main(["sample", str(workdir), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert expect in err[-1] and err[-1].startswith("parallax: error:"), err


def test_no_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for wd in (tmp_path / "empty", tmp_path / "missing"):
        assert main(["sample", str(wd), "--prompt", "x"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert str(wd) in err and ("no checkpoint" in err or "does not exist" in err), err
