"""`parallax import-hf` / `export-hf` (parallax/interop) against `transformers` on the CPU.

Tiny random Llama (grouped-query, untied, rope_theta 5000), Mistral (tied, multi-head) and Mixtral
(3 experts, top-2, grouped-query) models are built from configs here, saved with save_pretrained,
imported and compared with transformers on the same tokens; exported back, loaded by
transformers and compared again; the round trip must keep every weight's bits. The imported
workdir is fine-tuned by `parallax train` as it is. Bad input: one stderr line, exit 2, nothing
written. The tests that need torch/transformers (test-only dependencies) skip where they are absent.
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from parallax.cli import main
from parallax.config import load_experiment

# float32 on both sides; what differs is the order of float32 sums (XLA vs torch matmuls, the
# softmax) and rope's angles (jnp vs torch sin/cos). Weights drawn with std 0.25 so that logits
# are O(1) (max |logit| ~5-6): measured max |diff| 3.5e-6 .. 5.7e-6 over the three models, so
# 5e-5 absolute (+1e-5 relative) is ~8x the measured gap; a wrong layout moves logits by >1e-2
# (swapping Mixtral's w1 and w3, checked once by hand).
ATOL, RTOL = 5e-5, 1e-5
T = 12  # tokens per sequence in the comparisons

MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=261, hidden_size=24, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=64, initializer_range=0.25)),
    "mistral_tied": ("MistralConfig", "MistralForCausalLM", dict(
        vocab_size=259, hidden_size=24, intermediate_size=28, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        sliding_window=None, max_position_embeddings=64, initializer_range=0.25)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=263, hidden_size=24, intermediate_size=14, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, num_local_experts=3, num_experts_per_tok=2, rope_theta=20000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64, initializer_range=0.25)),
}


def _hf_model(kind: str):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config_cls, model_cls, kw = MODELS[kind]
    torch.manual_seed(sorted(MODELS).index(kind))
    config = getattr(transformers, config_cls)(**kw)
    model = getattr(transformers, model_cls)._from_config(config, **_eager(kind)).float().eval()
    with torch.no_grad():  # norms start at 1 in HF: random scales so that a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _eager(kind: str) -> dict:
    """Plain torch code paths: eager attention and (transformers 5) the per-expert loop, whose
    grouped-GEMM default wants 16-byte-aligned sizes that the odd expert width here is not."""
    import transformers

    kw = {"attn_implementation": "eager"}
    if kind == "mixtral" and hasattr(transformers.PreTrainedModel, "get_correct_experts_implementation"):
        kw["experts_implementation"] = "eager"
    return kw


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (2, T), dtype=np.int64)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.float().numpy()


def _parallax_logits(workdir: Path, tokens: np.ndarray, step: int = 0) -> np.ndarray:
    """The imported workdir's checkpoint, restored as the training loop restores it, then the
    plain model's forward on its parameters."""
    from parallax.model.transformer import Transformer
    from parallax.train.build import build
    from parallax.train.checkpoint import Checkpoints

    cfg = load_experiment(workdir / "experiment.py")
    built = build(cfg)
    restored = Checkpoints(workdir).restore(cfg, built.layout)
    assert restored.step == step
    params = jax.device_get(restored.state.params)
    logits = jax.jit(lambda p, t: Transformer(cfg.model).apply({"params": p}, t))(params, tokens.astype(np.int32))
    return np.asarray(logits)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """kind -> (HF model, its dir, the imported workdir), made once per kind."""
    made = {}

    def get(kind: str):
        if kind not in made:
            model = _hf_model(kind)
            root = tmp_path_factory.mktemp(kind)
            model.save_pretrained(root / "hf")
            rc = main(["import-hf", str(root / "hf"), "--out", str(root / "wd")])
            assert rc == 0
            made[kind] = (model, root / "hf", root / "wd")
        return made[kind]

    return get


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_imported_logits_match_transformers(imported, kind):
    model, _, wd = imported(kind)
    cfg = load_experiment(wd / "experiment.py")
    kw = MODELS[kind][2]
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.vocab_size) == (
        kw["hidden_size"], kw["num_attention_heads"], kw["num_key_value_heads"], kw["vocab_size"])
    assert cfg.model.tie_embeddings == kw["tie_word_embeddings"] and cfg.model.rope_theta == kw["rope_theta"]
    assert cfg.mesh.data == -1 and cfg.train.lr == 2e-5 and cfg.model.dtype == "float32"
    assert json.loads((wd / "run.json").read_text())["fixed"]["model.d_model"] == kw["hidden_size"]
    tokens = _tokens(kw["vocab_size"])
    want = _hf_logits(model, tokens)
    got = _parallax_logits(wd, tokens)
    assert got.shape == want.shape == (2, T, kw["vocab_size"])
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("kind,shard,bare", [("llama", None, False), ("mistral_tied", None, False),
                                             ("mixtral", "20KB", False), ("mixtral", None, True)])
def test_export_loads_in_transformers_and_round_trips_every_bit(imported, tmp_path, kind, shard, bare):
    """`bare`: the workdir without the imported config.json (WORKDIR/hf), as a model parallax
    trained from scratch: config.json is then made from the parallax config alone."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    model, hf_dir, wd = imported(kind)
    if bare:
        shutil.copytree(wd, tmp_path / "bare", ignore=shutil.ignore_patterns("hf"))
        wd = tmp_path / "bare"
    out = tmp_path / "export"
    rc = main(["export-hf", str(wd), "--out", str(out), *(["--max-shard-size", shard] if shard else [])])
    assert rc == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if shard:  # sharded, with an index naming every tensor's file
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
        for f in files:  # at most 20 KB of tensors, or one tensor larger than that alone
            sizes = [v.nbytes for v in load_file(str(out / f)).values()]
            assert sum(sizes) <= 20_000 or len(sizes) == 1, (f, sizes)
    else:
        assert files == ["model.safetensors"]
    exported = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    original = {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    if MODELS[kind][2]["tie_word_embeddings"]:
        original.pop("lm_head.weight", None)
    assert set(exported) == set(original)
    for name, value in original.items():
        assert np.array_equal(_bits(exported[name]), _bits(value)), name

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [MODELS[kind][1]]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, **_eager(kind)).float().eval()
    assert type(back).__name__ == MODELS[kind][1]
    tokens = _tokens(MODELS[kind][2]["vocab_size"])
    with torch.no_grad():
        assert torch.equal(back(torch.from_numpy(tokens)).logits, model(torch.from_numpy(tokens)).logits)


def test_imported_workdir_fine_tunes_and_exports(imported, capsys, tmp_path):
    _, _, wd = imported("llama")
    capsys.readouterr()
    rc = main(["train", str(wd / "experiment.py"), "--workdir", str(wd), "--set", "train.steps=2",
               "--set", "train.global_batch=8", "--set", "train.seq_len=16", "--set", "train.eval_batches=1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "resuming from checkpoint step 0" in out
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
    assert (wd / "checkpoints" / "2").is_dir()

    # The trained weights go out too, and without the imported config.json (as for a model parallax
    # trained from scratch) config.json is built from the parallax config alone.
    import torch
    import transformers

    bare = tmp_path / "bare"
    shutil.copytree(wd, bare, ignore=shutil.ignore_patterns("hf"))
    assert main(["export-hf", str(bare), "--out", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", **_eager("llama")).float().eval()
    tokens = _tokens(MODELS["llama"][2]["vocab_size"])
    with torch.no_grad():
        theirs = back(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, _parallax_logits(bare, tokens, step=2), atol=ATOL, rtol=RTOL)


def test_bfloat16_sharded_checkpoint_imports_exactly(tmp_path):
    """A bfloat16 checkpoint in several files with an index: read through the index, widened to
    float32 exactly (the export's float32 tensors equal the bfloat16 ones, value for value), and
    the fine-tune computes in bfloat16."""
    torch = pytest.importorskip("torch")

    model = _hf_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "wd")]) == 0
    assert load_experiment(tmp_path / "wd" / "experiment.py").model.dtype == "bfloat16"
    assert main(["export-hf", str(tmp_path / "wd"), "--out", str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in model.state_dict().items():
        assert exported[name].dtype == np.float32
        assert np.array_equal(exported[name], value.float().numpy()), name


def test_same_tokenizer_ids_in_parallax_and_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from parallax.train.tokenizer import load_tokenizer, train_bpe

    texts = ["def f(x):\n    return x + 1\n", "naïve café — ünïcödé ✓ 日本語\n", "The quick brown fox.\n"] * 30
    path = tmp_path / "tokenizer.json"
    path.write_text(train_bpe(texts, 300).to_json())
    ours = load_tokenizer(path)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    for text in texts[:3] + ["unseen words and\ttabs\r\n"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text, add_special_tokens=False)) == text
    # A special token spelled in a document stays text in parallax (tokenizer.py: it must not end
    # a document): transformers' split_special_tokens=True; its default maps it to the eod id.
    spelled = "a page about <|endoftext|> tokens"
    assert ours.encode(spelled) == theirs(spelled, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ours.eod_id in theirs.encode(spelled, add_special_tokens=False) and ours.eod_id not in ours.encode(spelled)


def test_tokenizer_travels_through_import_and_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    from parallax.train.tokenizer import load_tokenizer, train_bpe

    model = _hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    tok_file = tmp_path / "tok.json"
    tok_file.write_text(train_bpe(["some text to learn from\n"] * 20, 261).to_json())
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "wd")]) == 0
    assert (tmp_path / "wd" / "hf" / "tokenizer.json").is_file()
    assert main(["export-hf", str(tmp_path / "wd"), "--out", str(tmp_path / "out")]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    text = "some new text, learnt from?"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)


def test_export_takes_the_tokenizer_of_prepared_data(tmp_path):
    """A run on a prepared directory (train/prepare.py's manifest): its tokenizer.json is what the
    export carries, with a tokenizer_config.json naming the end-of-document token."""
    from parallax.config import Config, DataConfig
    from parallax.interop.hf import _copy_tokenizer
    from parallax.train.tokenizer import MANIFEST

    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_text('{"a tokenizer": true}')
    (data / MANIFEST).write_text(json.dumps({"tokenizer": "tokenizer.json", "vocab_size": 300, "eod_id": 0,
                                             "eod_token": "<|endoftext|>"}))
    out = tmp_path / "out"
    out.mkdir()
    cfg = Config(data=DataConfig(source=str(data)))
    assert _copy_tokenizer(cfg, tmp_path / "wd", out) == f"data {str(data)!r}"
    assert (out / "tokenizer.json").read_text() == '{"a tokenizer": true}'
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert _copy_tokenizer(Config(), tmp_path / "wd", tmp_path) is None  # bytes: no tokenizer


# ----------------------------------------------------------------------------------------------
# Bad input: a checkpoint written here with NumPy (no torch needed), HF's names and [out, in] shapes

V, D, N, K, H, F, L = 260, 16, 4, 2, 4, 12, 2
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": D,
                "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": N, "num_key_value_heads": K,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
                "max_position_embeddings": 32}


def _numpy_llama(directory: Path, drop: str | None = None, reshape: dict | None = None) -> Path:
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
                       p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,)})
    shapes.update(reshape or {})
    directory.mkdir(parents=True)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items() if k != drop}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    return directory


def _one_error_line(capsys, *needles: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parallax: error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])


def test_numpy_checkpoint_imports(tmp_path):
    """The NumPy checkpoint the bad-input cases start from is itself good."""
    src = _numpy_llama(tmp_path / "hf")
    assert main(["import-hf", str(src), "--out", str(tmp_path / "wd")]) == 0
    assert (tmp_path / "wd" / "checkpoints" / "0").is_dir()
    assert not list(tmp_path.glob(".wd.parallax-tmp-*"))  # the staging directory is gone


@pytest.mark.parametrize("sets", [
    ["parallel.zero=3", "mesh.tensor=2", "mesh.pipe=2", "parallel.microbatches=2"],
    ["fp8.enabled=True", "mesh.tensor=2", "parallel.zero=1"],
])
def test_import_into_a_sharded_pipelined_layout_round_trips_every_bit(tmp_path, sets):
    """Parameters cut on the fly into ZeRO-3 shards (over embed), tensor shards and pipeline stages
    (or with FP8 state beside them): exported from the checkpoint again, every weight is the source's."""
    src = _numpy_llama(tmp_path / "hf")
    assert main(["import-hf", str(src), "--out", str(tmp_path / "wd"), *[a for s in sets for a in ("--set", s)]]) == 0
    assert main(["export-hf", str(tmp_path / "wd"), "--out", str(tmp_path / "out")]) == 0
    source, exported = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(source) == set(exported)
    for name, value in source.items():
        assert np.array_equal(_bits(exported[name]), _bits(value)), name


@pytest.mark.parametrize("config,drop,reshape,needles", [
    ({}, "model.layers.1.mlp.up_proj.weight", None, ["'model.layers.1.mlp.up_proj.weight'", "missing"]),
    ({}, None, {"model.layers.0.self_attn.k_proj.weight": (N * H, D)},
     ["'model.layers.0.self_attn.k_proj.weight'", "[16, 16]", "expects [8, 16]"]),
    ({"intermediate_size": F + 1}, None, None, ["'model.layers.0.mlp.gate_proj.weight'", "[12, 16]", "[13, 16]"]),
    ({}, None, {"model.layers.0.self_attn.q_proj.bias": (N * H,)}, ["'model.layers.0.self_attn.q_proj.bias'",
                                                                     "no place"]),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, None, None, ["model_type='gpt2'", "config.json"]),
    ({"architectures": ["LlamaForSequenceClassification"]}, None, None, ["architectures", "LlamaForCausalLM"]),
    ({"attention_bias": True}, None, None, ["attention_bias"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, None, None, ["rope_scaling", "llama3"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, None, None, ["rope_parameters.rope_type"]),
    ({"head_dim": 8}, None, None, ["head_dim=8", "hidden_size / num_attention_heads = 4"]),
    ({"hidden_act": "gelu"}, None, None, ["hidden_act='gelu'"]),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 16}, None, None,
     ["sliding_window=16", "train.seq_len=32"]),
    ({"hidden_size": None}, None, None, ["'hidden_size' is missing"]),
])
def test_bad_checkpoint_is_one_line_exit_2_nothing_written(tmp_path, capsys, config, drop, reshape, needles):
    src = _numpy_llama(tmp_path / "hf", drop, reshape)
    (src / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **config}))
    capsys.readouterr()
    assert main(["import-hf", str(src), "--out", str(tmp_path / "wd")]) == 2
    _one_error_line(capsys, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no workdir, no staging directory


def test_import_refuses_fixed_model_fields_and_non_empty_out(tmp_path, capsys):
    src = _numpy_llama(tmp_path / "hf")
    assert main(["import-hf", str(src), "--out", str(tmp_path / "wd"), "--set", "model.d_model=32"]) == 2
    _one_error_line(capsys, "--set model.d_model", "config.json")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep")
    assert main(["import-hf", str(src), "--out", str(tmp_path / "busy")]) == 2
    _one_error_line(capsys, "busy", "not an empty directory")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["x"]
    shutil.rmtree(src / "model.safetensors", ignore_errors=True)
    (src / "model.safetensors").unlink()
    assert main(["import-hf", str(src), "--out", str(tmp_path / "wd")]) == 2
    _one_error_line(capsys, "model.safetensors", "model.safetensors.index.json")


def test_export_refuses_no_checkpoint_and_non_empty_out(tmp_path, capsys):
    (tmp_path / "wd").mkdir()
    assert main(["export-hf", str(tmp_path / "wd"), "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, "holds no checkpoint")
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    assert main(["export-hf", str(tmp_path / "wd"), "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, "not an empty directory")
    assert main(["export-hf", str(tmp_path / "wd"), "--out", str(tmp_path / "o2"), "--max-shard-size", "big"]) == 2
    _one_error_line(capsys, "--max-shard-size='big'")
