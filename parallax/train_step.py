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
from parallax.model import cross_entropy
from parallax.fp8 import fp8_metrics, fp8_variables, overwrite
from parallax.optim import make_schedule
from parallax.sharding import BATCH_AXES, logical_context
from parallax.train_state import Layout, TrainState

Batch = dict[str, jax.Array]  # 'inputs', 'targets': [B, T] int32


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


def make_loss_fn(layout: Layout) -> Callable[[Any, Batch], jax.Array]:
    def loss_fn(params: Any, batch: Batch, fp8: Any = None) -> jax.Array:
        with logical_context(layout.mesh, layout.rules, pin_params=layout.pin_params):
            if fp8:  # FP8 state enters as fm32 (fp8.py); config.validate keeps FP8 off pipelined layouts
                logits = layout.model.apply({"params": params, **fp8_variables(fp8)}, batch["inputs"])
            else:
                logits = layout.apply(params, batch["inputs"])
        return cross_entropy(logits, batch["targets"])

    return loss_fn


def make_value_and_grad(layout: Layout) -> Callable[[Any, Batch, Any], tuple[jax.Array, tuple[Any, Any]]]:
    """(params, batch, fp8) -> (loss, (grads, new fp8 state)).

    A 1F1B pipeline computes its own gradients (pipeline_1f1b.py); everything else is
    differentiated here. The FP8 state's "gradient" is its new value (fp8.py).
    """
    if layout.value_and_grad is not None:

        def own(params: Any, batch: Batch, fp8: Any) -> tuple[jax.Array, tuple[Any, Any]]:
            with logical_context(layout.mesh, layout.rules, pin_params=layout.pin_params):
                loss, grads = layout.value_and_grad(params, batch)
            return loss, (grads, fp8)

        return own
    return jax.value_and_grad(make_loss_fn(layout), argnums=(0, 2))


def make_grad_fn(layout: Layout) -> Callable[[Any, Batch], tuple[jax.Array, Any]]:
    """Jitted (params, batch) -> (loss, grads), gradients in the parameters' shardings."""
    value_and_grad = make_value_and_grad(layout)

    def grad_fn(params: Any, batch: Batch) -> tuple[jax.Array, Any]:
        loss, (grads, _) = value_and_grad(params, batch, {})
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
        loss, (grads, fp8_new) = value_and_grad(state.params, batch, state.fp8)
        fp8 = overwrite(state.fp8, fp8_new)
        updates, opt_state = layout.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), **fp8_metrics(fp8)}
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8)
        # NaN/inf guard: a non-finite loss or gradient skips the update (state as it was) but still
        # counts the step, so the data position moves past the bad batch. A select, not a cond:
        # it fuses into the elementwise optimizer update and adds no collective.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
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
    """Jitted (params, batch, fp8 state) -> loss; the FP8 state is read, not updated."""
    fn = jax.jit(
        make_loss_fn(layout),
        in_shardings=(layout.param_shardings, batch_sharding(layout.mesh), layout.state_shardings.fp8),
        out_shardings=NamedSharding(layout.mesh, P()),
    )
    return fn
