"""The table schedules inside one SPMD program: 1F1B, interleaved 1F1B and ZB-H1.

GPipe differentiates the whole tick loop with `jax.grad`, so every tick's activations stay alive
until the backward loop runs: memory grows with the microbatch count M. Here the pipeline returns
(loss, gradients) itself and the outer `jax.grad` never sees the tick loop. One tick loop runs
every table schedule: each tick, stage s reads its row of the schedule's `Table`
(schedules.py: per (tick, stage) an F op, a B op, a W op or nothing, as (chunk, microbatch) and
buffer slots) and

  - sends the input gradient its last tick's B made backward (pipeline.send_along, sent here,
    behind this tick's F: nothing reads it before this tick's B) and stores what arrived (last
    tick's activation from stage s-1; the cotangent from stage s+1, before B) in the slot the
    table names: in the ZB-H1 order data may wait ticks before its op runs;
  - F: runs chunk c of microbatch i on its input and keeps that input (stage 0's chunk 0 first
    embeds the microbatch's tokens, as Megatron's first stage does) and, under the remat policies
    that keep more than a unit's input (none, dots, save_attn_mlp: parallelism.keeps_residuals),
    the residuals of the chunk's `jax.vjp` that the microbatch made (residuals.py: not the
    weights) in a slot of its own until B (W); after the last chunk on the last stage, runs the
    loss head at once and stores its cotangent;
  - B: the chunk's VJP applied to the buffered output cotangent: from F's residuals, or (remat
    full and its offload) of chunk c recomputed from the buffered input, one unit at a time, each
    unit's weight gradient added into the float32 accumulator in place (backward_by_unit). Input
    and weight gradients (1F1B, interleaved), or (ZB-H1) the input gradient and the FP8 state:
    from F's residuals B's half of the backward split by its outputs (split_backward.py), which
    also hands W a stash (its matmuls' output cotangents) kept in the residual slot until W;
    recomputing the chunk, the chunk's VJP w.r.t. its input. On stage 0's chunk 0 the input
    gradient goes straight into the embedding table's gradient (a scatter-add);
  - W (ZB-H1): the weight gradients, deferred to where the table puts it (the weight-gradient
    accumulation stays float32): from F's residuals and B's stash the split's other half (the
    weight-gradient matmuls alone), or the chunk's VJP w.r.t. its weights recomputed from the
    buffered input;
  - sends its F's output forward round the ring (pipeline.send_along; the last stage's output of
    chunk c reaches stage 0's chunk c+1), and keeps its B's input gradient for the next tick.

Live activation memory per stage is the table's buffers (1F1B at most 2P-1 stage inputs,
interleaved vP+P-1 chunk inputs, ZB-H1 P+1 inputs and P cotangents) and either as many chunks'
residuals (schedules.residual_slots: Megatron's 1F1B keeps P, the lockstep tick runs P-1 more F's
on stage 0 before its first B; ZB-H1 keeps B's stash beside them) or, under remat full, one
chunk's, instead of M + P - 1 ticks of residuals; nothing of the whole batch's [B, T, D] lives through the loop (embedding the batch
before it kept its output and its input cotangent, [M, B/M, T, D] each, on every stage). Idle ops
are skipped with `lax.cond` (a real conditional per device); ticks run in lockstep (each ends with
the forward send), so a tick lasts as long as its busiest stage (schedules.py states each table's
tick model and bubble). From F's residuals a chunk costs 3 forwards of work under remat none,
as in Megatron's 1F1B, ZB-H1's too (its B and W split one backward); under remat full B
recomputes the chunk (ZB-H1: B and W each, and W the input-gradient chain again, a unit's weight
gradients needing its output's cotangent): BUILD_NOTES.md has the compiled flops.

What the other schedules take, this one takes too:
- MoE blocks: the stage returns, beside its output, its share of the router losses (the balancing
  and z losses of its layers on this microbatch, weighted as `transformer.moe_loss` weighs them in
  the mean over layers and microbatches). That share is a scalar output of the stage, so its
  cotangent is 1 in every backward and the routers' gradients come out of the same VJP. The
  routing statistics of the forward ticks are combined over microbatches and batch shards as
  GPipe combines them (pipeline.run_pipeline).
- FP8: the stage's FP8 state enters each backward's VJP as fm32 and its "cotangent" is the new
  state (fp8.py); the ticks combine the new states by max, and a bubble tick contributes the max's
  identity (-inf), so it never writes a scale or an amax. The forward ticks only read the state: a
  backward recomputes the same forward from the same input, so the amaxes it records are the
  forward's too. The head's FP8 state (fp8.logits) is combined the same way. The stage's weights
  are quantised once per step, before the tick loop (fp8.quantize_weights_now: the VJPs then
  differentiate only the masters), and their new states join the ticks' after it. Under
  `delayed` the stage's dots keep local amaxes and the new state is pmax-ed over the batch axes
  once, after the loop; under `current` (and in the head) each dot reduces its amax over the
  batch axes at its use (`amax_axes`). Either way the state is the whole microbatch's, as on one
  device.
- ZeRO-3: each stage gathers its weights over `data` once per step, before the tick loop (as
  GPipe: the matmul weights cast to the compute dtype on their shards first, under FP8 their E4M3
  bits; pipeline.gather_stage_weights), and reduce-scatters their float32 gradient once, after it.
  The vocabulary tables enter the shard_map cast to the compute dtype on their shards
  (`pipeline_tables.carried_tables`), so their gather is in it too; the ticks read them back as
  float32 inside each use, so every gradient is still taken of (and accumulated in) float32.

Gradients are reduced once per step, after the tick loop: every device's loss is its share of
the global mean (1/(M x batch shards) of its rows' mean per microbatch), so a weight's gradient is
the sum over the batch axes it is replicated on (a reduce-scatter over `data` for a ZeRO-3 weight,
nothing over `expert` for an expert's weight, whose gradient already holds every shard's tokens
through the all-to-all's transpose; the vocabulary tables reduce-scattered over `data` and then
summed over `pipe` on those shards, which are ZeRO's update's, or without ZeRO gathered back once;
the final norm's scale summed over `pipe` and left one per batch shard for the sum outside).
Scaling the share in, rather than averaging after, keeps every cotangent inside the loop the
global loss's: FP8's gradient amaxes are one device's.

"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flax import traverse_util

from parallax.model.fp8 import FP8_COLLECTION, META_DTYPE, quantize_weights_now, scales_each_use
from parallax.model.fp8_state import padding_value
from parallax.model.transformer import Transformer, moe_stat_shapes
from parallax.model.logical import entry_axes, keep_axes, spec_axes, vary, varying_axes
from parallax.parallel.mesh import DATA, PIPE
from parallax.parallelism import Schedule
from parallax.parallel.pipeline import (gather_stage_weights, manual_over, send_along, stage_fn, stage_placement,
                                       to_layer_major, to_stages, unit_fn, unit_mask, with_batch_amaxes)
from parallax.parallel.pipeline_tables import as_masters, carried_tables, reduce_table, table_out_spec, to_update
from parallax.parallel import residuals, split_backward
from parallax.parallel.stage_slices import (add_at, add_leaves, at, at_unit, get, masters, pick, put, update_at,
                                           with_masters, zero_masters)
from parallax.parallel.sharding import BATCH_AXES

_NOTHING = -jnp.inf  # fm32's zero: the identity of the max that combines FP8 states


def _as_meta(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, META_DTYPE), tree)


def _nothing_like(tree: Any) -> Any:
    """The FP8 'no new state' of a bubble tick: -inf, typed (varying) as `tree`."""
    return jax.tree.map(lambda x: vary(jnp.full(x.shape, _NOTHING, jnp.float32), sorted(varying_axes(x))), tree)


def _reduce(g: jax.Array, spec: P, manual: set[str]) -> jax.Array:
    """The gradient of a gathered stage weight [v, Lc, ...] -> its stored shard [v, 1, Lc, ...]:
    the sum over the batch axes it is replicated on (module docstring), reduce-scattered over
    `data` under ZeRO-3; with `tensor` manual too (pipeline.manual_over: the partitioner
    gathered the float32 gradient over `tensor` first, 104 GiB per device for the dense-1T row)."""
    stored = spec_axes(keep_axes(spec, manual))
    replicated = tuple(a for a in BATCH_AXES if a not in stored)

    def reduce(g: jax.Array) -> jax.Array:
        for dim, entry in enumerate(spec):
            if DATA in entry_axes(entry) and dim >= 2:
                g = jax.lax.psum_scatter(g, DATA, scatter_dimension=dim - 1, tiled=True)
        return jax.lax.psum(g, replicated) if replicated else g

    return manual_over(reduce, stage_placement(spec, manual))(g)[:, None]


def make_scheduled_value_and_grad(
    model: Transformer,
    sched: Schedule,
    mesh: jax.sharding.Mesh,
    layer_specs: Any,
    batch_shards: int,
    outer_specs: Any = None,
    outer_update_specs: Any = None,
) -> Callable[[Any, dict, Any], tuple[tuple[jax.Array, tuple[jax.Array, dict]], tuple[Any, Any]]]:
    """(params with stage-layout 'layers', batch, FP8 state or {}) -> ((loss, (cross-entropy, MoE
    stats)), (gradients like params, new FP8 state)): train_step.make_value_and_grad's contract,
    for a table schedule (1F1B, interleaved 1F1B, ZB-H1: `sched.table()`).
    `batch_shards`: Parallelism.batch_shards, the devices the batch is split over. `outer_specs`:
    the stored PartitionSpecs of the parameters outside 'layers' (None: all replicated);
    `outer_update_specs`: theirs in the optimizer's layout (None: the update takes them whole)."""
    p, m, v = sched.stages, sched.microbatches, sched.repeats
    table_dtype = jnp.dtype(model.grad_dtype or jnp.float32)  # the vocabulary tables' gradient sum
    tab = sched.table()
    # B one unit at a time where that costs no extra work: remat `full` recomputes every unit's
    # forward in B either way (backward_by_unit); ZB-H1's split B accumulates nothing
    by_unit = not tab.split and model.remat == "full"
    # B (and W) from F's residuals (residuals.py) where the remat policy keeps more than the
    # unit inputs (parallelism.keeps_residuals): F's forward is not run again
    keep = residuals.keeps(model, sched)
    manual = {PIPE, *BATCH_AXES}
    c = model.cfg
    units = sched.units or c.n_layers
    # Each device's loss is its share of the global one: the mean over microbatches and batch
    # shards is in the weights, so every cotangent (the E5M2 gradients' amaxes too) is the global
    # loss's, as on one device, and the reductions below are plain sums.
    share = 1.0 / (m * batch_shards)
    # Router losses per chunk: transformer.moe_loss's mean over MoE layers, microbatches and shards
    moe_weights = {"aux_loss": c.moe.aux_loss_weight * share / units, "z_loss": c.moe.z_loss_weight * share / units}
    head_model = model
    if model.logits_dot_general is not None:  # the head runs inside the shard_map: global amaxes
        head_model = model.clone(logits_dot_general=with_batch_amaxes(model.logits_dot_general))
    # A ring where chunk c's last stage feeds chunk c+1's first (v > 1); with one chunk a chain:
    # the last stage's output goes to the head and stage 0's input cotangent to the embedding, so
    # the closing pair would send nothing anyone reads, and XLA:GPU, which decomposes a ring into
    # two sends (distributed.GPU_FLAGS), issued that pair after the B pass (exposed).
    ring = range(p) if v > 1 else range(p - 1)
    fwd_ring = [(i, (i + 1) % p) for i in ring]
    bwd_ring = [((i + 1) % p, i) for i in ring]
    param_specs = jax.tree.map(lambda s: keep_axes(s, manual), layer_specs, is_leaf=lambda a: isinstance(a, P))
    # per weight, the manual axes it is stored sharded over (its FP8 amax is pmax-ed over them)
    sharded_over = jax.tree.map(lambda s: tuple(a for e in s for a in entry_axes(e) if a != PIPE), param_specs,
                                is_leaf=lambda a: isinstance(a, P))
    stat_shapes = moe_stat_shapes(c, layers_per_chunk=sched.chunk_units)
    update_specs_like = lambda tree: outer_update_specs or jax.tree.map(lambda _: None, tree)  # noqa: E731

    def head_loss(outer: Any, head_fp8: Any, y: jax.Array, targets: jax.Array, loss_mask: Any,
                  weight: jax.Array) -> jax.Array:
        # float32 in, fm32 inside (fp8.fp8_variables): `grad` takes no fm32 argument
        variables = {"params": outer, **({FP8_COLLECTION: _as_meta(head_fp8)} if head_fp8 else {})}
        return head_model.apply(variables, y, targets, loss_mask, method=Transformer.head_loss) * weight  # summed below

    def embed(outer: Any, tokens: jax.Array) -> jax.Array:
        # [b, T] -> [b, T, D] in the compute dtype: one microbatch's embedding on stage 0
        return model.apply({"params": as_masters(outer)}, tokens, method=Transformer.embed_tokens)

    def body(chunks, outer, micro_tok, micro_t, fp8_chunks, head_fp8, micro_docs, kept_total):
        s = jax.lax.axis_index(PIPE)
        # Everything a gradient is taken of is marked varying over the batch axes up front, so no
        # implicit reduction lands inside the loop; gradients are reduced over them once, below.
        shards = jax.tree.map(lambda w: w[:, 0], chunks)  # [v, 1, Lc, ...] -> [v, Lc, ...]
        fp8_all = jax.tree.map(lambda f: f[:, 0], fp8_chunks) or None
        # FP8 `delayed`: the dots keep local amaxes and the stage's new state is combined over the
        # batch axes once per step, after the tick loop (as fp8.combined_over does for GPipe);
        # `current` scales each use by its own amax, pmax-ed over the batch axes at the use.
        combined = fp8_all is not None and not scales_each_use(model.dot_general)
        with_stats = stage_fn(model, combined)
        # FP8: each weight quantised here, once per step, on its stored shard (ZeRO-3 gathers the
        # bits), not in every tick's F, B and W; its new state joins the ticks' after the loop
        shards, weight_state = quantize_weights_now(shards, fp8_all, model.dot_general, c.dtype, sharded_over, lead=2)
        weights = jax.tree.map(lambda a: vary(a, BATCH_AXES),
                               gather_stage_weights(model, shards, layer_specs, manual))  # [v, Lc, ...]
        if combined:  # local amaxes in the ticks: no pmax per tick
            fp8_all = jax.tree.map(lambda f: vary(f, BATCH_AXES), fp8_all)
        head_fp8 = jax.tree.map(lambda f: vary(f, (PIPE,)), head_fp8)

        def router_loss(stats: dict) -> jax.Array:
            router = sum(wt * jnp.sum(stats[k]) for k, wt in moe_weights.items() if k in stats)
            return vary(jnp.asarray(router, jnp.float32), (*BATCH_AXES, PIPE))

        def stage(w: Any, fp8: Any, x: jax.Array, docs: Any, chunk: jax.Array,
                  stacked: bool = False) -> tuple[tuple[jax.Array, jax.Array], dict]:
            # `stacked`: w and fp8 are the stage's [v, Lc, ...] stacks, each unit slicing its own
            # weights of chunk `chunk` (pipeline.stage_fn's `rep`), not the chunk sliced whole first
            mask = unit_mask(sched, s, chunk)  # uneven stages: this chunk's padding slots pass through
            y, stats = with_stats(w, x, _as_meta(fp8), mask, rep=chunk if stacked else None,
                                  docs=docs)  # fm32 inside, as fp8_variables
            return (y, router_loss(stats)), stats

        def chunk_vjp(w: Any, f: Any, x: jax.Array, docs: Any, chunk: jax.Array) -> tuple[Any, Any, dict]:
            """((y, router loss), VJP function, stats) of chunk `chunk` (weights w [Lc, ...]) on x:
            the VJP w.r.t. (w's masters, FP8 state, x) that B applies."""
            return jax.vjp(lambda m, f, h: stage(with_masters(w, m), f, h, docs, chunk), masters(w), f, x,
                           has_aux=True)

        def kept_vjp(chunk: jax.Array, x: jax.Array, docs: Any, bufs: list, slot: jax.Array) -> Callable:
            """The VJP function of chunk `chunk` on x, its residuals F's from slot `slot` of `bufs`:
            the forward traced here again is dead code but what the weights alone give."""
            leaves, tree = kept_leaves(chunk, x, docs, [get(buf, slot) for buf in bufs])
            return jax.tree.unflatten(tree, leaves)

        def kept_leaves(chunk: jax.Array, x: jax.Array, docs: Any, kept: list) -> tuple[list, Any]:
            """kept_vjp's (residual leaves, tree), the kept ones given (sliced by the caller inside
            its conditional's branch: a conditional's operand is a copy)."""
            _, vjp, _ = chunk_vjp(at(weights, chunk, v), at(fp8_all, chunk, v), x, docs, chunk)
            leaves, tree = jax.tree.flatten(vjp)
            res.made(leaves)  # (traced as plan's)
            for i, a in zip(res.kept, kept):
                leaves[i] = a
            return leaves, tree

        def split_vjp(chunk: jax.Array, x: jax.Array, docs: Any, kept: list, ct: jax.Array
                      ) -> tuple[split_backward.Split, tuple]:
            """ZB-H1's backward from F's residuals split in two (split_backward.py): B the FP8
            state's and the input's cotangents, W the weights' gradients, B's values W needs
            handed over in a stash. -> (the split, its arguments)."""
            leaves, tree = kept_leaves(chunk, x, docs, kept)
            args = (leaves, (ct, ones()))
            apply = lambda ls, cts: jax.tree.unflatten(tree, ls)(cts)  # noqa: E731  (d_w, d_fp8, dx)
            to_w = lambda out: (jax.tree.map(lambda _: True, out[0]), jax.tree.map(lambda _: False, out[1:]))  # noqa: E731
            return split_backward.Split.of(apply, args, to_w), args

        unit = unit_fn(model, combined)

        def backward_by_unit(busy, chunk, x, ct, docs, g_w, new_fp8):
            """B under remat `full`, one unit at a time: each unit's input recomputed, then, last
            unit first, its VJP (recomputing its forward, as the stage's VJP does: the same work)
            and its weight gradient added into the float32 accumulator in place. The stage's VJP
            at once returned the whole stage's gradient as one more buffer of the stage's weights'
            size, float32, beside the accumulator (BUILD_NOTES.md "Pipelined ZeRO-3 in the compute
            dtype"). -> (g_w, new_fp8, the stage input's cotangent)."""
            f_c, mask = at(fp8_all, chunk, v), unit_mask(sched, s, chunk)
            n = jax.tree.leaves(weights)[0].shape[1]
            unit_of = lambda tree, l: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, l, keepdims=False), tree)  # noqa: E731

            def inputs(x):  # [n, b, T, D]: each unit's input. The last unit's output is no unit's
                # input: the loop runs n - 1 units (over all n it ran a whole unit's forward more
                # per B, which XLA cannot drop from a loop trip: compiled for h100-8, 2026-12-07)
                step = lambda h, xs: (  # noqa: E731
                    unit(at_unit(weights, chunk, xs[0], v), _as_meta(xs[1]), xs[2], docs, h)[0], h)
                head = jax.tree.map(lambda a: a[:n - 1], (jnp.arange(n), f_c, mask))
                last, before = jax.lax.scan(step, x, head)
                return jnp.concatenate([before, last[None]])

            hs = jax.lax.cond(busy, inputs, lambda x: varying(jnp.zeros((n, *x.shape), x.dtype)), x)

            def one(carry, l):
                dh, g, nf = carry
                w_l, f_l, real = at_unit(weights, chunk, l, v), unit_of(f_c, l), None if mask is None else mask[l]

                def vjp_unit(args):
                    h, dh = args
                    run = lambda w, f, h: (lambda y, st: (y, router_loss(st)))(  # noqa: E731
                        *unit(with_masters(w_l, w), _as_meta(f), real, docs, h))
                    _, vjp = jax.vjp(run, masters(w_l), f_l, h)
                    return vjp((dh, ones()))

                def idle(args):
                    return jax.tree.map(jnp.zeros_like, masters(w_l)), _nothing_like(f_l), jnp.zeros_like(args[1])

                d_w, d_f, dh = jax.lax.cond(busy, vjp_unit, idle, (get(hs, l), dh))
                return (dh, update_at(g, chunk, l, d_w), update_at(nf, chunk, l, d_f, jnp.maximum)), None

            (dx, g_w, new_fp8), _ = jax.lax.scan(one, (ct, g_w, new_fp8), jnp.arange(n), reverse=True)
            return g_w, new_fp8, dx

        outer = jax.tree.map(lambda o: vary(o, (*BATCH_AXES, PIPE)), outer)
        micro_tok, micro_t = vary(micro_tok, (PIPE,)), vary(micro_t, (PIPE,))
        x_type = jax.eval_shape(embed, outer, micro_tok[0])  # [b, T, D], the compute dtype
        zeros_x = jnp.zeros(x_type.shape, x_type.dtype)
        varying = lambda a: vary(a, (*BATCH_AXES, PIPE))  # noqa: E731
        ones = lambda: varying(jnp.ones((), jnp.float32))  # noqa: E731  (the router losses' cotangent)

        def docs_of(i):  # packed documents of microbatch i: (segment ids, positions) [b, T], loss mask
            if not micro_docs:
                return None, None
            seg, pos, lm = (jax.lax.dynamic_index_in_dim(micro_docs[k], i, keepdims=False)
                            for k in ("segment_ids", "positions", "loss_mask"))
            return (seg, pos), lm

        res = None  # which of a chunk VJP's residuals its microbatch's input made: kept from F to B
        if keep:
            # traced as F and B trace it: the weights, FP8 state, documents and chunk index closed
            # over (B has them: the documents are its microbatch's), the input the argument
            chunk0 = jax.lax.axis_index(PIPE) * 0  # traced, as the table's are
            docs0 = docs_of(chunk0)[0]
            res = residuals.plan(lambda x: jax.tree.leaves(chunk_vjp(at(weights, chunk0, v), at(fp8_all, chunk0, v), x,
                                                                     docs0, chunk0)[1]),
                                 (varying(zeros_x),), per_microbatch=(0,), varying=PIPE)
            # Untyped residuals (residuals.plan's `untyped`: a fused attention kernel's under remat
            # none, which keeps_residuals already refuses; a kernel the rule does not know, in a
            # model made by hand) B would compute again from the stage input: the chain of units
            # before each, about the whole forward (compiled for h100-8 with SP: 40% more tensor
            # bytes). Then B recomputes the chunk, as under remat full, from its input alone.
            if res.untyped:
                res = None
        stash = None  # ZB-H1's B-to-W stash per leaf: (shape, dtype, varying axes), kept per residual slot
        if res is not None and tab.split:
            # traced once here for its layout (dead code: nothing reads it), as B and W trace it
            split, args = split_vjp(chunk0, varying(zeros_x), docs0, res.zeros(), varying(zeros_x))
            stash = [(a.shape, a.dtype, sorted(varying_axes(a))) for a in split.b(args)[1]]
            # per weight-gradient leaf, whether W computes it (B: a norm scale's, from cheap
            # equations alone: split_backward.Split.of)
            w_leaves = split.to_w[:len(jax.tree.leaves(masters(weights)))]
        stash_zeros = lambda: [vary(jnp.zeros(shape, dtype), axes) for shape, dtype, axes in stash]  # noqa: E731

        def tick(carry, row):
            recv_f, unsent_b, act, cot, g_w, g_outer, new_fp8, new_head_fp8, ce, router, acc, kept, stashed = carry
            op = {k: a[s] for k, a in row.items()}  # this stage's row of the table
            # The previous tick's input cotangent is sent now, not at that tick's end: nothing
            # reads it before this tick's B, so F runs while it travels (at the tick's end only
            # the embedding's gradient followed it: the send was exposed on XLA:GPU)
            recv_b = send_along(unsent_b, bwd_ring)
            # what arrived goes to its slot (or the trash slot): in the interleaved and ZB-H1
            # orders it may be consumed ticks later
            act = put(act, recv_f, op["recv_f"])
            # F: chunk c_f on microbatch i_f (it reads the FP8 state; the B's recomputation records it)
            f_busy, c_f, i_f = op["f_busy"] == 1, op["f_chunk"], op["f_mb"]
            docs_f, mask_f = docs_of(i_f)
            # stage 0's first chunk embeds its microbatch here, one at a time (Megatron's first
            # stage): no [M, B/M, T, D] embedding output or input cotangent lives through the loop
            first_f = f_busy & (s == 0) & (c_f == 0)
            tokens_f = jax.lax.dynamic_index_in_dim(micro_tok, i_f, keepdims=False)
            inp = jax.lax.cond(first_f, lambda a: varying(embed(outer, a[0])), lambda a: a[1],
                               (tokens_f, get(act, op["f_act"])))
            act = put(act, inp, op["f_act"])  # kept for the B (and W): recomputed from, or a residual

            def forward(x):
                if res is not None:  # F keeps what its microbatch made of the VJP's residuals for its B
                    (y, r), vjp, stats = chunk_vjp(at(weights, c_f, v), at(fp8_all, c_f, v), x, docs_f, c_f)
                    made = res.made(jax.tree.leaves(vjp))
                else:
                    # several chunks: each unit slices its own weights (a chunk's dynamic slice
                    # was a copy of its weights: at_unit)
                    (y, r), stats = (stage(weights, fp8_all, x, docs_f, c_f, stacked=True) if v > 1 else
                                     stage(at(weights, c_f, v), at(fp8_all, c_f, v), x, docs_f, c_f))
                    made = []
                return y, r, {k: stats[k].astype(jnp.float32) for k in stat_shapes}, made

            def no_forward(x):
                return (jnp.zeros_like(x), varying(jnp.zeros((), jnp.float32)),
                        {k: varying(jnp.zeros(shape, jnp.float32)) for k, shape in stat_shapes.items()},
                        res.zeros() if res is not None else [])

            out, r_value, stats, made = jax.lax.cond(f_busy, forward, no_forward, inp)
            kept = [put(buf, a, op["f_res"]) for buf, a in zip(kept, made)]  # an idle F's: a free slot
            acc = add_at(acc, c_f, stats, v)
            # the loss head after the last chunk on the last stage, straight into its cotangent
            targets = jax.lax.dynamic_index_in_dim(micro_t, i_f, keepdims=False)

            def head(args):
                y, tg = args
                # packed: this shard's microbatch mean over its kept tokens, weighted by their share
                # of the whole batch's kept tokens: the sum over shards and microbatches is the
                # mean over every kept token (unpacked: 1/(M x shards) each)
                weight = share if mask_f is None else jnp.sum(mask_f != 0).astype(jnp.float32) / kept_total
                value, (d_outer, d_fp8, dy) = jax.value_and_grad(head_loss, argnums=(0, 1, 2))(
                    as_masters(outer), head_fp8, y, tg, mask_f, weight)
                return value, d_outer, d_fp8, dy

            def no_head(args):
                return (varying(jnp.zeros((), jnp.float32)), zero_masters(outer),
                        _nothing_like(head_fp8), jnp.zeros_like(args[0]))

            is_head = f_busy & (s == p - 1) & (c_f == v - 1)
            value, d_outer, d_head_fp8, dy = jax.lax.cond(is_head, head, no_head, (out, targets))
            cot = put(cot, dy, op["f_cot"])  # the trash slot unless this was the head
            cot = put(cot, recv_b, op["recv_b"])
            # B: recompute chunk c_b from its buffered input, apply the buffered output cotangent.
            # Split (ZB-H1): the input gradient only (and the FP8 state); the weights' is W's.
            b_busy, c_b, i_b = op["b_busy"] == 1, op["b_chunk"], op["b_mb"]
            docs_b, _ = docs_of(i_b)

            def backward(args):
                x, ct, bufs = args
                w_b, f_b = at(weights, c_b, v), at(fp8_all, c_b, v)
                if stash is not None:  # B's half of the split backward, its stash for the W
                    split, split_args = split_vjp(c_b, x, docs_b, [get(buf, op["b_res"]) for buf in bufs], ct)
                    outs, handed = split.b(split_args)
                    d_w, d_fp8, dx = split.outputs(outs, [0] * len(outs))  # (0: W's, a placeholder)
                    return d_fp8, dx, handed, pick(d_w, w_leaves, False)
                if res is not None:
                    return kept_vjp(c_b, x, docs_b, bufs, op["b_res"])((ct, ones()))
                if tab.split:
                    _, vjp = jax.vjp(lambda f, h: stage(w_b, f, h, docs_b, c_b)[0], f_b, x)
                    d_fp8, dx = vjp((ct, ones()))
                    return jax.tree.map(jnp.zeros_like, masters(w_b)), d_fp8, dx
                _, vjp = jax.vjp(lambda w, f, h: stage(with_masters(w_b, w), f, h, docs_b, c_b)[0], masters(w_b),
                                 f_b, x)
                return vjp((ct, ones()))

            def no_backward(args):
                if stash is not None:
                    return (_nothing_like(at(fp8_all, 0, v)), jnp.zeros_like(args[0]), stash_zeros(),
                            pick(jax.tree.map(jnp.zeros_like, at(masters(weights), 0, v)), w_leaves, False))
                return (jax.tree.map(jnp.zeros_like, at(masters(weights), 0, v)), _nothing_like(at(fp8_all, 0, v)),
                        jnp.zeros_like(args[0]))

            if stash is not None:
                d_fp8, dx, handed, d_w = jax.lax.cond(b_busy, backward, no_backward,
                                                      (get(act, op["b_act"]), get(cot, op["b_cot"]), kept))
                g_w = add_leaves(g_w, c_b, d_w, w_leaves, False, v)
                # into the residual slot's stash (the slot is its F's until W: B to W lies inside
                # F to W); an idle B's into the trash slot
                slot = jnp.where(b_busy, op["b_res"], tab.res_slots)
                stashed = [put(buf, a, slot) for buf, a in zip(stashed, handed)]
                new_fp8 = add_at(new_fp8, c_b, d_fp8, v, jnp.maximum)
            elif by_unit:
                g_w, new_fp8, dx = backward_by_unit(b_busy, c_b, get(act, op["b_act"]), get(cot, op["b_cot"]),
                                                    docs_b, g_w, new_fp8)
            else:
                d_w, d_fp8, dx = jax.lax.cond(b_busy, backward, no_backward,
                                              (get(act, op["b_act"]), get(cot, op["b_cot"]),
                                               kept))
                if not tab.split:  # weight gradients accumulate in float32 whatever the compute dtype
                    g_w = add_at(g_w, c_b, d_w, v)
                new_fp8 = add_at(new_fp8, c_b, d_fp8, v, jnp.maximum)
            # stage 0's first chunk: dx is its embedding's output cotangent; the table's gradient
            # (a scatter-add) is added where it is computed, so idle ticks add nothing
            tokens_b = jax.lax.dynamic_index_in_dim(micro_tok, i_b, keepdims=False)

            def embed_grad(args):
                g, tokens, ct = args
                _, vjp = jax.vjp(lambda e: embed({**outer, "embed": e}, tokens), as_masters(outer["embed"]))
                return jax.tree.map(jnp.add, g, vjp(ct)[0])

            g_outer = {**g_outer, "embed": jax.lax.cond(b_busy & (s == 0) & (c_b == 0), embed_grad, lambda a: a[0],
                                                        (g_outer["embed"], tokens_b, dx))}
            if tab.split:  # W: the weight gradient, recomputed from the same input and cotangent
                w_busy, c_w, i_w = op["w_busy"] == 1, op["w_chunk"], op["w_mb"]
                docs_w, _ = docs_of(i_w)

                def weight_grad(args):
                    x, ct, bufs, handed = args
                    if stash is not None:  # W's half of the split backward: F's residuals and B's stash
                        split, split_args = split_vjp(c_w, x, docs_w, [get(buf, op["w_res"]) for buf in bufs], ct)
                        outs = split.w(split_args, [get(buf, op["w_res"]) for buf in handed])
                        return pick(split.outputs([0] * len(outs), outs)[0], w_leaves, True)
                    f_w, w_w = at(fp8_all, c_w, v), at(weights, c_w, v)
                    _, vjp = jax.vjp(lambda w: stage(with_masters(w_w, w), f_w, x, docs_w, c_w)[0], masters(w_w))
                    return vjp((ct, ones()))[0]

                def no_weight_grad(args):
                    zeros = jax.tree.map(jnp.zeros_like, at(masters(weights), 0, v))
                    return zeros if stash is None else pick(zeros, w_leaves, True)

                d_w = jax.lax.cond(w_busy, weight_grad, no_weight_grad,
                                   (get(act, op["w_act"]), get(cot, op["w_cot"]), kept, stashed))
                g_w = add_at(g_w, c_w, d_w, v) if stash is None else add_leaves(g_w, c_w, d_w, w_leaves, True, v)
            g_outer = jax.tree.map(jnp.add, g_outer, d_outer)
            new_head_fp8 = jax.tree.map(jnp.maximum, new_head_fp8, d_head_fp8)
            sent_f = send_along(out, fwd_ring)
            return (sent_f, dx, act, cot, g_w, g_outer, new_fp8, new_head_fp8, ce + value, router + r_value,
                    acc, kept, stashed), None

        init = (
            zeros_x, zeros_x,
            jnp.zeros((tab.act_slots + 1, *zeros_x.shape), zeros_x.dtype),  # + the trash slot
            jnp.zeros((tab.cot_slots + 1, *zeros_x.shape), zeros_x.dtype),
            jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), masters(weights)), zero_masters(outer),
            None, None, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
            {k: jnp.zeros((v, *shape), jnp.float32) for k, shape in stat_shapes.items()},
        )
        init = jax.tree.map(varying, init)  # loop carries vary everywhere
        # ... but the FP8 states vary as the state itself does: over `pipe` only (fp8.quantize's pmax)
        init = (*init[:6], _nothing_like(fp8_all), _nothing_like(head_fp8), *init[8:])
        # ... and the kept residuals as each residual does, `pipe` always (residuals.plan keeps no
        # other): a residual of an FP8 state's custom VJP typed as varying over the batch axes made
        # its state's cotangent vary over them
        init = (*init, [vary(jnp.zeros((tab.res_slots, *a.shape), a.dtype), sorted(varying_axes(a))) for a in res.zeros()]
                if res is not None else [])
        # ... and ZB-H1's stash per residual slot (+ the trash slot of an idle B) as each value does
        init = (*init, [vary(jnp.zeros((tab.res_slots + 1, *shape), dtype), axes) for shape, dtype, axes in stash]
                if stash is not None else [])
        rows = {k: jnp.asarray(a) for k, a in tab.arrays.items()}  # [ticks, P] each
        carry, _ = jax.lax.scan(tick, init, rows)
        _, _, _, _, g_w, g_outer, new_fp8, new_head_fp8, ce, router, acc, _, _ = carry
        g_w = jax.tree.map(lambda g, spec: _reduce(g, spec, manual), g_w, layer_specs,
                           is_leaf=lambda a: isinstance(a, P))
        # (over the batch axes, then over `pipe`: one reduction over both would be one all-reduce
        # over every device, not the two small groups the cost model counts)
        total = lambda x: jax.lax.psum(jax.lax.psum(x, BATCH_AXES), PIPE)  # noqa: E731
        # The embedding, head and final-norm gradients (only stage 0's embedding and the last
        # stage's head are non-zero): pipeline_tables.reduce_table. The tables in
        # parallel.grad_reduce_dtype, as every matmul weight's gradient; the final norm's scale in
        # float32. The barrier keeps the sums over pipe apart from the batch axes' sum outside:
        # XLA:GPU folds consecutive all-reduces into one over data x pipe, which leaves every
        # device the whole table.
        # (One barrier per table: one over all of them typed each as varying over every axis any
        # of them varies over, the final norm's batch axes too.)
        g_outer = jax.tree.map(
            lambda g, spec: jax.lax.optimization_barrier(reduce_table(
                g.astype(table_dtype if g.ndim > 1 else jnp.float32), spec, manual, mesh.shape[DATA])),
            g_outer, update_specs_like(g_outer))
        ce = total(ce)  # only the last stage summed
        router = total(router)
        # Per-token means average over microbatches and the (equal) batch shards; counts add.
        acc = {k: (jax.lax.psum(x, BATCH_AXES) if k == "load" else jax.lax.pmean(x / m, BATCH_AXES))[:, None]
               for k, x in acc.items()}  # [v, Lc, ...] -> [v, 1 (this stage), Lc, ...]
        if fp8_all is not None:
            if combined:  # the uses' local states, combined over the batch axes once per step
                new_fp8 = jax.tree.map(lambda f: jax.lax.pmax(f, BATCH_AXES), new_fp8)
            # the weights' states, from their one quantisation (the ticks recorded none of them)
            flat = traverse_util.flatten_dict(new_fp8)
            new_fp8 = traverse_util.unflatten_dict({k: jnp.maximum(f, weight_state[k]) if k in weight_state else f
                                                    for k, f in flat.items()})
        new_fp8 = jax.tree.map(lambda f: f[:, None], new_fp8)
        new_head_fp8 = jax.tree.map(lambda f: jax.lax.pmax(f, PIPE), new_head_fp8)  # only the last stage's
        return ce, router, acc, g_w, g_outer, new_fp8, new_head_fp8

    act = P(None, BATCH_AXES)
    stacked = P(None, PIPE)
    in_specs = (param_specs, P(), act, act, stacked, P(), act, P())
    def value_and_grad(params: Any, batch: dict, fp8: Any = None):
        outer = {k: v for k, v in params.items() if k != "layers"}
        # the tables' gradients: 1/data shards (reduce_table); the final norm's scale one per batch shard
        tables = jax.tree.map(functools.partial(table_out_spec, data=mesh.shape[DATA]), update_specs_like(outer), outer,
                              is_leaf=lambda a: a is None or isinstance(a, P))
        piped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), P(), stacked, param_specs, tables,
                                                                              stacked, P()), axis_names=manual)
        fp8 = fp8 or {}
        stack_fp8 = to_stages(fp8["layers"], sched, fill=padding_value) if "layers" in fp8 else {}
        head_fp8 = {k: v for k, v in fp8.items() if k != "layers"}
        tokens, targets = batch["inputs"], batch["targets"]
        b, t = tokens.shape
        # [B, ...] -> [B/M, M, ...] -> [M, B/M, ...]: microbatch i takes rows i, i+M, ... (pipeline.py)
        micro_tok = tokens.reshape(b // m, m, t).swapaxes(0, 1)
        micro_t = targets.reshape(b // m, m, t).swapaxes(0, 1)
        # packed documents (data.DOC_KEYS: Transformer.loss's keywords), cut into microbatches as the targets are
        micro_docs = {k: v.reshape(b // m, m, t).swapaxes(0, 1) for k, v in batch.items() if k not in ("inputs", "targets")}
        kept_total = (jnp.maximum(jnp.sum(batch["loss_mask"] != 0), 1).astype(jnp.float32) if micro_docs
                      else jnp.ones((), jnp.float32))
        ce, router, stats, g_layers, g_outer, new_stack_fp8, new_head_fp8 = piped(
            params["layers"], carried_tables(model, outer, outer_specs, manual), micro_tok, micro_t, stack_fp8,
            head_fp8, micro_docs, kept_total)
        g_outer = jax.tree.map(functools.partial(to_update, mesh=mesh), g_outer, tables, update_specs_like(g_outer),
                               is_leaf=lambda a: a is None or isinstance(a, P))
        stats = {k: x.reshape(-1, *x.shape[3:])[:sched.units or None] for k, x in stats.items()}  # layer-major
        new_fp8 = dict(new_head_fp8)
        if "layers" in fp8:
            new_fp8["layers"] = to_layer_major(new_stack_fp8, sched.units)
        return (ce + router, (ce, stats)), ({**g_outer, "layers": g_layers}, new_fp8)

    return value_and_grad

