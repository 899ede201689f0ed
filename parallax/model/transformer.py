"""The decoder-only transformer: embed -> scanned block stack -> RMSNorm -> logits.

The block stack is one `nn.scan` over a leading logical `layers` axis, so compile time does not
grow with depth. Remat wraps the block inside the scan. Parameter and FLOP counts are computed from
the config alone (no tracing), so planners and the CLI can report them before anything is built.

Single-device math. Parallelism comes in from outside (train_state.make_layout), as module
attributes passed down to every module that needs them: `dot_general` (FP8), `placer` (ZeRO-3:
logical.ParamPlacer, None for none) and `exchange` (the MoE all-to-all: moe.Exchange, moe.LOCAL
when every expert is on every device).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from parallax.model.attention import Attention
from parallax.config import ModelConfig, expert_d_ff, stack_length
from parallax.model.fp8 import FP8_COLLECTION
from parallax.model.layers import MLP, DotGeneralFactory, RMSNorm
from parallax.model.logical import PARAM_COMPUTE, SAVED_ACTIVATIONS, ParamPlacer, constrain, pin
from parallax.model.moe import LOCAL, Exchange, MoE
from parallax.model.vocab import LOGITS, Embed, Head

# The residual stream between tensor-parallel regions: its T is `activation_norm_length` (its D
# `activation_norm_embed`), sharded over tensor under sequence parallelism (sharding.compute_rules).
# The input of a column-parallel matmul (a norm's output) is NORMED, full T and D: that constraint
# is sequence parallelism's all-gather.
RESIDUAL = ("activation_batch", "activation_norm_length", "activation_norm_embed")
NORMED = ("activation_batch", "activation_length", "activation_embed")


def gather_normed(h: jax.Array, scatter_cotangent: bool = True) -> jax.Array:
    """A norm's output [B, T, D] to NORMED for the column-parallel matmuls. Where NORMED and
    RESIDUAL differ (sequence parallelism) that is an all-gather over tensor, which must send the
    compute dtype: XLA:GPU sinks the norm's narrowing convert below the gather and sends its
    float32 (compiled for h100-8: twice the bytes of every forward norm gather); an optimization
    barrier keeps the convert above the gather. Elsewhere there is no collective and no barrier
    (one would stop a compiler fusing the norm into the matmul). In the backward pass the
    cotangent, the column-parallel matmuls' partial sums, is reduce-scattered straight to the
    residual stream's layout: the transpose of the NORMED constraint alone asked for it whole,
    and XLA:TPU all-reduced it inside GPipe's stages (v5e-8: half the block's partial sums). Not
    the loss head's (`scatter_cotangent` False): its chunks write their input gradients into one
    buffer, which that layout made the partitioner gather again in every chunk."""
    normed, residual = pin(NORMED), pin(RESIDUAL)
    if normed == residual:
        return constrain(h, NORMED)
    if h.dtype != jnp.float32:
        h = jax.lax.optimization_barrier(h)
    return _reshard(h, normed, residual) if scatter_cotangent else constrain(h, NORMED)


def scatter_partial_sums(y: jax.Array) -> jax.Array:
    """A row-parallel matmul's output [B, T, D] (partial sums over tensor) on its way into the
    residual stream, whose constraint reduce-scatters it under sequence parallelism. Unchanged
    in the forward pass; in the backward pass its cotangent, T- (or D-) sharded as the residual
    stream's, is gathered once to NORMED, here: left to the partitioner, each consumer matmul
    (the input gradient's and the weight gradient's) had its own gather of it (compiled for
    h100-8 and v5e-8 under GPipe, two [b, T, D] gathers a layer more than the model's). Without
    sequence parallelism, the identity."""
    normed = pin(NORMED)
    return y if normed == pin(RESIDUAL) else _reshard(y, None, normed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reshard(x: jax.Array, forward: Any, backward: Any) -> jax.Array:
    """x in the layout `forward` (a logical.Pin; None: as it is), its cotangent in `backward`'s."""
    return x if forward is None else forward(x)


_reshard.defvjp(lambda x, forward, backward: (_reshard(x, forward, backward), None),
                lambda forward, backward, _, g: (backward(g),))


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only block inputs
    # Selective: keep matmul outputs, recompute the cheap elementwise work (norms, silu, rope).
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # MaxText's save_out_proj + mlpwi: keep the attention output after its projection and the
    # MLP's gate/up output (logical.SAVED_ACTIVATIONS; an MoE layer's expert and shared-expert
    # gate/up too), recompute the rest: norms, q/k/v and the attention, silu, the MLP's output
    # projection (and, MoE, the router, the dispatch, both all-to-alls and the experts' output
    # projection). Nothing else is saveable, so ZeRO-3's gathered weights (PARAM_COMPUTE) are
    # gathered again in the backward pass, as under `full`.
    "save_attn_mlp": jax.checkpoint_policies.save_only_these_names(*SAVED_ACTIVATIONS),
    # The same residuals, moved to pinned host memory after the forward pass and back for the
    # backward pass (parallelism.py refuses it on XLA:CPU, which has no host memory space).
    "save_attn_mlp_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVED_ACTIVATIONS),
        offload_src="device", offload_dst="pinned_host"),
}


def remat_policy(name: str, pinned: bool = False) -> Callable | None:
    """The checkpoint policy for one block; None means no remat at all. `pinned`: parameters are
    gathered where used (a ZeRO-3 placer is injected).

    Under ZeRO-3 `none` asks to remat the all-gathered weights (and only them), so that the
    backward pass would gather each layer's weights again instead of holding every layer's full
    copy. The compiled step shows it does not: the name sits on the gathered copy, and
    `save_anything_except_these_names` then saves the copy's producer, the gathered value itself
    (one gather per weight per step, as cost.py counts). Remat full and dots do gather again, and
    so do the save_attn_mlp policies, which can save nothing but their two names.
    """
    if name == "none":
        return jax.checkpoint_policies.save_anything_except_these_names(PARAM_COMPUTE) if pinned else None
    return REMAT_POLICIES[name]


Stats = dict[str, jax.Array]  # per-layer MoE routing scalars ({} for a dense block)
# Packed documents: (segment_ids, positions), [B, T] each (data.split_batch), or None for none;
# broadcast to every block of the stack.
Docs = tuple[jax.Array, jax.Array] | None


class Block(nn.Module):
    """Attention then FFN, pre-norm residual. `moe`: the FFN is the MoE layer (None: every block
    is MoE when moe.every == 1 and the model has experts)."""

    cfg: ModelConfig
    dot_general: DotGeneralFactory = None
    moe: bool | None = None
    grad_dtype: Any = "float32"  # weight gradients' dtype (layers.param_matmul)
    placer: ParamPlacer | None = None  # ZeRO-3 (logical.ParamPlacer); None: parameters only cast
    exchange: Exchange = LOCAL  # the MoE layer's expert exchange (expert_parallel.py injects its own)
    attention_chunk: int = 0  # query positions per attention block (attention.causal_attention)
    decode: bool = False  # attention reads and extends its KV cache (attention.py; infer/decode.py)
    attend: Any = None  # a fused attention kernel (parallel/fused_attention.py); None: XLA's

    @nn.compact
    def __call__(self, x: jax.Array, docs: Docs = None) -> tuple[jax.Array, Stats]:
        c = self.cfg
        dtype = jnp.dtype(c.dtype)
        out_std = c.init_std / math.sqrt(2 * c.n_layers)  # GPT-2 style residual-branch scaling
        h = gather_normed(RMSNorm(c.norm_eps, dtype, self.placer, name="attn_norm")(x))
        x = x + scatter_partial_sums(Attention(
            c.n_heads, c.n_kv_heads, c.d_model // c.n_heads, c.rope_theta, c.init_std, out_std, dtype,
            self.dot_general, self.grad_dtype, self.placer, self.attention_chunk, self.decode, self.attend, name="attn",
        )(h, *(docs or ())))
        x = constrain(x, RESIDUAL)
        h = gather_normed(RMSNorm(c.norm_eps, dtype, self.placer, name="mlp_norm")(x))  # MoE routes whole sequences
        moe = self.moe if self.moe is not None else bool(c.moe.num_experts) and c.moe.every == 1
        stats: Stats = {}
        if moe:
            y, stats = MoE(c.moe, expert_d_ff(c), c.init_std, out_std, dtype, self.dot_general, self.exchange,
                           self.grad_dtype, self.placer, name="moe")(h)
            # Full T until the residual add: left free, the partitioner spread the router and the
            # combine over T by `tensor` (sequence parallelism), adding small gathers and sorts.
            y = constrain(y, NORMED)
        else:
            y = scatter_partial_sums(MLP(c.d_ff, c.init_std, out_std, dtype, self.dot_general, self.grad_dtype,
                                         self.placer, name="mlp")(h))
        return constrain(x + y, RESIDUAL), stats


class BlockGroup(nn.Module):
    """`moe.every` blocks, the last one MoE: the unit the stack scans over when every > 1."""

    cfg: ModelConfig
    dot_general: DotGeneralFactory = None
    grad_dtype: Any = "float32"
    placer: ParamPlacer | None = None
    exchange: Exchange = LOCAL
    attention_chunk: int = 0
    decode: bool = False
    attend: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, docs: Docs = None) -> tuple[jax.Array, Stats]:
        kw = dict(grad_dtype=self.grad_dtype, placer=self.placer, exchange=self.exchange,
                  attention_chunk=self.attention_chunk, decode=self.decode, attend=self.attend)
        for i in range(self.cfg.moe.every - 1):
            x, _ = Block(self.cfg, self.dot_general, moe=False, **kw, name=f"dense_{i}")(x, docs)
        return Block(self.cfg, self.dot_general, moe=True, **kw, name="moe_block")(x, docs)


def stack_unit(c: ModelConfig) -> type[nn.Module]:
    """The module the block stack scans over (`stack_length(c)` times)."""
    return BlockGroup if c.moe.num_experts and c.moe.every > 1 else Block


class Transformer(nn.Module):
    """Three stages a pipeline can take apart: `embed_tokens`, `run_blocks`, `head`."""

    cfg: ModelConfig
    remat: str = "none"
    dot_general: DotGeneralFactory = None  # the block matmuls (attention projections, MLP)
    logits_dot_general: DotGeneralFactory = None  # the output projection (tied or not)
    # The dtype every weight gradient leaves its matmul, and is reduced over the batch axes, in
    # (parallel.grad_reduce_dtype; layers.param_matmul). None: plain autodiff, in the compute dtype.
    grad_dtype: Any = "float32"
    # ZeRO-3: parameters stored sharded over data, gathered where used (sharding.param_placer).
    # None: no ZeRO-3, parameters are only cast to the compute dtype.
    placer: ParamPlacer | None = None
    # The MoE layers' expert exchange (expert_parallel.EXPERT_EXCHANGE, injected by make_layout);
    # moe.LOCAL is single-device math.
    exchange: Exchange = LOCAL
    # Positions of T per chunk of the fused loss head (parallel.loss_chunk; vocab.py); 0: all T.
    loss_chunk: int = 0
    # Query positions per attention block (parallel.attention_chunk; attention.py); 0: all T.
    attention_chunk: int = 0
    # Sampling (infer/decode.py): every attention layer keeps a KV cache in the "cache" collection
    # (attention.py), stacked over layers like the parameters; the model is then called on the
    # prompt once and on one new token at a time. Training never sets it: no cache exists then.
    decode: bool = False
    # The attention kernel (parallel/fused_attention.make_attend, injected by make_layout for the
    # mesh's platform: cuDNN on GPU, splash on TPU); None: XLA's attention (CPU, model.attention=xla).
    attend: Any = None

    def setup(self) -> None:
        c = self.cfg
        dtype = jnp.dtype(c.dtype)
        self.embed = Embed(c.vocab_size, c.d_model, c.init_std, dtype, self.logits_dot_general, self.grad_dtype,
                           self.placer)
        block = stack_unit(c)
        policy = remat_policy(self.remat, self.placer is not None)
        if policy is not None:
            block = nn.remat(block, policy=policy, prevent_cse=False)
        self.layers = nn.scan(
            block,
            # FP8 scales/histories and the KV caches (decode): one per layer
            variable_axes={"params": 0, FP8_COLLECTION: 0, "cache": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,  # the packed documents (Docs), the same for every layer
            length=stack_length(c),
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.dot_general, grad_dtype=self.grad_dtype, placer=self.placer, exchange=self.exchange,
          attention_chunk=self.attention_chunk, decode=self.decode, attend=self.attend)
        self.final_norm = RMSNorm(c.norm_eps, dtype, self.placer)
        if not c.tie_embeddings:
            self.logits = Head(c.vocab_size, c.init_std, dtype, self.logits_dot_general, self.grad_dtype, self.placer)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        # [B, T] -> [B, T, D]. The vocab shards' partial sums are reduced at full T, then each
        # device keeps its T shard (sequence parallelism): the all-reduce + slice that GPU/TPU
        # compilers fuse into a reduce-scatter. Left free, the partitioner was seen spreading T
        # over the idle `pipe` axis here and permuting it back (pipelined layouts).
        return constrain(constrain(self.embed(tokens), NORMED), RESIDUAL)

    def run_blocks(self, x: jax.Array, docs: Docs = None) -> tuple[jax.Array, Stats]:
        """[B, T, D] through the scanned stack; stats stacked per MoE layer ([L_moe] each)."""
        return self.layers(x, docs)

    def head(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, V] float32 logits (sampling, tests; training uses head_loss)."""
        x = gather_normed(self.final_norm(x), scatter_cotangent=False)  # the logits need every token
        logits = self.embed.attend(x) if self.cfg.tie_embeddings else self.logits(x)
        return constrain(logits, LOGITS).astype(jnp.float32)

    def head_loss(self, x: jax.Array, targets: jax.Array, loss_mask: jax.Array | None = None) -> jax.Array:
        """[B, T, D], targets [B, T] -> mean cross-entropy, never holding [B, T, V] (vocab.py).
        `loss_mask` [B, T] (packed documents): the mean over the tokens where it is nonzero."""
        x = gather_normed(self.final_norm(x), scatter_cotangent=False)
        if self.cfg.tie_embeddings:
            return self.embed.loss(x, targets, self.loss_chunk, loss_mask)
        return self.logits(x, targets, self.loss_chunk, loss_mask)

    def forward(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                positions: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        """[B, T] int token ids -> ([B, T, V] float32 logits, MoE stats per layer); packed
        documents: `segment_ids` and `positions` [B, T] (both or neither)."""
        x, stats = self.run_blocks(self.embed_tokens(tokens), _docs(segment_ids, positions))
        return self.head(x), stats

    def loss(self, tokens: jax.Array, targets: jax.Array, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None, loss_mask: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        """[B, T] inputs and targets -> (mean cross-entropy, MoE stats per layer). Packed
        documents (data.DOC_KEYS, [B, T] each): attention within each segment, rotary
        `positions`, the mean over the targets `loss_mask` keeps."""
        x, stats = self.run_blocks(self.embed_tokens(tokens), _docs(segment_ids, positions))
        return self.head_loss(x, targets, loss_mask), stats

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """[B, T] int token ids -> [B, T, V] float32 logits."""
        return self.forward(tokens)[0]


def _docs(segment_ids: jax.Array | None, positions: jax.Array | None) -> Docs:
    if (segment_ids is None) != (positions is None):
        raise ValueError("packed documents need both segment_ids and positions (or neither)")
    return None if segment_ids is None else (segment_ids, positions)


def moe_stat_shapes(c: ModelConfig, layers_per_chunk: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the stats a chunk of scanned units returns (moe.routing_stats, stacked); {} dense."""
    if not c.moe.num_experts:
        return {}
    n = layers_per_chunk
    return {"aux_loss": (n,), "z_loss": (n,), "dropped_fraction": (n,), "load": (n, c.moe.num_experts)}


def moe_loss(stats: Stats, c: ModelConfig) -> jax.Array:
    """The routers' losses added to the training loss: each weight times its mean over MoE layers
    (a mean, so that one weight means the same at any depth); 0 for a dense model."""
    if not stats:
        return jnp.zeros((), jnp.float32)
    return c.moe.aux_loss_weight * jnp.mean(stats["aux_loss"]) + c.moe.z_loss_weight * jnp.mean(stats["z_loss"])


# ----------------------------------------------------------------------------------------------
# Analytic counts


def count_params(c: ModelConfig) -> dict[str, int]:
    """Parameter counts by part, from the config (matches the initialised tree exactly)."""
    h = c.d_model // c.n_heads
    attn = c.d_model * h * (2 * c.n_heads + 2 * c.n_kv_heads)  # q, out: N*H*D; k, v: K*H*D
    n_moe = moe_layers(c)
    ffn = (c.n_layers - n_moe) * 3 * c.d_model * c.d_ff + n_moe * _moe_ffn_params(c, active=False)
    counts = {
        "embedding": c.vocab_size * c.d_model,
        "layers": c.n_layers * (attn + 2 * c.d_model) + ffn,  # + two norm scales per block
        "final_norm": c.d_model,
        "logits": 0 if c.tie_embeddings else c.d_model * c.vocab_size,
    }
    counts["total"] = sum(counts.values())
    return counts


def moe_layers(c: ModelConfig) -> int:
    return c.n_layers // c.moe.every if c.moe.num_experts else 0


def _moe_ffn_params(c: ModelConfig, active: bool) -> int:
    """One MoE FFN: router D*E, experts 3*D*F each (all E, or the k a token uses), shared experts."""
    e = c.moe
    experts = e.top_k if active else e.num_experts
    return c.d_model * e.num_experts + (experts + e.shared_experts) * 3 * c.d_model * expert_d_ff(c)


def active_params(c: ModelConfig) -> int:
    """Parameters one token uses: all but the unchosen experts (MoE FLOPs count only these)."""
    n_moe = moe_layers(c)
    return count_params(c)["total"] - n_moe * (_moe_ffn_params(c, active=False) - _moe_ffn_params(c, active=True))


def attention_share(c: ModelConfig, seq_len: int, kernel: str = "xla") -> float:
    """The attention scores' share of a layer's forward matmul FLOPs (MoE: its active experts):
    what ZB-H1's split B runs beyond a forward and its W short of one (schedules.kept_costs).
    XLA's attention computes the whole [T, T] scores (4 N H T per token), a fused kernel the
    causal half (2 N H T)."""
    h = c.d_model // c.n_heads
    scores = (4 if kernel == "xla" else 2) * c.n_heads * h * seq_len
    projections = 2 * c.d_model * h * (2 * c.n_heads + 2 * c.n_kv_heads)
    n_moe = moe_layers(c)
    ffn = ((c.n_layers - n_moe) * 6 * c.d_model * c.d_ff + n_moe * 2 * _moe_ffn_params(c, active=True)) / c.n_layers
    return scores / (projections + scores + ffn)


def flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_matmul + causal attention.

    N_matmul counts every weight that enters a matmul: the block projections and the output
    projection (the input embedding lookup is a gather in FLOP terms and is not counted, tied or
    not). In an MoE layer only the activated weights count: the router, the top-k experts and the
    shared experts (dispatch and combine are gathers; padding slots are not counted). Attention scores and values cost 12 * L * N * H * T per token for full attention (PaLM);
    we count the causal half, 6 * L * N * H * T, as MaxText and torchtitan do.
    """
    h = c.d_model // c.n_heads
    attn = c.d_model * h * (2 * c.n_heads + 2 * c.n_kv_heads)
    n_moe = moe_layers(c)
    ffn = (c.n_layers - n_moe) * 3 * c.d_model * c.d_ff + n_moe * _moe_ffn_params(c, active=True)
    n_matmul = c.n_layers * attn + ffn + c.d_model * c.vocab_size
    return 6.0 * n_matmul + 6.0 * c.n_layers * c.n_heads * h * seq_len
