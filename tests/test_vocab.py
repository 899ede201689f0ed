"""The vocabulary ends (parallax/model/vocab.py, issue 22): the gather embedding and the fused,
chunked loss head against their references, on one device and sharded.

References: the embedding as the one-hot matmul it replaced ([B, T, V] x [V, D], duplicates of a
token in the batch included), the loss as `vocab.cross_entropy` of the materialised float32
logits. float32: the fused loss changes only the order of the float32 sums (chunk by chunk, the
log-sum-exp's own), so loss rtol 1e-6 and gradients within 1e-5 of each leaf's largest magnitude
(+1e-7); seen: loss equal to 2e-7, gradients 4e-7 of the leaf max (BUILD_NOTES.md, issue 22).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.cli import main
from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
from parallax.model.transformer import Transformer
from parallax.model.vocab import cross_entropy, fused_cross_entropy
from parallax.train.build import build
from parallax.train.train_state import init_state
from parallax.train.train_step import make_grad_fn
from numerics import assert_trees_close
from test_cli import QUICKSTART, TINY, _assert_one_error_line, _make_workdir, _sets, _snapshot

LOSS_RTOL = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
V, T, B = 64, 16, 8
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=V)


def _rows(seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).integers(0, V, (B, T + 1)).astype(np.int32)
    rows[:, :4] = 7  # one token many times over: the scatter-add must sum its rows
    return rows


def _reference_loss(model: Transformer, params, tokens, targets):
    """One-hot embedding and materialised logits (the step before issue 22)."""

    def embed(table):
        return jnp.einsum("btv,vd->btd", jax.nn.one_hot(tokens, V, dtype=jnp.float32), table)

    x = embed(params["params"]["embed"]["embedding"])
    x, _ = model.apply(params, x, method=Transformer.run_blocks)
    return cross_entropy(model.apply(params, x, method=Transformer.head), targets)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [0, 4])
def test_fused_loss_and_gather_embedding_equal_the_references_on_one_device(tied, chunk):
    rows = _rows()
    tokens, targets = jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:])
    cfg = dataclasses.replace(MODEL, tie_embeddings=tied)
    model = Transformer(cfg, loss_chunk=chunk)
    params = nn.unbox(model.init(jax.random.key(0), tokens))
    want, want_g = jax.value_and_grad(lambda p: _reference_loss(model, p, tokens, targets))(params)
    got, got_g = jax.value_and_grad(lambda p: model.apply(p, tokens, targets, method=Transformer.loss)[0])(params)
    np.testing.assert_allclose(float(got), float(want), rtol=LOSS_RTOL)
    assert_trees_close(got_g, want_g, GRAD_RTOL, GRAD_ATOL)


def test_fused_cross_entropy_never_holds_the_whole_logits():
    """Compiled on one CPU device, [16, 256] rows x V 8192: 4 chunks hold a quarter of the float32
    logits the unchunked rule holds (the temporaries shrink by more than one [B, T, V] buffer)."""
    b, t, d, v = 16, 256, 64, 8192
    x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    tg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    from parallax.model.layers import ParamUse
    from parallax.model.logical import ParamPlacement
    from parallax.model.vocab import VocabPins

    use = ParamUse(ParamPlacement(), jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
    dims = (((2,), (0,)), ((), ()))
    temp = {}
    for chunk in (t, t // 4):
        f = jax.jit(jax.grad(lambda x, w, tg: fused_cross_entropy(x, w, tg, dims, use, chunk, VocabPins.here(("embed", "vocab"))),  # noqa: B023
                             argnums=(0, 1)))
        temp[chunk] = f.lower(x, w, tg).compile().memory_analysis().temp_size_in_bytes
    logits = b * t * v * 4
    assert temp[t] - temp[t // 4] > logits / 2, (temp, logits)


# ----------------------------------------------------------------------------------------------
# Sharded: the whole train step's gradients against one device

CASES = {
    "data2_tensor2_chunk4": (MeshConfig(data=2, tensor=2), ParallelConfig(loss_chunk=4)),
    "data2_tensor2_zero3_tied": (MeshConfig(data=2, tensor=2), ParallelConfig(zero=3, loss_chunk=8)),
    "1f1b_data2_tensor2_pipe2_chunk4": (MeshConfig(data=2, tensor=2, pipe=2),
                                        ParallelConfig(microbatches=2, schedule="1f1b", loss_chunk=4)),
}


def _grads(mesh: MeshConfig, parallel: ParallelConfig, tied: bool, devices) -> tuple[float, dict]:
    cfg = Config(mesh=mesh, model=dataclasses.replace(MODEL, tie_embeddings=tied), parallel=parallel,
                 train=TrainConfig(global_batch=B, seq_len=T))
    b = build(cfg, devices)
    rows = _rows(1)
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, b.batch_sharding)
    loss, grads = make_grad_fn(b.layout)(init_state(cfg, b.layout).params, batch)
    grads = jax.tree.map(np.asarray, grads)
    if b.schedule is not None:
        from parallax.parallel.pipeline import to_layer_major

        grads = {**grads, "layers": to_layer_major(grads["layers"])}
    return float(loss), grads


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_vocabulary_ends_equal_one_device(case):
    mesh, parallel = CASES[case]
    tied = "tied" in case
    want = _grads(MeshConfig(data=1), ParallelConfig(loss_chunk=0), tied, jax.devices()[:1])
    got = _grads(mesh, parallel, tied, jax.devices()[:mesh.data * mesh.tensor * mesh.pipe])
    np.testing.assert_allclose(got[0], want[0], rtol=LOSS_RTOL)
    assert_trees_close(got[1], want[1], GRAD_RTOL, GRAD_ATOL)


@pytest.mark.parametrize("field", ["loss_chunk", "attention_chunk"])
def test_chunk_that_does_not_divide_seq_len_is_one_line_exit_2(tmp_path, capsys, field):
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    assert main(["train", str(QUICKSTART), *_sets(*TINY, f"parallel.{field}=5"), "--workdir", str(wd)]) == 2
    _assert_one_error_line(capsys.readouterr().err, f"parallel.{field}=5", "must divide train.seq_len=16")
    assert _snapshot(tmp_path) == before
