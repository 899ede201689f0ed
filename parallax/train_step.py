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
from parallax.optim import make_schedule
from parallax.sharding import BATCH_AXES, logical_context
from parallax.train_state import Layout, TrainState

Batch = dict[str, jax.Array]  # 'inputs', 'targets': [B, T] int32


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy in float32; [B, T, V], [B, T] -> []."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_loss_fn(layout: Layout) -> Callable[[Any, Batch], jax.Array]:
    def loss_fn(params: Any, batch: Batch) -> jax.Array:
        with logical_context(layout.mesh, layout.rules):
            logits = layout.apply(params, batch["inputs"])
        return cross_entropy(logits, batch["targets"])

    return loss_fn


def make_grad_fn(layout: Layout) -> Callable[[Any, Batch], tuple[jax.Array, Any]]:
    """Jitted (params, batch) -> (loss, grads), gradients in the parameters' shardings."""
    fn = jax.jit(
        jax.value_and_grad(make_loss_fn(layout)),
        in_shardings=(layout.param_shardings, batch_sharding(layout.mesh)),
        out_shardings=(NamedSharding(layout.mesh, P()), layout.param_shardings),
    )
    return fn


def make_train_step(cfg: Config, layout: Layout) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    loss_fn = make_loss_fn(layout)
    schedule = make_schedule(cfg)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = layout.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    replicated = NamedSharding(layout.mesh, P())
    fn = jax.jit(
        step,
        in_shardings=(layout.state_shardings, batch_sharding(layout.mesh)),
        out_shardings=(layout.state_shardings, replicated),
        donate_argnums=(0,),
    )
    return fn


def make_eval_step(layout: Layout) -> Callable[[Any, Batch], jax.Array]:
    fn = jax.jit(
        make_loss_fn(layout),
        in_shardings=(layout.param_shardings, batch_sharding(layout.mesh)),
        out_shardings=NamedSharding(layout.mesh, P()),
    )
    return fn
