"""TrainState and its layout: abstract state via `eval_shape`, shardings, sharded init.

Nothing is materialised unsharded: the state's shapes come from `jax.eval_shape`, its shardings
from the logical names on the parameters and the rules, and `init_state` is one jitted call whose
`out_shardings` place every array where it lives. Initialisation depends only on the seed, never on
the mesh (JAX's partitionable threefry), so any two layouts start from the same parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import Config
from parallax.mesh import PIPE
from parallax.model import Transformer
from parallax.optim import make_optimizer
from parallax.pipeline import Schedule, is_pipelined, make_pipelined_apply, make_schedule, stage_specs, to_stages
from parallax.sharding import DEFAULT_RULES, Rules, logical_context, logical_shardings, make_rules, optimizer_rules


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


@dataclass(frozen=True)
class Layout:
    """Everything needed to build and place the state on one mesh."""

    model: Transformer
    tx: optax.GradientTransformation
    mesh: jax.sharding.Mesh
    rules: Rules  # compute placement: activations and parameters at the point of use
    logical_specs: Any  # params tree of logical PartitionSpecs
    abstract_state: TrainState
    state_shardings: TrainState
    schedule: Schedule | None  # the pipeline schedule; None when the stack is not pipelined
    apply: Callable[[Any, jax.Array], jax.Array]  # (params, tokens [B, T]) -> logits [B, T, V]

    @property
    def param_shardings(self) -> Any:
        return self.state_shardings.params


def _init_boxed(model: Transformer, cfg: Config, rng: jax.Array) -> Any:
    tokens = jnp.zeros((1, cfg.train.seq_len), jnp.int32)
    return model.init(rng, tokens)["params"]


def _init_params(model: Transformer, cfg: Config, rng: jax.Array, schedule: Schedule | None) -> Any:
    """The plain model's initialisation, reshaped to the stage layout when pipelined (so any pipe
    size starts from the same weights)."""
    params = nn.unbox(_init_boxed(model, cfg, rng))
    if schedule is not None:
        params = {**params, "layers": to_stages(params["layers"], schedule)}
    return params


def make_layout(cfg: Config, mesh: jax.sharding.Mesh, model: Transformer | None = None) -> Layout:
    model = model or Transformer(cfg.model, remat=cfg.parallel.remat)
    tx = make_optimizer(cfg)
    rules = DEFAULT_RULES
    stages = mesh.shape[PIPE]
    schedule = make_schedule(cfg.parallel, stages) if is_pipelined(cfg.parallel, stages) else None
    logical_specs = nn.get_partition_spec(jax.eval_shape(lambda r: _init_boxed(model, cfg, r), jax.random.key(0)))
    if schedule is not None:
        logical_specs = {**logical_specs, "layers": stage_specs(logical_specs["layers"])}
        apply = make_pipelined_apply(model, schedule, mesh)
    else:
        apply = lambda params, tokens: model.apply({"params": params}, tokens)  # noqa: E731
    params = jax.eval_shape(lambda r: _init_params(model, cfg, r, schedule), jax.random.key(0))
    opt_state = jax.eval_shape(tx.init, params)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=opt_state)

    replicated = NamedSharding(mesh, P())
    param_shardings = logical_shardings(logical_specs, mesh, make_rules(cfg.parallel))
    opt_param_shardings = logical_shardings(logical_specs, mesh, optimizer_rules(cfg.parallel))
    # Moments mirror the params tree inside optax's state; everything else (counts) is replicated.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, opt_state, opt_param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    return Layout(model, tx, mesh, rules, logical_specs, abstract, shardings, schedule, apply)


def init_state(cfg: Config, layout: Layout) -> TrainState:
    """Initialise parameters and optimizer state directly in their shardings."""

    def init(rng: jax.Array) -> TrainState:
        with logical_context(layout.mesh, layout.rules):
            params = _init_params(layout.model, cfg, rng, layout.schedule)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=layout.tx.init(params))

    return jax.jit(init, out_shardings=layout.state_shardings)(jax.random.key(cfg.train.seed))


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded arrays (measured on the first device's shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        device = leaf.sharding.device_set and min(leaf.sharding.device_set, key=lambda d: d.id)
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total
