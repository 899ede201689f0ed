"""The loss and the jitted, pure train and eval steps with explicit in/out shardings.

GSPMD inserts every data- and tensor-parallel collective from the shardings: the batch is split
over ('data', 'expert'), the gradient reduction over those axes comes out of the partitioner, and
under ZeRO the optimizer update runs on the data-sharded state (reduce-scatter in, all-gather out).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import Config, logs_at
from parallax.model.transformer import moe_loss
from parallax.model.fp8 import FP8_COLLECTION, fp8_variables
from parallax.model.fp8_state import fp8_metrics, overwrite, request_telemetry, step_state
from parallax.train.optim import applied_count, make_lr_schedule
from parallax.parallelism import reduces_once
from parallax.parallel.sharding import BATCH_AXES, logical_context
from parallax.train.train_state import Layout, TrainState

Batch = dict[str, jax.Array]  # 'inputs', 'targets' (packed documents: and data.DOC_KEYS): [B, T] int32


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


Aux = tuple[jax.Array, dict]  # (cross-entropy, MoE stats per layer)


def make_loss_fn(layout: Layout) -> Callable[[Any, Batch, Any], tuple[jax.Array, Aux]]:
    """(params, batch, fp8) -> (training loss, (cross-entropy, MoE stats)); the training loss is
    the cross-entropy plus the MoE routers' losses (transformer.moe_loss)."""

    def loss_fn(params: Any, batch: Batch, fp8: Any = None) -> tuple[jax.Array, Aux]:
        with logical_context(layout.mesh, layout.rules):
            # FP8 state enters as fm32 here, before any loop over layers, ticks or microbatches (fp8.py)
            docs = {k: v for k, v in batch.items() if k not in ("inputs", "targets")}  # packed: data.DOC_KEYS
            ce, stats = layout.apply(params, batch["inputs"], batch["targets"], fp8_variables(fp8).get(FP8_COLLECTION),
                                     **docs)
        return ce + moe_loss(stats, layout.model.cfg), (ce, stats)

    return loss_fn


def make_value_and_grad(layout: Layout) -> Callable[[Any, Batch, Any], tuple[tuple[jax.Array, Aux], tuple[Any, Any]]]:
    """(params, batch, fp8) -> ((loss, (cross-entropy, MoE stats)), (grads, new fp8 state)).

    A 1F1B pipeline computes its own gradients (pipeline_1f1b.py); everything else is
    differentiated here. The FP8 state's "gradient" is its new value (fp8.py).
    """
    if layout.value_and_grad is not None:

        def own(params: Any, batch: Batch, fp8: Any) -> tuple[tuple[jax.Array, Aux], tuple[Any, Any]]:
            with logical_context(layout.mesh, layout.rules):
                return layout.value_and_grad(params, batch, fp8)

        return own
    return jax.value_and_grad(make_loss_fn(layout), argnums=(0, 2), has_aux=True)


def moe_metrics(stats: dict, every: int) -> dict[str, jax.Array]:
    """Per MoE layer `moe_<name>_layer<block index>`, and over layers `moe_<name>` (the mean; the
    worst layer for the load imbalance, max/mean tokens per expert)."""
    if not stats:
        return {}
    stats = dict(stats)
    load = stats.pop("load")  # [L_moe, E] assignments per expert
    stats["load_max_over_mean"] = jnp.max(load, axis=-1) / jnp.mean(load, axis=-1)
    out = {}
    for name, per_layer in stats.items():
        out[f"moe_{name}"] = jnp.max(per_layer) if name == "load_max_over_mean" else jnp.mean(per_layer)
        for i in range(per_layer.shape[0]):
            out[f"moe_{name}_layer{(i + 1) * every - 1}"] = per_layer[i]
    return out


# Logical names of the batch dimension: inside the per-shard vmap the shard axis carries the
# batch axes, so the rows within one shard must not name them again.
_BATCH_NAMES = ("batch", "activation_batch", "activation_batch_no_expert")


def make_sharded_value_and_grad(layout: Layout, shards: int) -> Callable[..., tuple[tuple[jax.Array, Aux], tuple[Any, Any], dict]]:
    """`make_value_and_grad`, plus the two squared gradient norms the noise scale needs
    (train.noise_scale): the same (params, batch, fp8) -> ((loss, (ce, stats)), (grads, fp8), norms).

    The batch [B, T] is viewed as [n, B/n, T], n = `shards` = data x expert, and the loss's
    gradient is vmapped over the shards with dim 0 on the batch axes: each device differentiates
    its own B/n sequences, the work data parallelism does anyway, and no extra forward/backward
    runs. The update uses G, the mean of the shard gradients (= the full-batch gradient: every
    loss term is a mean over equal-sized shards' sequences or tokens); the mean over dim 0 is the
    usual gradient all-reduce, after the backward pass instead of inside its layer loop.
    norms: `grad_sq_small` = mean over shards of |g_shard|^2 (batch B/n), `grad_sq_big` = |G|^2
    (batch B); their per-device partial sums over tensor-sharded parameters reduce as scalars.
    Dense and MoE layers without the expert all-to-all only, no FP8 state (parallelism.RULES).
    """
    per_shard, split = _per_shard(layout, shards, make_loss_fn)

    def value_and_grad(params: Any, batch: Batch, fp8: Any) -> tuple[tuple[jax.Array, Aux], tuple[Any, Any], dict]:
        (losses, (ces, stats)), shard_grads = per_shard(params, split(batch), fp8)
        sq = [jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim))) for g in jax.tree.leaves(shard_grads)]
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), shard_grads)
        norms = {"grad_sq_small": jnp.mean(sum(sq)), "grad_sq_big": optax.tree.norm(grads, squared=True)}
        return (jnp.mean(losses), (jnp.mean(ces), _shards_stats(stats))), (grads, fp8), norms

    return value_and_grad


def _shards_stats(stats: dict) -> dict:
    """MoE statistics [n, ...] of n shards (or microsteps) -> the batch's: expert load is a count
    (the sum), every other statistic a mean."""
    return {k: jnp.sum(v, axis=0) if k == "load" else jnp.mean(v, axis=0) for k, v in stats.items()}


def _per_shard(layout: Layout, shards: int, make_loss: Callable[[Layout], Callable]) -> tuple[Callable, Callable]:
    """(value_and_grad of make_loss(layout) vmapped over the batch shards, the batch [B, T] ->
    [n, B/n, T] split it takes), n = `shards` = data x expert, dim 0 on the batch axes: each device
    differentiates its own B/n rows, the gradient per shard [n, ...] unreduced until a caller takes
    its mean (the reduction over the batch axes). The rows within one shard name no batch axis."""
    rules = tuple((name, None if name in _BATCH_NAMES else axes) for name, axes in layout.rules)
    loss_fn = make_loss(dataclasses.replace(layout, rules=rules))
    # Only the batch axes of size > 1: a size-1 `expert` axis still names the MoE slots' expert
    # dimension inside, and vmap refuses an axis used both for the shards and within them.
    axes = tuple(a for a in BATCH_AXES if layout.mesh.shape[a] > 1)
    per_shard = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True), in_axes=(None, 0, None), spmd_axis_name=axes)
    split_spec = NamedSharding(layout.mesh, P(axes, None, None))

    def split(batch: Batch) -> Batch:
        # Row block k of the batch is shard k, already on the devices of batch-shard k: no copy.
        return {k: jax.lax.with_sharding_constraint(v.reshape(shards, v.shape[0] // shards, *v.shape[1:]), split_spec)
                for k, v in batch.items()}

    return per_shard, split


def microsteps(batch: Batch, mesh: jax.sharding.Mesh, shards: int, steps: int) -> Batch:
    """[B, T] -> [A, B/A, T], A = `steps`, with microstep k made of row block k of every batch
    shard: the batch is split over the batch axes in `shards` contiguous row blocks, so
    [n, A, b, T] -> [A, n, b, T] -> [A, n*b, T] leaves every row on the device that holds it."""

    def split(x: jax.Array) -> jax.Array:
        rest = x.shape[1:]
        x = x.reshape(shards, steps, x.shape[0] // (shards * steps), *rest)
        x = jnp.swapaxes(x, 0, 1).reshape(steps, x.shape[0] * x.shape[2], *rest)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES, *(None,) * len(rest))))

    return {k: split(v) for k, v in batch.items()}


KEPT_TOTAL = "kept_total"  # accumulate's packed batch: the whole batch's kept-token count per row


def accumulate(cfg: Config, layout: Layout) -> Callable[..., Any]:
    """train.grad_accum: make_value_and_grad's (params, batch, fp8) -> ((loss, (ce, stats)),
    (grads, fp8)) run as `steps` microsteps of B/steps rows in a `lax.scan`, so only one
    microstep's activations are live.

    Each microstep differentiates its loss / steps, so every cotangent in it is the whole batch's
    for those rows (FP8's output-gradient amaxes included: differentiating each microstep's own
    mean made them `steps` times too large); the gradients are summed in float32 in the carry.
    Loss and cross-entropy are the microsteps' mean, MoE statistics
    too but the expert `load` (a count: the sum). The FP8 state's new value is the elementwise
    max over microsteps (as fm32 combines the uses within one program, fp8.py), starting from
    -inf (fm32's zero: a state no microstep used stays unused for `overwrite`).

    Where parallelism.reduces_once holds, each batch shard's gradient is accumulated unreduced
    (the carry [n, ...] over the batch axes, `_per_shard`: the per-device memory of one gradient
    laid out as the parameters, as before) and the mean over shards, the reduction over the batch
    axes, runs once after the scan; elsewhere the partitioner reduces each microstep's gradient.

    Packed documents (data.eod_id >= 0): a part's cross-entropy is the mean over its own kept
    tokens, so each is weighted by its share of the whole batch's kept tokens (times the number
    of parts, whose mean is taken): the sum is the mean over every kept token, as without
    microsteps (pipeline_1f1b weighs its microbatches the same way). The MoE router losses keep
    the plain 1/steps. The batch's kept count rides in the batch as KEPT_TOTAL.
    """
    mesh, par, steps = layout.mesh, layout.parallelism, cfg.train.grad_accum
    shards = par.batch_shards
    rows = NamedSharding(mesh, P(BATCH_AXES, None))
    packed = cfg.data.eod_id >= 0
    moe = cfg.model.moe
    once = bool(reduces_once(steps, cfg.fp8.enabled, bool(moe.num_experts) and moe.dispatch == "ragged", par.zero,
                             shards, par.expert))

    def make_micro_loss(lay: Layout) -> Callable[..., tuple[jax.Array, Aux]]:
        loss_fn = make_loss_fn(lay)

        def micro_loss(params: Any, batch: Batch, fp8: Any) -> tuple[jax.Array, Aux]:
            if not packed:
                loss, aux = loss_fn(params, batch, fp8)
                return loss / steps, aux
            batch = dict(batch)
            total = batch.pop(KEPT_TOTAL)[0, 0]  # [rows, 1], the same count in every row
            ce, stats = loss_fn(params, batch, fp8)[1]
            parts = steps * (shards if once else 1)
            weight = jnp.sum(batch["loss_mask"] != 0).astype(jnp.float32) * parts / total
            return (ce * weight + moe_loss(stats, lay.model.cfg)) / steps, (ce * weight, stats)

        return micro_loss

    if once:  # no FP8 here (reduces_once): the state passes through
        per_shard, split = _per_shard(layout, shards, make_micro_loss)

        def value_and_grad(params: Any, micro: Batch, fp8: Any) -> tuple[tuple[jax.Array, Aux], tuple[Any, Any]]:
            (losses, (ces, stats)), grads = per_shard(params, split(micro), fp8)
            return (jnp.mean(losses), (jnp.mean(ces), _shards_stats(stats))), (grads, fp8)

        def accumulator(p: jax.Array, s: NamedSharding) -> jax.Array:
            axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
            spec = NamedSharding(mesh, P(axes, *s.spec))
            return jax.lax.with_sharding_constraint(jnp.zeros((shards, *p.shape), jnp.float32), spec)
    else:
        value_and_grad = jax.value_and_grad(make_micro_loss(layout), argnums=(0, 2), has_aux=True)

        def accumulator(p: jax.Array, s: NamedSharding) -> jax.Array:
            return jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s)

    def accumulated(params: Any, batch: Batch, fp8: Any) -> tuple[tuple[jax.Array, Aux], tuple[Any, Any]]:
        zeros = jax.tree.map(accumulator, params, layout.param_shardings)
        unused = jax.tree.map(lambda x: jnp.full(jnp.shape(x), -jnp.inf, jnp.float32), fp8)

        def body(carry: tuple[Any, Any], micro: Batch) -> tuple[tuple[Any, Any], tuple]:
            acc, fp8_acc = carry
            micro = {k: jax.lax.with_sharding_constraint(v, rows) for k, v in micro.items()}
            (loss, (ce, stats)), (grads, fp8_new) = value_and_grad(params, micro, fp8)
            acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
            fp8_acc = jax.tree.map(lambda a, n: jnp.maximum(a, n.astype(jnp.float32)), fp8_acc, fp8_new)
            return (acc, fp8_acc), (loss, ce, stats)

        if packed:  # the whole batch's kept tokens, [B, 1] to be cut into microsteps like the rows
            kept = jnp.maximum(jnp.sum(batch["loss_mask"] != 0), 1).astype(jnp.float32)
            batch = {**batch, KEPT_TOTAL: jnp.broadcast_to(kept, (batch["loss_mask"].shape[0], 1))}
        (acc, fp8_new), (losses, ces, stats) = jax.lax.scan(body, (zeros, unused), microsteps(batch, mesh, shards, steps))
        if once:  # the one reduction over the batch axes: the shards' mean
            acc = jax.tree.map(lambda a: jnp.mean(a, axis=0), acc)
        grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
        fp8_new = jax.tree.map(lambda n, x: n.astype(jnp.asarray(x).dtype), fp8_new, fp8)
        return (jnp.sum(losses), (jnp.mean(ces), _shards_stats(stats))), (grads, fp8_new)  # losses are loss / steps

    return accumulated


def make_grad_fn(layout: Layout) -> Callable[[Any, Batch], tuple[jax.Array, Any]]:
    """Jitted (params, batch) -> (training loss, grads), gradients in the parameters' shardings."""
    value_and_grad = make_value_and_grad(layout)

    def grad_fn(params: Any, batch: Batch) -> tuple[jax.Array, Any]:
        (loss, _), (grads, _) = value_and_grad(params, batch, {})
        return loss, grads

    fn = jax.jit(
        grad_fn,
        in_shardings=(layout.param_shardings, batch_sharding(layout.mesh)),
        out_shardings=(NamedSharding(layout.mesh, P()), layout.param_shardings),
    )
    return fn


def make_train_step(cfg: Config, layout: Layout) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    value_and_grad = make_value_and_grad(layout)
    if cfg.train.noise_scale:  # per-shard gradients too; the metrics gain grad_sq_small/big
        value_and_grad = make_sharded_value_and_grad(layout, layout.parallelism.batch_shards)
    if cfg.train.grad_accum > 1:  # microsteps in a scan (parallelism.RULES: no pipeline, no noise scale)
        value_and_grad = accumulate(cfg, layout)
    schedule = make_lr_schedule(cfg)

    def update(state: TrainState, grads: Any, fp8_new: Any) -> tuple[Any, Any, Any]:
        updates, opt_state = layout.tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state, overwrite(state.fp8, fp8_new)

    def all_finite(tree: Any) -> jax.Array:
        checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        # FP8's saturation and flush telemetry only on the steps the loop logs (fp8.quantize)
        # and each tensor's delayed scale from its history once per step, not at every use (fp8_state.step_state)
        fp8_in = step_state(request_telemetry(state.fp8, logs_at(cfg.train, state.step + 1)), cfg.fp8)
        (loss, (ce, stats)), (grads, fp8_new), *norms = value_and_grad(state.params, batch, fp8_in)
        grad_norm = optax.tree.norm(grads)
        # NaN/inf guard: a non-finite loss or gradient, or an update that would leave a non-finite
        # parameter, optimizer or FP8 value (an overflowing learning rate or Adam moment with a
        # finite loss), skips the update (state as it was) but still counts the step, so the data
        # position moves past the bad batch and no checkpoint is ever written from non-finite
        # state. A select, not a cond: it fuses into the elementwise optimizer update.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)  # the training loss, router losses included
        if cfg.optim.name == "adamw":
            # Judging the new state before the select would hold the old and the new state at
            # once (one more copy of parameters and optimizer state at the peak). So the check
            # only reduces, and the update that is kept is computed again behind a barrier (no CSE
            # with the checked one): AdamW's elementwise pass runs twice, the state is not copied.
            finite = finite & all_finite(update(state, grads, fp8_new))
            state, grads, fp8_new, finite = jax.lax.optimization_barrier((state, grads, fp8_new, finite))
            params, opt_state, fp8 = update(state, grads, fp8_new)
        else:
            # Muon's update is matmuls (Newton-Schulz), not one elementwise pass: computed once.
            # Its momentum and orthogonalised update are materialised anyway; the new parameters
            # are judged by a reduction that fuses with their elementwise sum.
            params, opt_state, fp8 = update(state, grads, fp8_new)
            finite = finite & all_finite((params, opt_state, fp8))
        # "loss" is the cross-entropy, comparable across dense and MoE runs; the router losses
        # that training also minimises are reported per layer beside it. "lr" is read at the
        # optimizer's own count, the one this update used: after skipped steps it trails state.step.
        lr = schedule(applied_count(state.opt_state))
        metrics = {"loss": ce, "grad_norm": grad_norm, "lr": lr, **fp8_metrics(fp8),
                   **moe_metrics(stats, cfg.model.moe.every), **(norms[0] if norms else {}), "finite": finite}
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8)
        kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state.replace(step=new_state.step))
        return kept, metrics

    replicated = NamedSharding(layout.mesh, P())
    fn = jax.jit(
        step,
        in_shardings=(layout.state_shardings, batch_sharding(layout.mesh)),
        out_shardings=(layout.state_shardings, replicated),
        donate_argnums=(0,),
    )
    return fn


def make_eval_step(layout: Layout) -> Callable[[Any, Batch, Any], jax.Array]:
    """Jitted (params, batch, fp8 state) -> cross-entropy; the FP8 state is read, not updated."""
    loss_fn = make_loss_fn(layout)
    fn = jax.jit(
        lambda params, batch, fp8: loss_fn(params, batch, request_telemetry(fp8, False))[1][0],
        in_shardings=(layout.param_shardings, batch_sharding(layout.mesh), layout.state_shardings.fp8),
        out_shardings=NamedSharding(layout.mesh, P()),
    )
    return fn
