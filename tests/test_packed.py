"""Packed documents (issue 17, data.eod_id): the data path's segment ids, positions and loss mask,
attention within a document only, rotary positions per document and the masked loss, against
each document run alone.

float32. Attention across a masked-out key adds exp(-inf) = 0 exactly, so segment-masked
attention differs from the per-document reference only in the order of float32 sums: outputs
rtol 1e-6 (atol 1e-6), gradients within 1e-5 of each leaf's largest magnitude + 1e-7
(GRAD_RTOL/GRAD_ATOL, as tests/test_vocab.py). The packed loss against the token-weighted mean
of the documents' losses: rtol 1e-6; its gradients the same leaf-relative 1e-5 (+1e-7).
"""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.cli import main
from parallax.config import Config, ConfigError, DataConfig, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
from parallax.model.attention import causal_attention
from parallax.parallel.pipeline import to_layer_major
from parallax.model.transformer import Transformer
from parallax.parallelism import check, reduces_once
from parallax.train import data as data_mod
from parallax.train.build import build
from parallax.train.data import DOC_KEYS, STDLIB_EOD, make_global_batch, open_data, split_batch, stdlib_files
from parallax.train.train_state import init_state
from parallax.train.train_step import accumulate, make_grad_fn
from numerics import assert_trees_close
from test_cli import QUICKSTART, TINY, _assert_one_error_line, _make_workdir, _sets, _snapshot

OUT_RTOL, OUT_ATOL = 1e-6, 1e-6
LOSS_RTOL = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7

V, T, B, EOD = 64, 16, 8, 3
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=V)


def _packed_rows(seed: int = 0) -> np.ndarray:
    """[B, T+1] rows with end-of-document ids in every arrangement that matters."""
    rows = np.random.default_rng(seed).integers(EOD + 1, V, (B, T + 1)).astype(np.int32)
    rows[0, [4, 9]] = EOD  # three documents
    rows[2, T - 1] = EOD  # the last input ends a document: the last target starts one (masked)
    rows[3, 0] = EOD  # a one-token document first
    rows[4, [5, 6]] = EOD  # a one-token document inside
    rows[5, T] = EOD  # the last target is an end-of-document id: a document's own last token
    rows[6, 1::3] = EOD  # many short documents
    return rows  # row 1, row 7: one document


def _documents(row: np.ndarray) -> list[np.ndarray]:
    """The documents of one [T+1] row, each with its end-of-document token: split after every
    end-of-document id among the inputs (row[:-1])."""
    cuts = [j + 1 for j in range(len(row) - 1) if row[j] == EOD]
    return [d for d in np.split(row, cuts) if len(d)]


# ----------------------------------------------------------------------------------------------
# The data path


def test_split_batch_segments_positions_and_mask():
    row = np.array([[10, 11, EOD, 12, EOD, EOD, 13, 14, 15]], np.int32)  # T = 8
    b = split_batch(row, EOD)
    assert set(b) == {"inputs", "targets", *DOC_KEYS}
    np.testing.assert_array_equal(b["inputs"][0], row[0, :-1])
    np.testing.assert_array_equal(b["targets"][0], row[0, 1:])
    np.testing.assert_array_equal(b["segment_ids"][0], [0, 0, 0, 1, 1, 2, 3, 3])
    np.testing.assert_array_equal(b["positions"][0], [0, 1, 2, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(b["loss_mask"][0], [1, 1, 0, 1, 0, 0, 1, 1])
    assert all(v.dtype == np.int32 for v in b.values())
    # unpacked: exactly today's two keys, the same arrays
    plain = split_batch(row)
    assert set(plain) == {"inputs", "targets"}
    np.testing.assert_array_equal(plain["inputs"], row[:, :-1])


def test_split_batch_matches_the_documents():
    rows = _packed_rows()
    b = split_batch(rows, EOD)
    for r, row in enumerate(rows):
        docs = _documents(row)
        want_seg = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])[:T]
        want_pos = np.concatenate([np.arange(len(d)) for d in docs])[:T]
        np.testing.assert_array_equal(b["segment_ids"][r], want_seg)
        np.testing.assert_array_equal(b["positions"][r], want_pos)
        # the loss keeps len(doc) - 1 targets per document
        assert b["loss_mask"][r].sum() == sum(len(d) - 1 for d in docs)


def _token_file(tmp_path, n=4000, seed=0):
    toks = np.random.default_rng(seed).integers(EOD + 1, V, n).astype(np.uint16)
    toks[np.random.default_rng(seed + 1).integers(0, n, n // 10)] = EOD
    path = tmp_path / "tokens.bin"
    toks.tofile(path)
    return path, toks


def _cfg(source, eod=EOD, **train):
    return Config(model=MODEL, data=DataConfig(source=str(source), eod_id=eod),
                  train=TrainConfig(global_batch=B, seq_len=T, **train))


def test_token_file_batches_carry_documents_and_resume_exactly(tmp_path):
    path, toks = _token_file(tmp_path)
    train, val = open_data(_cfg(path))
    assert train.eod_id == EOD and val.eod_id == EOD
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    for step in (0, 7):
        got = {k: np.asarray(v) for k, v in make_global_batch(train, step, sharding).items()}
        assert set(got) == {"inputs", "targets", *DOC_KEYS}
        want = split_batch(train.batch_rows(step), EOD)
        for k in got:
            np.testing.assert_array_equal(got[k], want[k])
        # segment ids and positions from the token stream itself
        for r, off in enumerate(train.offsets(step)):
            window = toks[off: off + T + 1].astype(np.int32)
            np.testing.assert_array_equal(got["inputs"][r], window[:-1])
            docs = _documents(window)
            np.testing.assert_array_equal(got["positions"][r], np.concatenate([np.arange(len(d)) for d in docs])[:T])
        # resume: a fresh batcher (a restarted process) gives the same batch for the step
        again = open_data(_cfg(path))[0]
        for k, v in make_global_batch(again, step, sharding).items():
            np.testing.assert_array_equal(np.asarray(v), got[k])
    # unpacked: the same windows, only inputs and targets
    plain = open_data(_cfg(path, eod=-1))[0]
    got = make_global_batch(plain, 7, sharding)
    assert set(got) == {"inputs", "targets"}
    np.testing.assert_array_equal(np.asarray(got["inputs"]), train.batch_rows(7)[:, :-1])


def test_stdlib_documents_split_at_file_boundaries():
    files, _ = stdlib_files()
    packed, packed_val = data_mod.stdlib_tokens(True)
    plain, _ = data_mod.stdlib_tokens()
    assert int(np.sum(packed == STDLIB_EOD)) == len(files)  # one end-of-document byte per file
    assert int(np.sum(plain == STDLIB_EOD)) == 0
    assert len(packed) == len(plain) + len(files)
    ends = np.flatnonzero(packed == STDLIB_EOD)
    start = 0
    for f, end in zip(files[:5], ends[:5]):
        assert packed[start:end].tobytes() == f.read_bytes()
        start = end + 1
    assert packed[-1] == STDLIB_EOD and packed_val[-1] == STDLIB_EOD
    train, _ = open_data(Config(data=DataConfig(eod_id=0), train=TrainConfig(global_batch=4, seq_len=64)))
    assert train.tokens is data_mod.stdlib_tokens(True)[0]
    b = split_batch(train.batch_rows(0), 0)
    assert (b["positions"] == 0).sum() >= 4  # every row starts a (fragment of a) document


# ----------------------------------------------------------------------------------------------
# Attention


def _segments() -> np.ndarray:
    seg = np.zeros((3, T), np.int32)
    seg[0] = [0] * 5 + [1] * 7 + [2] * 4
    seg[1] = [0] * T
    seg[2] = [0] + [1] * 3 + [2] * 4 + [3] * 8
    return seg


def _per_document(fn, seg: np.ndarray):
    """fn(q, k, v) on [1, L, ...] slices -> the [B, T, N, H] output assembled from each document run alone."""
    def run(q, k, v):
        rows = []
        for b in range(seg.shape[0]):
            parts = []
            for s in np.unique(seg[b]):
                idx = np.flatnonzero(seg[b] == s)
                a, e = idx[0], idx[-1] + 1
                parts.append(fn(q[b:b + 1, a:e], k[b:b + 1, a:e], v[b:b + 1, a:e]))
            rows.append(jnp.concatenate(parts, axis=1))
        return jnp.concatenate(rows, axis=0)
    return run


@pytest.mark.parametrize("chunk", [0, 4])
def test_segment_attention_equals_each_document_alone(chunk):
    keys = jax.random.split(jax.random.key(0), 4)
    seg = _segments()
    q = jax.random.normal(keys[0], (3, T, 4, 8))  # 4 query heads over 2 kv heads (grouped-query)
    k, v = (jax.random.normal(kk, (3, T, 2, 8)) for kk in keys[1:3])
    cot = jax.random.normal(keys[3], q.shape)
    want, want_vjp = jax.vjp(jax.jit(_per_document(lambda *a: causal_attention(*a, 0), seg)), q, k, v)
    got, got_vjp = jax.vjp(lambda *a: causal_attention(*a, chunk, jnp.asarray(seg)), q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=OUT_RTOL, atol=OUT_ATOL)
    assert_trees_close(got_vjp(cot), want_vjp(cot), GRAD_RTOL, GRAD_ATOL)
    # one segment per row is the unpacked attention
    one = jnp.zeros((3, T), jnp.int32)
    np.testing.assert_allclose(np.asarray(causal_attention(q, k, v, chunk, one)),
                               np.asarray(causal_attention(q, k, v, chunk)), rtol=OUT_RTOL, atol=OUT_ATOL)


# ----------------------------------------------------------------------------------------------
# The masked loss head


@pytest.mark.parametrize("chunk", [16, 4])
def test_masked_fused_loss_equals_masked_cross_entropy(chunk):
    """vocab.fused_cross_entropy with a loss mask against cross_entropy of the materialised logits
    (the FP8-logits path's loss), values and gradients; an all-masked batch is 0 with 0 gradients."""
    from parallax.model.layers import ParamUse
    from parallax.model.logical import ParamPlacement
    from parallax.model.vocab import VocabPins, cross_entropy, fused_cross_entropy
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (B, T, 32))
    w = jax.random.normal(keys[1], (32, V)) * 0.1
    b = split_batch(_packed_rows(), EOD)
    tg, mask = jnp.asarray(b["targets"]), jnp.asarray(b["loss_mask"])
    use = ParamUse(ParamPlacement(), jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
    dims = (((2,), (0,)), ((), ()))

    def fused(x, w, m):
        return fused_cross_entropy(x, w, tg, dims, use, chunk, VocabPins.here(("embed", "vocab")), m)

    want, want_g = jax.value_and_grad(lambda x, w: cross_entropy(jnp.einsum("btd,dv->btv", x, w), tg, mask),
                                      argnums=(0, 1))(x, w)
    got, got_g = jax.value_and_grad(lambda x, w: fused(x, w, mask), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(float(got), float(want), rtol=LOSS_RTOL)
    assert_trees_close(got_g, want_g, GRAD_RTOL, GRAD_ATOL)
    zero, zero_g = jax.value_and_grad(lambda x, w: fused(x, w, jnp.zeros_like(mask)), argnums=(0, 1))(x, w)
    assert float(zero) == 0.0 and all(float(jnp.abs(g).max()) == 0.0 for g in zero_g)
    # no mask: the unmasked mean, as before
    np.testing.assert_allclose(float(fused(x, w, None)), float(cross_entropy(jnp.einsum("btd,dv->btv", x, w), tg)),
                               rtol=LOSS_RTOL)


# ----------------------------------------------------------------------------------------------
# The model's loss against each document alone


def _reference_loss(model: Transformer, params, rows: np.ndarray):
    """Token-weighted mean of the documents' losses, each document alone as its own row."""
    total, count = 0.0, 0
    for row in rows:
        for d in _documents(row):
            if len(d) < 2:
                continue  # no target
            tokens, targets = jnp.asarray(d[None, :-1]), jnp.asarray(d[None, 1:])
            total = total + model.apply(params, tokens, targets, method=Transformer.loss)[0] * (len(d) - 1)
            count += len(d) - 1
    return total / count


def _packed_loss(model: Transformer, params, batch):
    return model.apply(params, *(batch[k] for k in ("inputs", "targets", *DOC_KEYS)), method=Transformer.loss)[0]


@pytest.mark.parametrize("tied, chunks", [(False, (0, 0)), (True, (4, 4))], ids=["untied", "tied_chunked"])
def test_packed_loss_equals_the_documents_alone_on_one_device(tied, chunks):
    rows = _packed_rows()
    batch = {k: jnp.asarray(v) for k, v in split_batch(rows, EOD).items()}
    cfg = dataclasses.replace(MODEL, tie_embeddings=tied)
    reference = Transformer(cfg)
    model = Transformer(cfg, loss_chunk=chunks[0], attention_chunk=chunks[1])
    params = nn.unbox(model.init(jax.random.key(0), batch["inputs"]))
    want, want_g = jax.jit(jax.value_and_grad(lambda p: _reference_loss(reference, p, rows)))(params)
    got, got_g = jax.value_and_grad(lambda p: _packed_loss(model, p, batch))(params)
    np.testing.assert_allclose(float(got), float(want), rtol=LOSS_RTOL)
    assert_trees_close(got_g, want_g, GRAD_RTOL, GRAD_ATOL)
    # and it is not the unpacked loss of the same rows (attention and loss would cross documents)
    plain = model.apply(params, batch["inputs"], batch["targets"], method=Transformer.loss)[0]
    assert abs(float(plain) - float(want)) > 1e-4


@pytest.fixture(scope="module")
def documents_alone():
    """The reference the step tests share: loss and gradients of the documents alone at the
    train state's initial parameters (one jitted program over every document's own row, which
    costs more to compile than the steps it checks: built once per module)."""
    cfg = Config(model=MODEL, train=TrainConfig(global_batch=B, seq_len=T))
    params = {"params": init_state(cfg, build(cfg, jax.devices()[:1]).layout).params}
    return jax.jit(jax.value_and_grad(lambda p: _reference_loss(Transformer(MODEL), p, _packed_rows())))(params)


def _step_grads(mesh: MeshConfig, parallel: ParallelConfig, devices, eod: int = EOD):
    cfg = Config(mesh=mesh, model=MODEL, parallel=parallel, data=DataConfig(eod_id=eod),
                 train=TrainConfig(global_batch=B, seq_len=T))
    b = build(cfg, devices)
    batch = jax.device_put(split_batch(_packed_rows(), eod), b.batch_sharding)
    loss, grads = make_grad_fn(b.layout)(init_state(cfg, b.layout).params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


def test_packed_step_on_data_x_tensor_equals_the_documents_alone(documents_alone):
    """The jitted gradient step (train_step.make_grad_fn) with the packed batch sharded over the
    batch axes: on 1 device, on data 2 x tensor 2 (chunked attention and loss, sequence
    parallelism), against the documents alone."""
    want, want_g = documents_alone
    one = _step_grads(MeshConfig(data=1), ParallelConfig(), jax.devices()[:1])
    sharded = _step_grads(MeshConfig(data=2, tensor=2),
                          ParallelConfig(loss_chunk=4, attention_chunk=8, sequence_parallel=True), jax.devices()[:4])
    for loss, grads in (one, sharded):
        np.testing.assert_allclose(loss, float(want), rtol=LOSS_RTOL)
        assert_trees_close(grads, want_g["params"], GRAD_RTOL, GRAD_ATOL)


@pytest.mark.parametrize("mesh, parallel", [
    (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(microbatches=2)),
    (MeshConfig(data=2, pipe=2), ParallelConfig(microbatches=2, remat="full", zero=3)),
    # 1F1B: the head per microbatch, each mean weighted by its share of the kept tokens
    (MeshConfig(data=2, tensor=2, pipe=2), ParallelConfig(microbatches=4, schedule="1f1b")),
], ids=["gpipe_d2_t2_p2", "gpipe_d2_p2_zero3_remat", "1f1b_d2_t2_p2"])
def test_packed_step_in_pipeline_stages_equals_the_documents_alone(documents_alone, mesh, parallel):
    """Segment ids and positions cut into microbatches (and half-microbatches) with the
    activations, through every stage; the mean over all the batch's kept tokens (GPipe: the head on
    the whole batch; 1F1B: per microbatch, weighted)."""
    want, want_g = documents_alone
    n = mesh.data * mesh.tensor * mesh.pipe
    loss, grads = _step_grads(mesh, parallel, jax.devices()[:n])
    grads["layers"] = to_layer_major(grads["layers"], MODEL.n_layers)
    np.testing.assert_allclose(loss, float(want), rtol=LOSS_RTOL)
    assert_trees_close(grads, want_g["params"], GRAD_RTOL, GRAD_ATOL)


@pytest.mark.parametrize("mesh", [MeshConfig(data=1), MeshConfig(data=2, tensor=2)], ids=["d1", "d2_t2"])
def test_packed_grad_accum_equals_the_documents_alone(documents_alone, mesh):
    """train.grad_accum=2 with packed documents (train_step.accumulate): each microstep's mean over
    its kept tokens weighted by its share of the batch's, on 1 device and on data 2 x tensor 2,
    where each batch shard's gradient is accumulated unreduced (parallelism.reduces_once) and
    weighted per shard: loss, cross-entropy and gradients equal the documents alone. The rows keep
    different numbers of tokens (_packed_rows), so an unweighted mean of the parts would not."""
    cfg = Config(mesh=mesh, model=MODEL, data=DataConfig(eod_id=EOD),
                 train=TrainConfig(global_batch=B, seq_len=T, grad_accum=2))
    n = mesh.data * mesh.tensor
    assert bool(reduces_once(2, False, False, 0, mesh.data, 1)) == (mesh.data > 1)
    want, want_g = documents_alone
    b = build(cfg, jax.devices()[:n])
    batch = jax.device_put(split_batch(_packed_rows(), EOD), b.batch_sharding)
    (loss, (ce, _)), (grads, _) = jax.jit(accumulate(cfg, b.layout))(init_state(cfg, b.layout).params, batch, {})
    np.testing.assert_allclose(float(loss), float(want), rtol=LOSS_RTOL)
    np.testing.assert_allclose(float(ce), float(want), rtol=LOSS_RTOL)
    assert_trees_close(jax.tree.map(np.asarray, grads), want_g["params"], GRAD_RTOL, GRAD_ATOL)


# ----------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("mesh, parallel, train, needles", [
    (MeshConfig(data=4), ParallelConfig(), {"noise_scale": True}, ["data.eod_id=3", "train.noise_scale"]),
], ids=["noise_scale"])
def test_packed_refuses_what_it_cannot_run_yet(mesh, parallel, train, needles):
    cfg = Config(mesh=mesh, model=MODEL, parallel=parallel, data=DataConfig(eod_id=EOD),
                 train=TrainConfig(global_batch=B, seq_len=T, **train))
    sizes = {"data": mesh.data, "tensor": mesh.tensor, "pipe": mesh.pipe, "expert": mesh.expert}
    with pytest.raises(ConfigError) as e:
        check(cfg, sizes)
    for n in needles:
        assert n in str(e.value)
    check(dataclasses.replace(cfg, data=DataConfig(eod_id=-1)), sizes)  # unpacked: fine


# ----------------------------------------------------------------------------------------------
# The CLI


@pytest.mark.parametrize("overrides, needles", [
    (["data.eod_id=256"], ["data.eod_id=256", "model.vocab_size=256"]),
    (["data.eod_id=7"], ["data.eod_id=7", "byte 0"]),
    (["data.eod_id=-2"], ["data.eod_id", "-1"]),
    (["data.eod_id=0", "train.noise_scale=true"], ["data.eod_id=0", "train.noise_scale"]),
], ids=["beyond_vocab", "stdlib_not_nul", "below_range", "noise_scale"])
def test_bad_packing_input_is_one_line_exit_2(tmp_path, capsys, overrides, needles):
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, *overrides), "--workdir", str(wd)])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, *needles)
    assert _snapshot(tmp_path) == before


def test_token_file_eod_beyond_vocab_is_one_line_exit_2(tmp_path, capsys):
    path, _ = _token_file(tmp_path)
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, f"data.source={path}", "model.vocab_size=64",
                                                 "data.eod_id=64"), "--workdir", str(tmp_path / "wd")])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, "data.eod_id=64", "model.vocab_size=64")
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("source", ["stdlib", "file"])
def test_cli_trains_packed(tmp_path, capsys, source):
    extra = ["data.eod_id=0", "train.grad_accum=2"]  # the built-in corpus, in two microsteps
    if source == "file":
        path, _ = _token_file(tmp_path)
        extra = [f"data.source={path}", "model.vocab_size=64", f"data.eod_id={EOD}"]
    wd = tmp_path / "run"
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, "train.steps=3", "train.eval_every=3", *extra),
               "--workdir", str(wd)])
    assert rc == 0, capsys.readouterr()
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] == 3
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    assert np.isfinite(records[-1]["eval_loss"])
