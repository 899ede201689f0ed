"""parallel.attention_chunk: XLA's causal attention in blocks of query positions under a checkpoint
(model/attention.py) equals the whole-sequence attention, outputs and gradients, grouped-query
heads included, on one device and inside a sharded, pipelined step.

float32; the blocks change only which rows of the score matrix are computed together, so the
tolerances are the layout-equivalence ones: outputs and loss rtol 1e-6, gradients within 1e-5 of
each leaf's largest magnitude + 1e-7 (seen: 3e-6 absolute on O(1) values, one device).
"""

import jax
import numpy as np
import pytest

from parallax.config import MeshConfig, ParallelConfig
from parallax.model.attention import causal_attention
from numerics import assert_trees_close
from test_vocab import GRAD_ATOL, GRAD_RTOL, LOSS_RTOL, _grads


@pytest.mark.parametrize("chunk", [4, 16])
def test_query_blocks_equal_whole_sequence_attention(chunk):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 32, 4, 8))  # N 4 query heads over K 2 kv heads
    k, v = (jax.random.normal(kk, (2, 32, 2, 8)) for kk in keys[1:3])
    cot = jax.random.normal(keys[3], q.shape)
    want, want_vjp = jax.vjp(lambda *a: causal_attention(*a, 0), q, k, v)
    got, got_vjp = jax.vjp(lambda *a: causal_attention(*a, chunk), q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=LOSS_RTOL, atol=1e-6)
    assert_trees_close(got_vjp(cot), want_vjp(cot), GRAD_RTOL, GRAD_ATOL)


def test_query_blocks_in_a_pipelined_sharded_step_equal_one_device():
    """GPipe on data 2 x tensor 2 x pipe 2, remat full (a checkpoint inside the block's), heads
    over tensor, against one device with whole-sequence attention."""
    want = _grads(MeshConfig(data=1), ParallelConfig(loss_chunk=0), False, jax.devices()[:1])
    parallel = ParallelConfig(microbatches=2, remat="full", attention_chunk=4)
    got = _grads(MeshConfig(data=2, tensor=2, pipe=2), parallel, False, jax.devices())
    np.testing.assert_allclose(got[0], want[0], rtol=LOSS_RTOL)
    assert_trees_close(got[1], want[1], GRAD_RTOL, GRAD_ATOL)
