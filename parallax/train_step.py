"""The loss and the jitted, pure train and eval steps with explicit in/out shardings.

GSPMD inserts every data- and tensor-parallel collective from the shardings: the batch is split
over ('data', 'expert'), the gradient reduction over those axes comes out of the partitioner, and
under ZeRO the optimizer update runs on the data-sharded state (reduce-scatter in, all-gather out).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import Config
from parallax.model import Transformer, cross_entropy, moe_loss
from parallax.fp8 import fp8_metrics, fp8_variables, overwrite
from parallax.optim import make_schedule
from parallax.sharding import BATCH_AXES, logical_context
from parallax.train_state import Layout, TrainState

Batch = dict[str, jax.Array]  # 'inputs', 'targets': [B, T] int32


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


Aux = tuple[jax.Array, dict]  # (cross-entropy, MoE stats per layer)


def make_loss_fn(layout: Layout) -> Callable[[Any, Batch, Any], tuple[jax.Array, Aux]]:
    """(params, batch, fp8) -> (training loss, (cross-entropy, MoE stats)); the training loss is
    the cross-entropy plus the MoE routers' losses (model.moe_loss)."""

    def loss_fn(params: Any, batch: Batch, fp8: Any = None) -> tuple[jax.Array, Aux]:
        with logical_context(layout.mesh, layout.rules, pin_params=layout.pin_params):
            if fp8:  # FP8 state enters as fm32 (fp8.py); config.validate keeps FP8 off pipelined layouts
                variables = {"params": params, **fp8_variables(fp8)}
                logits, stats = layout.model.apply(variables, batch["inputs"], method=Transformer.forward)
            else:
                logits, stats = layout.apply(params, batch["inputs"])
        ce = cross_entropy(logits, batch["targets"])
        return ce + moe_loss(stats, layout.model.cfg), (ce, stats)

    return loss_fn


def make_value_and_grad(layout: Layout) -> Callable[[Any, Batch, Any], tuple[tuple[jax.Array, Aux], tuple[Any, Any]]]:
    """(params, batch, fp8) -> ((loss, (cross-entropy, MoE stats)), (grads, new fp8 state)).

    A 1F1B pipeline computes its own gradients (pipeline_1f1b.py); everything else is
    differentiated here. The FP8 state's "gradient" is its new value (fp8.py).
    """
    if layout.value_and_grad is not None:

        def own(params: Any, batch: Batch, fp8: Any) -> tuple[tuple[jax.Array, Aux], tuple[Any, Any]]:
            with logical_context(layout.mesh, layout.rules, pin_params=layout.pin_params):
                loss, grads = layout.value_and_grad(params, batch)
            return (loss, (loss, {})), (grads, fp8)

        return own
    return jax.value_and_grad(make_loss_fn(layout), argnums=(0, 2), has_aux=True)


def moe_metrics(stats: dict, every: int) -> dict[str, jax.Array]:
    """Per MoE layer `moe_<stat>_layer<block index>`, plus the mean over layers `moe_<stat>`
    (the worst layer for the load imbalance)."""
    out = {}
    for name, per_layer in stats.items():
        out[f"moe_{name}"] = jnp.max(per_layer) if name == "load_max_over_mean" else jnp.mean(per_layer)
        for i in range(per_layer.shape[0]):
            out[f"moe_{name}_layer{(i + 1) * every - 1}"] = per_layer[i]
    return out


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
    schedule = make_schedule(cfg)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        (loss, (ce, stats)), (grads, fp8_new) = value_and_grad(state.params, batch, state.fp8)
        fp8 = overwrite(state.fp8, fp8_new)
        updates, opt_state = layout.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        # "loss" is the cross-entropy, comparable across dense and MoE runs; the router losses
        # that training also minimises are reported per layer beside it.
        metrics = {"loss": ce, "grad_norm": grad_norm, "lr": schedule(state.step), **fp8_metrics(fp8),
                   **moe_metrics(stats, cfg.model.moe.every)}
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8)
        # NaN/inf guard: a non-finite loss or gradient skips the update (state as it was) but still
        # counts the step, so the data position moves past the bad batch. A select, not a cond:
        # it fuses into the elementwise optimizer update and adds no collective.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)  # the training loss, router losses included
        metrics["finite"] = finite
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
        lambda params, batch, fp8: loss_fn(params, batch, fp8)[1][0],
        in_shardings=(layout.param_shardings, batch_sharding(layout.mesh), layout.state_shardings.fp8),
        out_shardings=NamedSharding(layout.mesh, P()),
    )
    return fn
