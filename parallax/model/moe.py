"""Mixture-of-Experts FFN: top-k router, capacity slots, batched expert SwiGLU, balancing losses.

y = sum over i in TopK(p(x)) of g_i(x) E_i(x), with p = softmax(x W_r) computed in float32 and g
the chosen probabilities (renormalised to sum to 1 over the k choices when `renormalize`).

Tokens are routed per sequence (a group is one row of the batch, S = T tokens): each expert has
C = ceil(capacity_factor * S * k / E) slots per sequence, filled in order of router probability
(highest first, ties in token order), and an assignment that finds its expert full is dropped: its
token keeps only the residual (and the shared experts). capacity_factor <= 0 is dropless: C = S,
the most one expert can receive from a sequence. Because groups are sequences, the layout never
changes which tokens drop: every mesh computes the same function.

`dispatch='ragged'` (dropless only) replaces the slots by a grouped matmul: each device sorts its
tokens' k assignments by expert and runs the experts as `jax.lax.ragged_dot` over the groups, so
no compute is spent on the empty slots of the C = S worst case. With no drops the grouping cannot
change the math: every token still gets sum_i g_i E_i(x) whatever tokens share its group, so this
equals the capacity path with capacity_factor <= 0 (tests/test_moe.py); only the order of the
sums inside each matmul differs. On this path routing is grouped per device, not per sequence,
which matters for nothing but the rounding.

Single-device math with logical names only. The one communication, moving each expert's slots
(or sorted tokens) to the device that holds the expert and back, is injected as `exchange`
(expert_parallel.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from parallax.config import MoEConfig, moe_capacity
from parallax.model.layers import MLP, DotGeneralFactory, make_dot, param_matmul
from parallax.model.logical import MLP_WI, ParamPlacer, constrain, constrain_param, param_placement, varying_axes

SLOTS = ("activation_batch", None, None, "activation_embed")  # [G, E, C, D] before the exchange
EXPERT_SLOTS = ("activation_batch_no_expert", "activation_expert", None, "activation_embed")  # after
HIDDEN = ("activation_expert", "activation_batch_no_expert", None, "activation_mlp")  # [E, G, C, F]


class Routing(NamedTuple):
    probs: jax.Array  # [G, S, E] float32 router softmax
    experts: jax.Array  # [G, S, k] int32, distinct per token, in order of probability
    gates: jax.Array  # [G, S, k] float32 combine weights


# A grouped expert FFN: (tokens [M, D] sorted by expert, group sizes [E'] int32, wi, wo) -> [M, D].
Grouped = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# The ragged layer's local math: (x [G, S, D], experts [G, S, k], gates [G, S, k], wi, wo, through)
# -> [G, S, D], where `through(ffn)` lifts a grouped FFN over the experts held here to one over
# this device's tokens sorted by global expert (identity when every expert is here).
RaggedLayer = Callable[..., jax.Array]


def _run_here(layer: RaggedLayer, x, experts, gates, wi, wo) -> jax.Array:
    return layer(x, experts, gates, wi, wo, lambda ffn: ffn)


class Exchange(NamedTuple):
    """Moves [G, E, C, D] slots to the devices holding their experts (`to_experts`) and back.
    `experts_here(E)`: how many experts the weights this code sees hold (E, or E/ep inside a
    shard_map that is manual over the expert axis, e.g. a pipeline stage).
    `ragged(layer, x, experts, gates, wi, wo)`: runs the ragged layer's local math where the
    tokens and experts live (a shard_map over the batch axes), with a `through` that moves the
    sorted tokens to their experts' devices and back."""

    to_experts: Callable[[jax.Array], jax.Array]
    from_experts: Callable[[jax.Array], jax.Array]
    experts_here: Callable[[int], int] = lambda e: e
    ragged: Callable[..., jax.Array] = _run_here


LOCAL = Exchange(lambda x: x, lambda x: x)  # every expert on every device: nothing moves


def route(logits: jax.Array, top_k: int, renormalize: bool) -> Routing:
    """[G, S, E] router logits -> the top-k experts of each token and their gates."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    # k rounds of argmax, not lax.top_k: the partitioner all-gathers a batch-sharded top_k over
    # every device (seen in the compiled HLO) but keeps a reduction over E local. Ties go to the
    # lower expert index, as in top_k.
    picked, remaining = [], probs
    for _ in range(top_k):
        best = jnp.argmax(remaining, axis=-1)
        picked.append(best)
        remaining = jnp.where(jax.nn.one_hot(best, probs.shape[-1], dtype=bool), -1.0, remaining)
    experts = jnp.stack(picked, axis=-1)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return Routing(probs, experts.astype(jnp.int32), gates)


def _group_slots(experts: jax.Array, priority: jax.Array, num_experts: int) -> jax.Array:
    """One group: [S, k] experts and priorities -> [S, k] position of each assignment in its
    expert's queue, the queue ordered by priority (highest first, ties in token order)."""
    flat = experts.reshape(-1)  # [S*k]
    order = jnp.argsort(-priority.reshape(-1), stable=True)
    taken = jax.nn.one_hot(flat[order], num_experts, dtype=jnp.int32)  # [S*k, E] in queue order
    position = jnp.take_along_axis(jnp.cumsum(taken, axis=0) - 1, flat[order][:, None], axis=1)[:, 0]
    return jnp.zeros_like(flat).at[order].set(position).reshape(experts.shape)


def assign_slots(routing: Routing, num_experts: int, capacity_: int) -> tuple[jax.Array, jax.Array]:
    """(slot [G, S, k] int32, keep [G, S, k] bool): the slot each assignment takes in its expert's
    buffer and whether it got one. Priority is the router probability of the choice."""
    priority = jnp.take_along_axis(routing.probs, routing.experts, axis=-1)
    slot = jax.vmap(_group_slots, in_axes=(0, 0, None))(routing.experts, priority, num_experts)
    return slot, slot < capacity_


def _flat_slot(experts: jax.Array, slot: jax.Array, keep: jax.Array, num_experts: int, capacity_: int) -> jax.Array:
    """Index into a group's E*C slots, E*C (a spare row) for dropped assignments."""
    return jnp.where(keep, experts * capacity_ + slot, num_experts * capacity_)


def dispatch(x: jax.Array, routing: Routing, slot: jax.Array, keep: jax.Array, capacity_: int) -> jax.Array:
    """[G, S, D] tokens -> [G, E, C, D] expert slots (empty slots are zeros). A gather, not a
    one-hot einsum: its cost does not grow with S * E * C."""
    g, s, d = x.shape
    e = routing.probs.shape[-1]
    flat = _flat_slot(routing.experts, slot, keep, e, capacity_)  # [G, S, k]
    token = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None], flat.shape[1:])

    def one_group(x: jax.Array, flat: jax.Array) -> jax.Array:
        # Which token fills each slot (S: none). Kept assignments hit distinct slots; the dropped
        # ones all land on the spare row E*C, cut off below.
        source = jnp.full((e * capacity_ + 1,), s, jnp.int32).at[flat.reshape(-1)].set(token.reshape(-1))
        padded = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])  # [S + 1, D]
        return padded[source[: e * capacity_]].reshape(e, capacity_, d)

    return jax.vmap(one_group)(x, flat)


def combine(y: jax.Array, routing: Routing, slot: jax.Array, keep: jax.Array) -> jax.Array:
    """[G, E, C, D] expert outputs -> [G, S, D]: each token's kept assignments weighted by their
    gates and summed (a dropped assignment contributes nothing)."""
    g, e, c, d = y.shape
    flat = _flat_slot(routing.experts, slot, keep, e, c)  # [G, S, k]

    def one_group(y: jax.Array, flat: jax.Array) -> jax.Array:
        padded = jnp.concatenate([y.reshape(e * c, d), jnp.zeros((1, d), y.dtype)])
        return padded[flat]  # [S, k, D]

    picked = jax.vmap(one_group)(y, flat)
    weights = jnp.where(keep, routing.gates, 0.0).astype(y.dtype)
    return jnp.einsum("gskd,gsk->gsd", picked, weights)


def load_balancing_loss(routing: Routing) -> jax.Array:
    """Switch/GShard: E * sum_i f_i P_i per group, averaged over groups. f_i is the fraction of the
    group's k*S assignments routed to expert i (before drops), P_i its mean router probability;
    1 under perfectly uniform routing, E when every token picks the same experts with certainty."""
    e = routing.probs.shape[-1]
    f = jnp.mean(jax.nn.one_hot(routing.experts, e, dtype=jnp.float32), axis=(1, 2))  # [G, E]
    p = jnp.mean(routing.probs, axis=1)  # [G, E]
    return jnp.mean(e * jnp.sum(f * p, axis=-1))


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE: mean over tokens of logsumexp(logits)^2; keeps router logits small (bf16-safe)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def routing_stats(routing: Routing, keep: jax.Array, logits: jax.Array) -> dict[str, jax.Array]:
    """Per-layer figures for metrics.jsonl. Means over sequences or tokens, and `load` as counts
    (assignments per expert before drops, [E]), so that microbatches and batch shards combine
    exactly (pipeline.py); the metric is max/mean of the counts (train_step.moe_metrics)."""
    e = routing.probs.shape[-1]
    return {
        "aux_loss": load_balancing_loss(routing),
        "z_loss": router_z_loss(logits),
        "dropped_fraction": 1.0 - jnp.mean(keep.astype(jnp.float32)),
        "load": jnp.sum(jax.nn.one_hot(routing.experts, e, dtype=jnp.float32), axis=(0, 1, 2)),
    }


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """[G, S, k] experts -> (order [N]: the N = G*S*k assignments grouped by expert, token order
    within a group; group sizes [E] int32)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _grouped_weight_grad(x: jax.Array, g: jax.Array, sizes: jax.Array, out_dtype: Any) -> jax.Array:
    """dw[e] = x[group e]^T g[group e]: [M, K] x [M, N] -> [E, K, N] in `out_dtype`, one GEMM over
    the ragged (contracted) row dimension, as jax's own transpose of ragged_dot computes it, but
    emitting `out_dtype` (jax's emits the forward's dtype)."""
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    native = lambda x, g: jax.lax.ragged_dot_general(x, g, sizes, dims, preferred_element_type=out_dtype)  # noqa: E731
    if jnp.dtype(out_dtype).itemsize <= max(x.dtype.itemsize, g.dtype.itemsize):
        return native(x, g)
    # XLA:CPU refuses some bf16 x bf16 -> f32 dots at run time (layers.weight_grad_dot): exact upcast there
    upcast = lambda x, g: native(x.astype(out_dtype), g.astype(out_dtype))  # noqa: E731
    return jax.lax.platform_dependent(x, g, cpu=upcast, default=native)


def grouped_param_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, dtype: Any, grad_dtype: Any) -> jax.Array:
    """x [M, K] (rows grouped by expert) times the master weight w [E, K, N] cast to `dtype`, as
    ragged_dot; the weight gradient leaves its GEMM in `grad_dtype` (parallel.grad_reduce_dtype), so
    its reduction over the batch axes (where the ragged shard_map is transposed) runs in that dtype,
    as layers.param_matmul does for every other weight. Plain autodiff of the cast gave bfloat16
    partial sums reduced over `data` in bfloat16 (found on the compile-only h100-8, 2026-12-02)."""
    return _grouped_param_dot(jnp.dtype(dtype).name, jnp.dtype(grad_dtype).name)(x, w, sizes)


@functools.lru_cache(maxsize=None)
def _grouped_param_dot(dtype: str, grad_dtype: str):
    """The custom VJP for one (compute, gradient) dtype pair: dtypes are closed over, not passed
    (jax 0.10.2's custom_vjp refused a numpy dtype as a nondiff argument under grad)."""

    @jax.custom_vjp
    def dot(x, w, sizes):
        return jax.lax.ragged_dot(x, w.astype(dtype), sizes, preferred_element_type=dtype)

    def fwd(x, w, sizes):
        wc = w.astype(dtype)
        return jax.lax.ragged_dot(x, wc, sizes, preferred_element_type=dtype), (x, wc, sizes, w)

    def bwd(res, g):
        x, wc, sizes, w = res
        dx = jax.lax.ragged_dot(g, jnp.swapaxes(wc, 1, 2), sizes, preferred_element_type=x.dtype)  # [M, K]
        dw = _grouped_weight_grad(x, g, sizes, grad_dtype)  # [E, K, N]
        # Inside the ragged shard_map (manual over the batch axes) the weight is replicated over
        # `data` and this device's partial sum varies over it: reduce here, in grad_dtype (the
        # cotangent must vary as its primal does; the transpose of the shard_map would otherwise
        # have reduced it, in whatever dtype came out)
        extra = tuple(sorted(varying_axes(dw) - varying_axes(w)))
        if extra:
            dw = jax.lax.psum(dw, extra)
        return dx, dw.astype(w.dtype), None

    dot.defvjp(fwd, bwd)
    return dot


def grouped_swiglu(x: jax.Array, group_sizes: jax.Array, wi: jax.Array, wo: jax.Array,
                   grad_dtype: Any = None) -> jax.Array:
    """[M, D] tokens sorted by expert (group i: the next group_sizes[i] rows) -> [M, D], each row
    through its group's SwiGLU expert (wi [E', D, 2, F], wo [E', F, D]). Rows past
    sum(group_sizes) (padding of a static buffer) belong to no group; their output is not used.
    Gate and up are two ragged_dots, not one over a reshaped [E', D, 2F] weight: F may be sharded
    (over tensor) and merging it with the 2 would force a reshard.
    `grad_dtype`: the weights are float32 masters, cast here, their gradients in `grad_dtype`
    (grouped_param_dot); None: they come in the compute dtype (ZeRO-3's gathered copies) and
    their gradients leave in it."""
    dtype = x.dtype
    if grad_dtype is None:
        dot = lambda a, w: jax.lax.ragged_dot(a, w.astype(dtype), group_sizes, preferred_element_type=dtype)  # noqa: E731
    else:
        dot = lambda a, w: grouped_param_dot(a, w, group_sizes, dtype, grad_dtype)  # noqa: E731
    gate = dot(x, wi[:, :, 0, :])  # [M, F]
    up = dot(x, wi[:, :, 1, :])
    gate, up = checkpoint_name(gate, MLP_WI), checkpoint_name(up, MLP_WI)  # kept under remat=save_attn_mlp
    return dot(nn.silu(gate) * up, wo)


def inverse_permutation(order: jax.Array) -> jax.Array:
    """[N] permutation -> its inverse: x[order][inverse_permutation(order)] == x."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def ragged_layer(num_experts: int, grad_dtype: Any = None) -> RaggedLayer:
    """The ragged path's local math on one device's tokens (see RaggedLayer); `grad_dtype` as
    grouped_swiglu's."""

    def layer(x, experts, gates, wi, wo, through) -> jax.Array:
        g, s, d = x.shape
        k = experts.shape[-1]
        order, sizes = sort_by_expert(experts, num_experts)  # [N], [E]
        tokens = x.reshape(g * s, d)[order // k]  # [N, D]: assignment n is token n // k
        out = through(functools.partial(grouped_swiglu, grad_dtype=grad_dtype))(tokens, sizes, wi, wo)  # [N, D] sorted
        # back to (token, choice) order: a gather, not a scatter
        out = out[inverse_permutation(order)].reshape(g, s, k, d)
        return jnp.einsum("gskd,gsk->gsd", out, gates.astype(x.dtype))

    return layer


class MoE(nn.Module):
    """The MoE FFN on [B, T, D] (groups are sequences): returns (y [B, T, D], per-layer stats)."""

    cfg: MoEConfig
    d_ff: int  # each expert's hidden size F
    init_std: float = 0.02
    out_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None  # the expert matmuls (FP8-capable); the router stays fp32
    exchange: Exchange = LOCAL
    grad_dtype: Any = "float32"  # the expert weights' gradient dtype (layers.param_matmul)
    placer: ParamPlacer | None = None  # ZeRO-3 (logical.ParamPlacer); None: weights only cast

    def _master(self, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float) -> jax.Array:
        return self.param(name, nn.with_logical_partitioning(nn.initializers.normal(std), axes), shape, jnp.float32)

    def _kernel(self, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float,
                dtype: Any = None) -> jax.Array:
        w = self._master(name, shape, axes, std)
        # ZeRO-3: all-gathered here (in the compute dtype, if given)
        return constrain_param(w, axes, self.placer, dtype)

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        c = self.cfg
        b, t, d = x.shape
        e, f = c.num_experts, self.d_ff
        router = self._kernel("router", (d, e), ("embed", None), self.init_std)
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router)  # fp32 routing
        routing = route(logits, c.top_k, c.renormalize)
        if c.dispatch == "ragged":
            return self._ragged(x, routing, logits)
        cap = moe_capacity(t, e, c.top_k, c.capacity_factor)
        slot, keep = assign_slots(routing, e, cap)

        slots = constrain(dispatch(x.astype(self.dtype), routing, slot, keep, cap), SLOTS)  # [B, E, C, D]
        slots = constrain(self.exchange.to_experts(slots), EXPERT_SLOTS)
        e_here = self.exchange.experts_here(e)
        wi_axes, wo_axes = ("exp", "embed", None, "mlp"), ("exp", "mlp", "embed")
        wi = self._master("wi", (e_here, d, 2, f), wi_axes, self.init_std)
        wo = self._master("wo", (e_here, f, d), wo_axes, self.out_std)
        # One batched matmul over the local experts: [B, E, C, D] x [E, D, 2, F] -> [E, B, C, 2, F].
        # Two dot_general instances: each FP8 operand keeps its own scale and history.
        gate_up = param_matmul(slots, wi, (((3,), (1,)), ((1,), (0,))), wi_axes, self.dtype, self.grad_dtype,
                               make_dot(self.dot_general), self.placer)
        gate_up = checkpoint_name(gate_up, MLP_WI)  # kept under remat=save_attn_mlp (see transformer.py)
        h = constrain(nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :], HIDDEN)  # [E, B, C, F]
        out = param_matmul(h, wo, (((3,), (1,)), ((0,), (0,))), wo_axes, self.dtype, self.grad_dtype,
                           make_dot(self.dot_general), self.placer)
        out = constrain(out.transpose(1, 0, 2, 3), EXPERT_SLOTS)  # [E, B, C, D] -> [B, E, C, D]
        out = constrain(self.exchange.from_experts(out), SLOTS)
        y = combine(out, routing, slot, keep)  # [B, T, D]
        if c.shared_experts:
            y = y + MLP(c.shared_experts * f, self.init_std, self.out_std, self.dtype, self.dot_general,
                        self.grad_dtype, self.placer, name="shared")(x)
        return y.astype(self.dtype), routing_stats(routing, keep, logits)

    def _ragged(self, x: jax.Array, routing: Routing, logits: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        c = self.cfg
        if c.capacity_factor > 0:
            raise ValueError("model.moe.dispatch='ragged' is dropless: capacity_factor must be <= 0")
        if self.dot_general is not None:  # refuse rather than silently run the experts un-FP8'd
            raise ValueError("model.moe.dispatch='ragged' runs its experts with ragged_dot, which has no FP8 path")
        d, e, f = x.shape[-1], c.num_experts, self.d_ff
        e_here = self.exchange.experts_here(e)
        wi_axes, wo_axes = ("exp", "embed", None, "mlp"), ("exp", "mlp", "embed")
        if param_placement(self.placer, wi_axes).pinned:
            # ZeRO-3: gathered in the compute dtype outside the exchange (half the bytes); their
            # gradients leave in it (a custom VJP over the gather is still to come)
            wi = self._kernel("wi", (e_here, d, 2, f), wi_axes, self.init_std, self.dtype)
            wo = self._kernel("wo", (e_here, f, d), wo_axes, self.out_std, self.dtype)
            grad_dtype = None
        else:  # the float32 masters go in, cast inside, their gradients in grad_dtype
            wi = self._master("wi", (e_here, d, 2, f), wi_axes, self.init_std)
            wo = self._master("wo", (e_here, f, d), wo_axes, self.out_std)
            grad_dtype = self.grad_dtype
        y = self.exchange.ragged(ragged_layer(e, grad_dtype), x.astype(self.dtype), routing.experts, routing.gates,
                                 wi, wo)
        if c.shared_experts:
            y = y + MLP(c.shared_experts * f, self.init_std, self.out_std, self.dtype, self.dot_general,
                        self.grad_dtype, self.placer, name="shared")(x)
        keep = jnp.ones(routing.experts.shape, bool)  # dropless
        return y.astype(self.dtype), routing_stats(routing, keep, logits)
