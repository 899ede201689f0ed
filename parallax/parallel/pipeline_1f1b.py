"""A one-forward-one-backward pipeline schedule inside one SPMD program.

GPipe differentiates the whole tick loop with `jax.grad`, so every tick's activations stay alive
until the backward loop runs: memory grows with the microbatch count M. Here the pipeline returns
(loss, gradients) itself and the outer `jax.grad` never sees the tick loop. Each tick, stage s

  - runs the forward of microbatch i_f = t - s and keeps only its input, in a ring buffer of 2P
    slots (a microbatch is in flight on stage s for 2(P-1-s)+1 ticks);
  - on the last stage, runs the loss head on that output at once and starts its backward;
  - runs the backward of microbatch i_b = t - 2(P-1) + s: `jax.vjp` of the stage recomputed from
    the buffered input, applied to the cotangent received from stage s+1;
  - sends activations forward and cotangents backward round the ring with `ppermute`.

Live activation memory per stage is therefore about 2P stage inputs plus one stage's residuals,
instead of M + P - 1 ticks of residuals. Idle halves of a tick are skipped with `lax.cond` (a real
conditional per device), so with a backward costing twice a forward the time bubble is GPipe's,
(P-1)/(M+P-1); the price is the recomputed forward in every backward (HFU > MFU).

Limits: one chunk per stage (no circular repeats) and ZeRO 0/1 (a ZeRO-3 head would have to be
gathered inside the pipeline); config validation says so.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from parallax.parallel.mesh import PIPE
from parallax.model.transformer import Transformer
from parallax.model.logical import keep_axes, vary
from parallax.parallelism import Schedule
from parallax.parallel.pipeline import stage_fn, unit_mask
from parallax.parallel.sharding import BATCH_AXES


def make_1f1b_value_and_grad(
    model: Transformer,
    sched: Schedule,
    mesh: jax.sharding.Mesh,
    layer_specs: Any,
    batch_shards: int,
) -> Callable[[Any, dict], tuple[jax.Array, Any]]:
    """(params with stage-layout 'layers', batch) -> (mean loss, gradients like params).
    `batch_shards`: Parallelism.batch_shards, the devices the batch is split over."""
    p, m = sched.stages, sched.microbatches
    slots = 2 * p
    manual = {PIPE, *BATCH_AXES}
    with_stats = stage_fn(model)
    # (config refuses MoE and FP8 with 1F1B: no stats, no FP8 state)
    fwd_ring = [(i, (i + 1) % p) for i in range(p)]
    bwd_ring = [((i + 1) % p, i) for i in range(p)]
    param_specs = jax.tree.map(lambda s: keep_axes(s, manual), layer_specs, is_leaf=lambda a: isinstance(a, P))

    def head_loss(outer: Any, y: jax.Array, targets: jax.Array) -> jax.Array:
        return model.apply({"params": outer}, y, targets, method=Transformer.head_loss) / m  # summed over microbatches below

    def body(chunks, outer, micro_x, micro_t):
        s = jax.lax.axis_index(PIPE)
        # Everything a gradient is taken of is marked varying over the batch axes up front, so no
        # implicit reduction lands inside the loop; gradients are averaged over them once, below.
        chunk = jax.tree.map(lambda c: vary(c[0, 0], BATCH_AXES), chunks)  # [1, 1, Lc, ...] -> [Lc, ...]
        mask = unit_mask(sched, s)  # uneven stages: this stage's padding slots pass through

        def stage(chunk: Any, x: jax.Array) -> jax.Array:
            return with_stats(chunk, x, None, mask)[0]

        outer = jax.tree.map(lambda o: vary(o, (*BATCH_AXES, PIPE)), outer)
        micro_x, micro_t = vary(micro_x, (PIPE,)), vary(micro_t, (PIPE,))
        zeros_x = jnp.zeros_like(micro_x[0])

        def tick(carry, t):
            recv_f, recv_b, buf, g_chunk, g_outer, loss, dx_all = carry
            f_busy, i_f, b_busy, i_b = sched.one_f_one_b_work(t, s)
            i_f, i_b = jnp.clip(i_f, 0, m - 1), jnp.clip(i_b, 0, m - 1)
            # forward
            inp = jnp.where(s == 0, jax.lax.dynamic_index_in_dim(micro_x, i_f, keepdims=False), recv_f)
            out = jax.lax.cond(f_busy, lambda x: stage(chunk, x), jnp.zeros_like, inp)
            buf = jnp.where(f_busy, jax.lax.dynamic_update_index_in_dim(buf, inp, i_f % slots, 0), buf)
            # loss head on the last stage, straight into its backward
            targets = jax.lax.dynamic_index_in_dim(micro_t, i_f, keepdims=False)

            def head(args):
                y, tg = args
                value, (d_outer, dy) = jax.value_and_grad(head_loss, argnums=(0, 1))(outer, y, tg)
                return value, d_outer, dy

            def no_head(args):
                zero = vary(jnp.zeros((), jnp.float32), (*BATCH_AXES, PIPE))  # same type as the loss
                return zero, jax.tree.map(jnp.zeros_like, outer), jnp.zeros_like(args[0])

            value, d_outer, dy = jax.lax.cond(f_busy & (s == p - 1), head, no_head, (out, targets))
            # backward: recompute the stage from its buffered input, apply the received cotangent
            cot = jnp.where(s == p - 1, dy, recv_b)
            saved = jax.lax.dynamic_index_in_dim(buf, i_b % slots, keepdims=False)

            def backward(args):
                x, c = args
                return jax.vjp(stage, chunk, x)[1](c)

            def no_backward(args):
                return jax.tree.map(jnp.zeros_like, chunk), jnp.zeros_like(args[0])

            d_chunk, dx = jax.lax.cond(b_busy, backward, no_backward, (saved, cot))
            g_chunk = jax.tree.map(jnp.add, g_chunk, d_chunk)
            g_outer = jax.tree.map(jnp.add, g_outer, d_outer)
            done = b_busy & (s == 0)
            prev = jax.lax.dynamic_index_in_dim(dx_all, i_b, keepdims=False)
            dx_all = jax.lax.dynamic_update_index_in_dim(dx_all, jnp.where(done, dx, prev), i_b, 0)
            sent_f = jax.lax.ppermute(out, PIPE, fwd_ring)
            sent_b = jax.lax.ppermute(dx, PIPE, bwd_ring)
            return (sent_f, sent_b, buf, g_chunk, g_outer, loss + value, dx_all), None

        init = (
            zeros_x, zeros_x, jnp.zeros((slots, *zeros_x.shape), zeros_x.dtype),
            jax.tree.map(jnp.zeros_like, chunk), jax.tree.map(jnp.zeros_like, outer),
            jnp.zeros((), jnp.float32), jnp.zeros_like(micro_x),
        )
        init = jax.tree.map(lambda a: vary(a, (*BATCH_AXES, PIPE)), init)  # loop carries vary everywhere
        carry, _ = jax.lax.scan(tick, init, jnp.arange(sched.ticks))
        _, _, _, g_chunk, g_outer, loss, dx_all = carry
        # Data parallelism: every shard's loss is a mean over its own rows, so the global loss and
        # the weight gradients are means over the batch axes (one all-reduce each, after the loop).
        # dx stays per shard: it is the cotangent of this shard's own embedding rows.
        g_chunk = jax.tree.map(lambda g: jax.lax.pmean(g, BATCH_AXES)[None, None], g_chunk)
        g_outer = jax.tree.map(lambda g: jax.lax.psum(jax.lax.pmean(g, BATCH_AXES), PIPE), g_outer)
        loss = jax.lax.psum(jax.lax.pmean(loss, BATCH_AXES), PIPE)  # only the last stage summed
        dx_all = jax.lax.psum(dx_all, PIPE) / batch_shards  # only stage 0 wrote; mean over shards
        return loss, g_chunk, g_outer, dx_all

    act = P(None, BATCH_AXES)
    in_specs = (param_specs, P(), act, act)
    out_specs = (P(), param_specs, P(), act)
    piped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual)

    def value_and_grad(params: Any, batch: dict) -> tuple[jax.Array, Any]:
        outer = {k: v for k, v in params.items() if k != "layers"}
        tokens, targets = batch["inputs"], batch["targets"]
        b, t = tokens.shape
        embed = lambda o: model.apply({"params": o}, tokens, method=Transformer.embed_tokens)  # noqa: E731
        x, embed_vjp = jax.vjp(embed, outer)
        d = x.shape[-1]
        # [B, ...] -> [B/M, M, ...] -> [M, B/M, ...]: microbatch i takes rows i, i+M, ... (pipeline.py)
        micro_x = x.reshape(b // m, m, t, d).swapaxes(0, 1)
        micro_t = targets.reshape(b // m, m, t).swapaxes(0, 1)
        loss, g_layers, g_head, dx = piped(params["layers"], outer, micro_x, micro_t)
        (g_embed,) = embed_vjp(dx.swapaxes(0, 1).reshape(b, t, d))
        grads = jax.tree.map(jnp.add, g_head, g_embed)  # a tied table gets both contributions
        return loss, {**grads, "layers": g_layers}

    return value_and_grad
