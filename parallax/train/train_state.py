"""TrainState and its layout: abstract state via `eval_shape`, shardings, sharded init.

Nothing is materialised unsharded: the state's shapes come from `jax.eval_shape`, its shardings
from the logical names on the parameters and the rules, and `init_state` is one jitted call whose
`out_shardings` place every array where it lives. Initialisation depends only on the seed, never on
the mesh (JAX's partitionable threefry), so any two layouts start from the same parameters.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import Config, ConfigError
from parallax.parallel.expert_parallel import EXPERT_EXCHANGE
from parallax.parallel.fused_attention import make_attend
from parallax.model.fp8 import FP8_COLLECTION, quantize_weights, transformer_dot_generals
from parallax.model.transformer import Transformer
from parallax.train.optim import make_optimizer, muon_shardings
from parallax.parallel.pipeline_1f1b import make_scheduled_value_and_grad
from parallax.parallelism import Parallelism, Schedule
from parallax.parallel.pipeline import make_pipelined_apply, stack_state_spec, stage_specs, to_stages
from parallax.parallel.sharding import (Rules, compute_rules, logical_context, logical_shardings, make_rules, optimizer_rules,
                               param_placer)


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    # FP8 scales and amax histories (fp8.py): replicated, updated by the step, never by the optimizer.
    fp8: Any = struct.field(default_factory=dict)


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
    # (params, tokens [B, T], targets [B, T], FP8 collection (fm32) or None, **packed documents:
    # [B, T] arrays, data.DOC_KEYS: not with 1F1B, parallelism.RULES) -> (mean cross-entropy, MoE stats)
    apply: Callable[..., tuple[jax.Array, dict]]
    # (params, batch, FP8 state) -> ((loss, (cross-entropy, MoE stats)), (grads, new FP8 state)) for
    # schedules that compute their own gradients (1F1B): train_step.make_value_and_grad's contract.
    value_and_grad: Callable[[Any, dict, Any], tuple[tuple[jax.Array, Any], tuple[Any, Any]]] | None = None
    parallelism: Parallelism | None = None  # the checked rules it was laid out under

    @property
    def param_shardings(self) -> Any:
        return self.state_shardings.params



def _init_tokens(cfg: Config) -> jax.Array:
    # The whole global batch, so that every activation splits evenly over the batch axes (the MoE
    # exchange requires it); the forward pass is dead code in the jitted init and is removed.
    return jnp.zeros((cfg.train.global_batch, cfg.train.seq_len), jnp.int32)


def _init_boxed(model: Transformer, cfg: Config, rng: jax.Array) -> Any:
    tokens = _init_tokens(cfg)
    return model.init(rng, tokens)["params"]


def _init_fp8(model: Transformer, cfg: Config, rng: jax.Array) -> Any:
    """The FP8 state (ones and zeros: no data dependence); {} when the model has no FP8 dots."""
    if model.dot_general is None and model.logits_dot_general is None:
        return {}  # plain matmuls: skip a second trace of init
    tokens = _init_tokens(cfg)
    return model.init(rng, tokens).get(FP8_COLLECTION, {})


def _init_params(model: Transformer, cfg: Config, rng: jax.Array, schedule: Schedule | None) -> Any:
    """The plain model's initialisation, reshaped to the stage layout when pipelined (so any pipe
    size starts from the same weights)."""
    params = nn.unbox(_init_boxed(model, cfg, rng))
    if schedule is not None:
        params = {**params, "layers": to_stages(params["layers"], schedule)}
    return params


def make_model(cfg: Config, cls: type[Transformer] = Transformer, attention: str = "xla",
               platform: str = "accelerator") -> Transformer:
    """The model `cfg` describes, with its parallelism injected: FP8 dots, ZeRO-3's placer, the
    expert exchange, the attention kernel (`attention`: the resolved kernel,
    parallelism.attention_kernel; make_layout passes the mesh platform's). `cls`: a Transformer
    subclass (a benchmark's variant) made the same way. `platform` 'cpu': XLA:CPU emulates the
    FP8 matmuls, so the weights quantised once per step are kept as float32 values there
    (fp8._Static.emulated), but for ZeRO-3, which gathers them: as float32 that would move four
    times the bytes of their E4M3 bits."""
    return cls(cfg.model, remat=cfg.parallel.remat, grad_dtype=cfg.parallel.grad_reduce_dtype,
               placer=param_placer(cfg.parallel), exchange=EXPERT_EXCHANGE, loss_chunk=cfg.parallel.loss_chunk,
               attention_chunk=cfg.parallel.attention_chunk, attend=make_attend(attention),
               **transformer_dot_generals(cfg.fp8, emulated=platform == "cpu" and cfg.parallel.zero < 3))


def make_layout(cfg: Config, mesh: jax.sharding.Mesh, par: Parallelism | None = None,
                model: Transformer | None = None) -> Layout:
    """The layout of `cfg` on `mesh`. `par`: the layout's checked rules (parallelism.py); None
    checks them here. Either way nothing unchecked is laid out. `model`: default make_model(cfg)."""
    rules = compute_rules(cfg.parallel)
    # Laid out only once checked: every rule of parallelism.py for this mesh and platform.
    if par is None:
        par = Parallelism.of_mesh(cfg, mesh)
    elif not par.matches(cfg, dict(mesh.shape)):
        raise ConfigError(f"make_layout: the Parallelism given was checked for {par.sizes} and other parallel "
                          f"settings, not for this config on mesh {dict(mesh.shape)}")
    model = model or make_model(cfg, attention=par.attention, platform=par.platform)  # the mesh platform's kernels
    schedule = par.schedule
    logical_specs = nn.get_partition_spec(jax.eval_shape(lambda r: _init_boxed(model, cfg, r), jax.random.key(0)))
    if schedule is not None:
        logical_specs = {**logical_specs, "layers": stage_specs(logical_specs["layers"])}
    param_shardings = logical_shardings(logical_specs, mesh, make_rules(cfg.parallel))
    opt_param_shardings = logical_shardings(logical_specs, mesh, optimizer_rules(cfg.parallel))
    value_and_grad = None
    if schedule is not None:
        layer_specs = jax.tree.map(lambda s: s.spec, param_shardings["layers"])
        forward_only = schedule
        if schedule.own_gradients:  # a table schedule; the forward-only `apply` (evaluation) runs
            # its forward order: GPipe, or circular for interleaved chunks (the same stage layout)
            outer_specs, update_specs = ({k: jax.tree.map(lambda s: s.spec, v) for k, v in shardings.items()
                                          if k != "layers"} for shardings in (param_shardings, opt_param_shardings))
            value_and_grad = make_scheduled_value_and_grad(model, schedule, mesh, layer_specs, par.batch_shards,
                                                           outer_specs, update_specs)
            forward_only = dataclasses.replace(schedule, name="circular" if schedule.repeats > 1 else "gpipe")
        apply = make_pipelined_apply(model, forward_only, mesh, layer_specs)
    else:
        def apply(params: Any, tokens: jax.Array, targets: jax.Array, fp8: Any = None,
                  **docs: jax.Array) -> tuple[jax.Array, dict]:  # docs: packed documents (data.DOC_KEYS)
            if fp8 and "layers" in fp8:  # each stacked weight quantised once, not at each use and recompute
                stack = params["layers"]
                params = {**params, "layers": quantize_weights(stack, fp8["layers"], model.dot_general, model.cfg.dtype,
                                                               jax.tree.map(lambda _: (), stack), lead=1)}
            variables = {"params": params, **({FP8_COLLECTION: fp8} if fp8 else {})}
            return model.apply(variables, tokens, targets, method=Transformer.loss, **docs)
    params = jax.eval_shape(lambda r: _init_params(model, cfg, r, schedule), jax.random.key(0))
    muon_layout = muon_shardings(params, logical_specs, opt_param_shardings) if cfg.optim.name == "muon" else None
    tx = make_optimizer(cfg, logical_specs, muon_layout)  # the stage layout's names when pipelined
    opt_state = jax.eval_shape(tx.init, params)
    fp8 = jax.eval_shape(lambda r: _init_fp8(model, cfg, r), jax.random.key(0))
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=opt_state, fp8=fp8)

    replicated = NamedSharding(mesh, P())
    # Moments mirror the params tree inside optax's state; everything else (counts) is replicated.
    # A partitioned optimizer (Muon's) holds an empty MaskedNode where the other half owns the
    # leaf, so a Muon leaf's state is the Muon half's: muon_layout (AdamW's leaves as the rules say).
    opt_shardings = optax.tree_map_params(
        tx, lambda v, s: v if isinstance(v, optax.MaskedNode) else s, opt_state,
        opt_param_shardings if muon_layout is None else jax.tree.map(lambda m: m.final, muon_layout),
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, (NamedSharding, optax.MaskedNode)),
    )
    # FP8 state: replicated, but the pipelined stack's on its stages where that is a plain reshape
    stacked = NamedSharding(mesh, stack_state_spec(schedule))
    fp8_shardings = {k: jax.tree.map(lambda _: stacked if k == "layers" else replicated, v) for k, v in fp8.items()}
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings, fp8=fp8_shardings)
    return Layout(model, tx, mesh, rules, logical_specs, abstract, shardings, schedule, apply, value_and_grad,
                  parallelism=par)


def init_state(cfg: Config, layout: Layout) -> TrainState:
    """Initialise parameters and optimizer state directly in their shardings."""

    def init(rng: jax.Array) -> TrainState:
        with logical_context(layout.mesh, layout.rules):
            params = _init_params(layout.model, cfg, rng, layout.schedule)
            fp8 = _init_fp8(layout.model, cfg, rng)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=layout.tx.init(params), fp8=fp8)

    return jax.jit(init, out_shardings=layout.state_shardings)(jax.random.key(cfg.train.seed))
