"""The analytic cost of one train step per device: the shapes, memory and FLOPs (collectives.py the collectives).

Pure arithmetic on the config, no JAX. `parallax audit` sets it beside the compiled step (and the
tests hold the two together on 8 simulated devices); `parallax plan` evaluates it for every layout
at once: each function takes a `Grid` whose fields are numpy arrays (or plain ints) and broadcasts.

XLA:CPU runs bfloat16 elementwise work in float32 (`platform='cpu'` models that).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from parallax.config import Config, ModelConfig, ParallelConfig, chunk_length, expert_d_ff, moe_capacity
from parallax.parallelism import (CIRCULAR, DOTS, FULL, GPIPE, NONE, ONE_F_ONE_B, SAVE_ATTN_MLP, SAVE_ATTN_MLP_OFFLOAD,
                                  ZB_H1, buffer_slots, keeps_residuals, layout_fields, own_gradients, pipelined,
                                  reduces_once, residual_slots, ticks)

# XLA:CPU activation memory, read off 71 compiles (experiments/calibrate_cost.py: d_model, d_ff,
# layers, heads, sequence, batch, vocab and tensor varied one at a time under each remat policy
# and dtype, plus pipeline and ZeRO layouts; a model the validation tests do not use).
CPU_FULL_SAVED = 2.0  # remat=full keeps the block input twice (the scan carry and its stack)
CPU_WORKING = 0.8  # one layer's backward needs ~0.8 of its un-rematted residuals live at once
# The fused loss head's float32 [B, chunk, V/tensor] buffers at the peak (model/vocab.py): the
# logits, the exponent and the logits gradient. Kept at 3 after the fused head replaced the
# one-hot + log-softmax one: tests/test_cost_validation.py's layouts are then within 11% (the
# only one whose peak is at the head, gpipe_d2_p4_zero1_full, +7%) but d8_full_bf16 (-14.9%, set
# by XLA:CPU's bfloat16 handling, not the head; -14.7% before).
CPU_LOGITS = 3.0
F1B_WORKING = 1.5  # 1F1B: the stage vjp's backward temporaries on top of its residuals
# MoE FFN residuals per slot (D- and F-sized, activation dtype) and per token (float32 [E]-sized
# router buffers), un-rematted: see "Cost model: MoE" in BUILD_NOTES.md for the fit.
MOE_SLOT_D, MOE_SLOT_F, MOE_ROUTER, MOE_WORKING = 0.64, 5.9, 17.0, 1.5
# On accelerators, fitted on the compiled peaks of nine 1B-class layouts for v5p and H100 targets
# (`experiments/targets.py --calibration`, BUILD_NOTES.md "The cost model against the real
# compilers"): one layer's backward keeps 1.3x its un-rematted residuals live; the loss head's
# chunk is one [B, chunk, V/tensor] buffer in the compute dtype (the GEMM's output; the
# log-sum-exp work fused around it), 0.5 of the float32 unit; and the two are not live at once
# (memory_parts: the larger counts). bfloat16 activations stay bfloat16.
ACCEL_WORKING = 1.3
ACCEL_LOGITS = 0.5
# XLA:GPU (platform='gpu': what `parallax audit` passes for a GPU target and `parallax plan` for a
# GPU device), read off the heap trace at the compiled peak (analysis/heap.py; BUILD_NOTES.md
# "What the compiled peak holds"). A block's backward keeps, per token: four [., D] buffers in
# the compute dtype (the norm outputs and their gradients, full T even under sequence
# parallelism, where they are the gathered ones), six F/t-sized ones (gate/up, their gradient,
# the down-projection's input gradient), q/k/v/out and the fused kernel's statistics; an MoE FFN
# its un-rematted residuals once. FP8 keeps the layer weights converted once per step, about
# 3 bytes per layer parameter.
GPU_NORM_BUFFERS, GPU_FFN_BUFFERS, GPU_MOE_WORKING, GPU_FP8_WEIGHT_BYTES = 4, 6, 1.0, 3


@dataclass(frozen=True)
class Workload:
    """Everything but the layout: the model, the batch and the optimizer state's dtypes."""

    model: ModelConfig
    global_batch: int
    seq_len: int
    mu_dtype: str = "float32"  # optim.mu_dtype: AdamW's first moment, 4 or 2 bytes per parameter
    loss_chunk: int = ParallelConfig.loss_chunk  # parallel.loss_chunk: T positions per loss-head chunk
    attention_chunk: int = ParallelConfig.attention_chunk  # parallel.attention_chunk: query positions per block
    optimizer: str = "adamw"  # optim.name: muon keeps one moment for the blocks' kernels
    ns_steps: int = 5  # optim.muon_ns_steps: Newton-Schulz iterations per Muon update
    grad_accum: int = 1  # train.grad_accum: the step runs A microsteps of global_batch / A rows
    fp8: bool = False  # fp8.enabled (parallelism.reduces_once; ZeRO-3 gathers FP8 weights; no FP8 numerics)
    packed: bool = False  # data.eod_id >= 0: packed documents (cuDNN then takes a same-document mask)

    @classmethod
    def of(cls, cfg: Config) -> Workload:
        return cls(cfg.model, cfg.train.global_batch, cfg.train.seq_len, cfg.optim.mu_dtype, cfg.parallel.loss_chunk,
                   cfg.parallel.attention_chunk, cfg.optim.name, cfg.optim.muon_ns_steps, cfg.train.grad_accum,
                   cfg.fp8.enabled, cfg.data.eod_id >= 0)

    @property
    def microstep(self) -> Workload:
        """One microstep of train.grad_accum: B / A rows, no accumulation."""
        return dataclasses.replace(self, global_batch=self.global_batch // self.grad_accum, grad_accum=1)


def reduces_once_on(w: Workload, g: Grid) -> Any:
    """parallelism.reduces_once for every layout of `g`: the batch-axes gradient reduction once per
    step (not per microstep) under train.grad_accum."""
    moe = w.model.moe
    return reduces_once(w.grad_accum, w.fp8, bool(moe.num_experts) and moe.dispatch == "ragged", g.zero,
                        np.asarray(g.data) * np.asarray(g.expert), g.expert)


@dataclass(frozen=True)
class Grid:
    """Layout fields (parallelism.LAYOUT_FIELDS), each an int or a numpy array (all broadcast together)."""

    data: Any = 1
    tensor: Any = 1
    pipe: Any = 1
    expert: Any = 1
    zero: Any = 0
    microbatches: Any = 1
    schedule: Any = GPIPE  # index into parallelism.SCHEDULES
    repeats: Any = 1
    remat: Any = NONE  # index into parallelism.REMATS
    sequence: Any = 0  # 1: sequence parallelism (the residual stream's T sharded over tensor)
    grad_reduce: Any = 0  # index into parallelism.GRAD_REDUCE_DTYPES (parallel.grad_reduce_dtype)

    @classmethod
    def of(cls, cfg: Config, sizes: dict[str, int]) -> Grid:
        return cls(**layout_fields(cfg, sizes))  # the field names are parallelism.LAYOUT_FIELDS

    def pick(self, index: Any) -> Grid:
        return Grid(**{f.name: np.asarray(getattr(self, f.name))[index] if np.ndim(getattr(self, f.name)) else
                       getattr(self, f.name) for f in dataclasses.fields(self)})


class Dims:
    """The shape quantities every formula uses, broadcast over the grid.

    The scanned stack runs U = L / unit trips; a unit is one block, or `moe.every` blocks whose
    last one is MoE (config.stack_length). Parameter elements per device are counted per unit and
    split into expert weights (E/expert experts, F over tensor; their gradients reduce over data
    only) and the rest (attention, dense MLPs, norms, the replicated float32 router, shared experts).
    """

    def __init__(self, w: Workload, g: Grid, platform: str = "accelerator", attention: str = "xla",
                 scatter_all_reduce_group: int = 0):
        m = w.model
        self.w, self.g = w, g
        # the group whose reductions the compiler keeps whole (targets.Target.scatter_all_reduce_group)
        self.scatter_all_reduce_group = scatter_all_reduce_group
        self.D, self.L, self.N, self.K, self.F, self.V = m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size
        self.H, self.T = m.d_model // m.n_heads, w.seq_len
        self.cpu = platform == "cpu"
        self.c = 4 if (self.cpu or m.dtype == "float32") else 2  # activation bytes
        self.fp8 = w.fp8
        t, p = np.asarray(g.tensor), np.asarray(g.pipe)
        self.t, self.p = t, p
        self.d, self.ep = np.asarray(g.data), np.asarray(g.expert)
        self.dp = self.d * self.ep  # batch shards
        self.M = np.asarray(g.microbatches)
        self.r = np.asarray(g.repeats)
        self.sched, self.remat, self.zero = np.asarray(g.schedule), np.asarray(g.remat), np.asarray(g.zero)
        self.piped = pipelined(p, self.M)
        # a table schedule (1F1B, interleaved 1F1B, ZB-H1): the pipeline computes its gradients
        self.f1b = self.piped & own_gradients(self.sched)
        self.zb = self.piped & (self.sched == ZB_H1)  # the backward split: B and W each recompute
        # the table schedules keep F's residuals for B (and W) where the remat policy keeps more
        # than the unit inputs (parallelism.keeps_residuals, parallel/residuals.py): B recomputes
        # what the policy recomputes, not the chunk's forward. `attention`: the kernel the stage
        # runs, as the caller resolved it (parallelism.attention_kernel, or the audit's reading)
        self.keep = self.piped & keeps_residuals(self.sched, self.remat, attention)
        # ZB-H1 from F's residuals splits one backward by its outputs (parallel/split_backward.py):
        # B the input-gradient chain, W the weight gradients from B's stash, 1F1B's work between
        # them. Without residuals (remat full, a fused kernel under none) B and W each run the
        # chunk's VJP, and W the input-gradient chain again for its matmuls' output cotangents.
        self.zb_rerun = self.zb & ~self.keep
        self.zb_split = self.zb & self.keep  # ... and with them: the split (B's stash to W)
        # ... and under remat full and its offload they recompute the chunk from its input
        self.rerun_chunk = self.f1b & ~self.keep
        # remat full outside ZB-H1 (pipeline_1f1b's backward_by_unit): B runs the chunk's first
        # n - 1 units for their outputs (the units' inputs), then each unit's VJP recomputes it
        # again; elsewhere a rerun B is the chunk's VJP (its forward, and inside it what the
        # policy recomputes)
        self.by_unit = self.rerun_chunk & ~self.zb & (self.remat == FULL)
        self.ticks = ticks(self.sched, p, self.M, self.r)
        self.rows = w.global_batch / self.dp  # rows per batch shard
        self.tok = self.rows * self.T  # tokens per batch shard
        # the fused loss head's chunks over T, and the query rows of XLA's attention live at once
        # (attention.causal_attention's blocks): config.chunk_length, as the model reads them
        self.loss_chunks = self.T // chunk_length(w.loss_chunk, self.T)
        self.query_rows = chunk_length(w.attention_chunk, self.T)
        # MoE (model.moe): E experts of hidden Fe, top-k, S shared experts, C slots per expert and sequence.
        mo = m.moe
        self.moe = int(bool(mo.num_experts))
        self.E, self.k, self.S = mo.num_experts, mo.top_k, mo.shared_experts
        self.Fe = expert_d_ff(m) if self.moe else 0
        self.C = moe_capacity(self.T, self.E, self.k, mo.capacity_factor) if self.moe else 0
        self.unit = mo.every if self.moe and mo.every > 1 else 1  # blocks per scanned unit
        self.U = self.L / self.unit  # loop trips
        # Uneven stages: the stack is padded with identity units up to a multiple of R*P
        # (pipeline.to_stages); the padding is stored and computed like real layers.
        self.Lc = np.ceil(self.U / (self.r * p)) * self.unit  # layers per chunk (one tick of one stage)
        self.Ldev = self.Lc * self.r  # layers per device
        self.slots_tok = self.E * self.C / self.T  # expert slots per token (capacity padding included)
        self.slots = self.tok * self.slots_tok * self.D * self.c  # one device's [B/(data expert), E, C, D]
        attn = self.D * self.H * (2 * self.N + 2 * self.K)
        dense_ffn = 3 * self.D * self.F / t
        moe_rest = self.D * self.E + 3 * self.D * self.S * self.Fe / t  # router (replicated), shared experts
        self.unit_norms = 2 * self.D * self.unit
        self.unit_ne = self.unit * attn / t + self.unit_norms + (self.unit - self.moe) * dense_ffn + self.moe * moe_rest
        self.unit_ex = self.moe * self.E / self.ep * 3 * self.D * self.Fe / t  # expert wi, wo
        self.unit_t = self.unit_ne + self.unit_ex  # elements per unit per device
        self.layer_t = self.unit_t / self.unit  # per layer, averaged over the unit
        # parameter arrays per unit (one ZeRO gather each): 6 per block (2 norms, qkv, out, wi,
        # wo); an MoE block adds its router, and shared experts their wi, wo
        self.unit_arrays = 6 * self.unit + self.moe * (1 + 2 * int(self.S > 0))
        self.embed_t = self.V * self.D / t
        self.head_t = 0 if m.tie_embeddings else self.D * self.V / t
        self.outer_t = self.embed_t + self.head_t + self.D
        self.outer_arrays = 3 - int(m.tie_embeddings)  # embedding, head (untied), final norm
        # Gradient bytes on the wire over the batch axes: a matmul weight's in grad_reduce_dtype
        # (2 bytes for bfloat16 on GPU/TPU), the norm scales' and the router's in float32.
        # A pipeline stage's gradients are always float32 (see the module docstring).
        self.gb = np.where((np.asarray(g.grad_reduce) == 1) & (not self.cpu), 2, 4)
        self.gb_stage = np.where(self.piped, 4, self.gb)  # the block stack's matmul weights
        self.router = router = self.moe * self.D * self.E  # the MoE router's (float32) elements per unit
        self.unit_ne_bytes = self.gb_stage * (self.unit_ne - self.unit_norms - router) + 4 * (self.unit_norms + router)
        self.unit_ex_bytes = self.gb_stage * self.unit_ex
        # One unit's weights as pipelined ZeRO-3 gathers them (pipeline.gather_stage_weights): the
        # matmul weights cast on their shards to the compute dtype, the norm scales, the router
        # and ragged experts (grouped_param_dot reads the master) in float32. FP8: the E4M3 bits.
        ragged_ex = self.unit_ex if (self.moe and mo.dispatch == "ragged") else 0
        f32_unit = self.unit_norms + router + ragged_ex
        self.unit_stage_gather = np.where(self.fp8, self.unit_t + 3 * (self.unit_norms + router),
                                          self.c * (self.unit_t - f32_unit) + 4 * f32_unit)
        self.params_t = self.Ldev * self.layer_t + self.outer_t  # tensor-, expert- and pipe-sharded
        self.act = self.tok * self.D * self.c  # one [B/dp, T, D] buffer
        self.act_m = self.act / self.M
        # Sequence parallelism: the residual stream (and what is saved or sent of it) is [B/dp, T/t, D].
        self.sp = (np.asarray(g.sequence) != 0) & (t > 1)
        self.sp_t = np.where(self.sp, t, 1)
        # ... on D (parallel.sequence_parallel_dim='embed'): the same gathers and reduce-scatters and
        # memory; a norm's mean of squares is a partial sum over tensor ([B, T] float32 all-reduces)
        self.sp_embed = self.sp & (np.asarray(g.sequence) == 2)
        self.sp_t_embed = np.where(self.sp_embed, t, 1)
        self._runs()

    def _runs(self) -> None:
        """How often the block stack runs in one step, and the buffers one call of it sees.

        Unpipelined: L layers once; GPipe/circular: every tick runs a chunk (bubble ticks compute
        too); 1F1B: conditional branches (lax.cond), M busy ticks of `ticks`, and the HLO counts
        each branch on every tick (`static_scale`).

        `halves` must follow pipeline.run_pipeline's `tick`, which runs a GPipe/circular tick as
        two half-microbatches (twice the calls, half the bytes) when its rows (rows / M per batch
        shard) are even and `split = not fp8.scales_each_use(model.dot_general)`. This model does
        not see FP8: under the `current` recipe the pipeline keeps whole microbatches and
        `halves` overcounts calls (same bytes per tick).
        """
        piped, f1b, M = self.piped, self.f1b, self.M
        self.layers_run = np.where(piped, self.ticks * self.Lc, self.L)
        self.busy_layers = np.where(f1b, M * self.Ldev, self.layers_run)  # every chunk on every microbatch
        self.units_run, self.busy_units = self.layers_run / self.unit, self.busy_layers / self.unit
        # unit calls a remat policy recomputes in: every run (a table schedule's busy ones)
        self.policy_runs = np.where(f1b, self.busy_units, self.units_run)
        self.units_dev = self.Ldev / self.unit  # units stored per device
        self.static_scale = np.where(f1b, self.ticks / (M * self.r), 1)
        self.halves = np.where(piped & ~f1b & ((self.rows / M) % 2 == 0), 2, 1)
        self.act_run = np.where(piped, self.act_m, self.act)  # one block call's [B/dp (/M), T, D]
        self.slots_run = np.where(piped, self.slots / M, self.slots) / self.halves  # one MoE call's slots
        # MoE layer calls per step, and those recomputed (any remat policy; 1F1B's stage vjp)
        self.moe_calls = self.moe * self.busy_units * self.halves
        # (ZB-H1 recomputing the chunk: in B and again in W; from F's residuals its B recomputes
        # what the policy does, once, as 1F1B's)
        self.moe_recalls = self.moe * np.where(
            self.rerun_chunk, (1 + self.zb) * M * self.Ldev / self.unit,
            np.where(self.remat != NONE, self.policy_runs, 0)) * self.halves


def optimizer_bytes_per_param(w: Workload, block: bool = False) -> int:
    """The optimizer state per parameter element: AdamW's first moment (optim.mu_dtype) and float32
    second moment, 8 bytes (6 with a bfloat16 first moment); Muon's momentum alone (optim.mu_dtype)
    for a block parameter (`block`) under optim.name=muon. The blocks' norm scales and routers
    take AdamW there too, counted as Muon's: under 0.1% of a block's parameters."""
    mu = 2 if w.mu_dtype == "bfloat16" else 4
    return mu if block and w.optimizer == "muon" else mu + 4


def _newton_schulz_flops(m: Any, n: Any, steps: int) -> Any:
    """One [m, n] matrix through optax's Newton-Schulz iterations: per step X X^T (2 a^2 b), the
    polynomial's A A (2 a^3) and its product with X (2 a^2 b), a = min(m, n), b = max(m, n)."""
    a, b = np.minimum(m, n), np.maximum(m, n)
    return steps * (4 * a * a * b + 2 * a ** 3)


def optimizer_flops_per_device(w: Workload, g: Grid) -> Any:
    """FLOPs of the optimizer update on one device per step: Muon's Newton-Schulz iterations
    (AdamW's elementwise pass is not counted). The blocks' matrices per unit (optim.muon_dimensions):
    q/k/v as N/K + 2 slots of [D, K H], the attention output [N H, D], the MLP's gate, up and
    output, each expert's three; spread over the devices the state is sharded over
    (optim.muon_shardings: the stages' own layers, tensor, data under ZeRO, the experts over
    `expert`), which assumes the layer stack divides them."""
    s = Dims(w, g)
    if w.optimizer != "muon":
        return 0.0 * s.tok
    ns = lambda m, n: _newton_schulz_flops(m, n, w.ns_steps)  # noqa: E731
    attention = (s.N // s.K + 2) * ns(s.D, s.K * s.H) + ns(s.N * s.H, s.D)
    dense, expert = 3 * ns(s.D, s.F), 3 * ns(s.D, s.Fe)
    spread = s.t * np.where(s.zero >= 1, s.d, 1)
    unit = (s.unit * attention + (s.unit - s.moe) * dense + s.moe * s.S * expert) / spread \
        + s.moe * s.E / s.ep * expert / spread
    return s.units_dev * unit


def memory_platform(jax_platform: str) -> str:
    """The `platform` memory_parts takes for a compiled program's JAX platform: XLA:CPU's fit, XLA:GPU's
    terms (cost.GPU_*), or the accelerator fit (a TPU)."""
    return {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(jax_platform, "accelerator")


def memory_parts(w: Workload, g: Grid, platform: str = "accelerator", attention: str = "xla") -> dict[str, Any]:
    """Bytes per device at the peak (the start of the backward pass), by part.

    train.grad_accum = A: one microstep's (B / A rows) activations, plus the float32 accumulator
    of train_step.accumulate laid out as the parameters (an unreduced [n, ...] carry over the
    batch shards holds the same bytes per device), and the whole step's batch.

    `platform`: 'cpu' (XLA:CPU's fit), 'gpu' (XLA:GPU's terms read off its heap traces, cost.GPU_*:
    what `parallax audit` uses for a GPU target and `parallax plan` for a GPU device), 'accelerator'
    (the fit over v5p and H100 that both use for a TPU).

    `attention`: 'xla' is what parallax compiles today (jax.nn.dot_product_attention's XLA path
    keeps the [N, T, T] scores, their exponent and the probabilities); 'fused' (or the kernel's
    name, 'cudnn', 'splash') a flash-style kernel that keeps one float32 log-sum-exp per head and
    token; 'cudnn' with packed documents also keeps their [b, 1, T, T] mask (`document_mask`).
    """
    if w.grad_accum > 1:
        parts = memory_parts(w.microstep, g, platform, attention)
        s = Dims(w, g, platform, attention)
        parts["accumulator"] = 4 * s.params_t / np.where(s.zero == 3, s.d, 1)
        parts["batch"] = parts["batch"] * w.grad_accum
        parts["total"] = parts["total"] + parts["accumulator"] + parts["batch"] * (1 - 1 / w.grad_accum)
        return parts
    s = Dims(w, g, platform, attention)
    c, D, F, H, N, K, T, t = s.c, s.D, s.F, s.H, s.N, s.K, s.T, s.t
    dshard = s.d  # ZeRO shards over data only (sharding.make_rules), experts or not
    params = 4 * s.params_t / np.where(s.zero == 3, dshard, 1)
    # AdamW's two moments per parameter: mu in optim.mu_dtype (4 or 2 bytes), nu always float32;
    # Muon's blocks one
    opt = (optimizer_bytes_per_param(w, block=True) * s.Ldev * s.layer_t + optimizer_bytes_per_param(w) * s.outer_t
           ) / np.where(s.zero >= 1, dshard, 1)
    # ZeRO-1 outside a pipeline: the backward loop slices each layer's reduced gradient to the
    # 1/data shard the update needs (the loop's output stacks are 1/data in the compiled step).
    layer_grads = 4 * s.Ldev * s.layer_t / np.where((s.zero == 3) | ((s.zero == 1) & ~s.piped), dshard, 1)
    grads = layer_grads + 4 * s.outer_t / np.where(s.zero == 3, dshard, 1)
    heads = N / t
    # bool mask + 3 float32 per score of the live query rows (all T, or one block: then, with
    # remat none, counted once per layer though the checkpointed block keeps none) / log-sum-exp
    scores = heads * s.query_rows * 13 if attention == "xla" else heads * 4
    # Residuals of one un-rematted block per token (jax.ad_checkpoint.print_saved_residuals):
    # x, x after attention, 2 x (normed float32 + scaled) ; q, k, v, attention output; 6 F-sized.
    # Sequence parallelism (sp_t = t, else 1): the residual-stream buffers are T-sharded, but the
    # two norm outputs the column-parallel matmuls keep are the all-gathered, full-T ones.
    sp_t = s.sp_t
    attn_none = D * (c + 2 * 4) / sp_t + 2 * D * c + (2 * N + 2 * K) * H / t * c + scores
    # x and the attention output (the MLP output feeds only the residual add, whose backward needs
    # no values: compiled for h100-8, h100-16 and v5p-32, two [B, T, D] stacks per layer); qkv
    attn_dots = 2 * D * c / sp_t + (N + 2 * K) * H / t * c
    # An MoE FFN per token: its slots (E C / T per token, capacity padding included) each keep
    # D- and F-sized buffers, the router float32 [E]-sized ones; shared experts as a dense MLP.
    moe_none = (s.slots_tok * (MOE_SLOT_D * D + MOE_SLOT_F * s.Fe / t) * c + MOE_ROUTER * s.E * 4
                + s.k * D * c + 6 * s.S * s.Fe / t * c)  # + the combine's [T, k, D] picked outputs
    moe_dots = s.E * 4 + 2 * s.S * s.Fe / t * c  # router logits, shared gate/up (expert matmuls are batched)
    dense = s.unit - s.moe  # dense blocks per unit
    none = s.unit * attn_none + dense * 6 * F / t * c + s.moe * moe_none  # per unit
    dots = s.unit * attn_dots + dense * 2 * F / t * c + s.moe * moe_dots  # gate/up
    full = D * c * (CPU_FULL_SAVED if s.cpu else 1.0) / sp_t  # the unit's input
    # save_attn_mlp (transformer.REMAT_POLICIES): the unit's input, and per block the attention
    # output after its projection ([B, T, D], T-sharded under sequence parallelism) and the MLP's
    # gate/up ([B, T, 2, F/t]); an MoE block's experts' gate/up per slot and its shared experts'.
    names = (s.unit * D * c / sp_t + dense * 2 * F / t * c
             + s.moe * (s.slots_tok * 2 * s.Fe / t + 2 * s.S * s.Fe / t) * c)
    offload = s.remat == SAVE_ATTN_MLP_OFFLOAD  # ... those kept in pinned host memory instead
    saved_tok = np.select([s.remat == NONE, s.remat == FULL, s.remat == DOTS, s.remat == SAVE_ATTN_MLP],
                          [none, full, dots, full + names], full) / s.unit  # per layer
    if not s.cpu and w.model.dtype != "float32":  # bfloat16 copies of the weights kept per layer
        # (unpipelined ZeRO-3: those copies are the gathered weights, counted in `gathered`)
        saved_layer = np.where((s.remat == NONE) & ~((s.zero == 3) & ~s.piped), 2 * (s.layer_t - 2 * D), 0)
    else:
        saved_layer = 0
    tok_m = s.tok / s.M
    vocab_t = s.V / t
    # Saved activations. Plain: every layer once. GPipe/circular: every tick's chunk residuals
    # until the backward loop. Table schedules: the tick loop's buffers (schedules.buffer_slots:
    # 1F1B about 2P stage inputs, interleaved vP + P chunk inputs, ZB-H1 2P + 1), one stage's
    # residuals (Lc layers) while its vjp runs, and the gradient accumulators carried through the
    # tick loop. (Stage 0 embeds each microbatch in its tick: no [M, B/M, T, D] embedding output
    # or input cotangent is kept for the step.)
    plain_saved = s.L * (s.tok * saved_tok + saved_layer)
    # The circular schedule slices its chunk's weights per tick; without a remat policy the
    # backward keeps each slice (pipeline.stage_fn).
    chunk_slices = np.where((s.sched == CIRCULAR) & (s.remat == NONE), 4 * s.Lc * s.layer_t, 0)
    gpipe_saved = s.ticks * (s.Lc * (tok_m * saved_tok + saved_layer) + chunk_slices)
    # Table schedules: the tick loop's input and cotangent buffers (schedules.buffer_slots)
    slots = buffer_slots(s.sched, s.p, s.M, s.r)
    # Beside them, the tick's weight gradients: the tables' and its chunk's, the whole chunk's from
    # one VJP (interleaved: 1/v of the stage's; Llama-2-70B at v 5 on h100-64 holds no stage-sized
    # copy), one unit's under remat full (pipeline_1f1b.backward_by_unit adds each into the
    # accumulator).
    by_unit = s.f1b & ~s.zb & (s.remat == FULL)
    tick_grad = 4 * s.outer_t + 4 * np.where(by_unit, s.unit_t, s.Lc * s.layer_t)
    # Pipelined ZeRO-3 accumulates the stage's gradients over the ticks in float32 on the gathered
    # weights, reduce-scattered once after the loop (ZeRO-1's accumulator is `gradients`): in the
    # table schedules' tick loop, through the whole step; GPipe's and circular's backward loop
    # only (in `work` below: Llama-3-405B, circular on h100-16384, holds 12.2 GiB of them there)
    stage_acc = np.where(s.piped & (s.zero == 3), 4 * s.Ldev * s.layer_t, 0)
    # The chunk residuals: one chunk's while its B's vjp runs, or (`keep`: B from F's residuals,
    # parallel/residuals.py) every F's from its tick to its B's (schedules.residual_slots) and
    # the tick's F's own before it enters its slot (a conditional's result is a buffer of its own;
    # XLA:CPU, 6 layouts of 1F1B and interleaved under none, dots and save_attn_mlp: -3% to +4%)
    chunk_res = np.where(s.keep, residual_slots(s.sched, s.p, s.M, s.r) + 1, 1) * tok_m * saved_tok
    # ZB-H1's split backward (Dims.zb_split): B hands W its weight matmuls' output
    # cotangents (split_backward.py), per layer and token: the attention's q/k/v and output
    # projection's, the MLP's gate/up and down (the last two row-parallel outputs' T-sharded under
    # sequence parallelism, as B's program leaves them: W gathers them again, collectives.py), an
    # MoE block's per slot, its router logits' (float32) and shared experts'. Kept per residual
    # slot, with an idle B's trash slot and the B's own result before it enters its slot.
    # FP8: W's dots read the E5M2 cotangents B quantised for its own (fp8._dot_bwd): 1 byte. Where
    # the policy recomputes the attention (dots, save_attn_mlp) W reads the output projection's
    # input from the stash too, in the compute dtype (split_backward._widens). FP8 under dots: the
    # policy saves no FP8 matmul's output (a custom_vjp is opaque to it), so W reads the MLP
    # norm's output (T-sharded under SP) and the down projections' inputs from the stash as well.
    cq = np.where(s.fp8, 1, c)
    attn_in = np.where(s.remat != NONE, N * H / t * c, 0)
    fp8_dots = s.fp8 & (s.remat == DOTS)
    stash_tok = (s.unit * ((2 * D / sp_t + (N + 2 * K) * H / t) * cq + attn_in + fp8_dots * D / sp_t * c)
                 + dense * (2 * cq + fp8_dots * c) * F / t
                 + s.moe * (s.slots_tok * ((2 * cq + fp8_dots * c) * s.Fe / t + D * cq) + s.E * 4
                            + s.S * ((2 * cq + fp8_dots * c) * s.Fe / t + D * cq))) / s.unit
    stash = np.where(s.zb_split, residual_slots(s.sched, s.p, s.M, s.r) + 2, 0) * tok_m * stash_tok
    f1b_saved = slots * tok_m * D * c / sp_t + s.Lc * (chunk_res + stash + saved_layer) + tick_grad + stage_acc
    activations = np.where(s.f1b, f1b_saved, np.where(s.piped, gpipe_saved, plain_saved))
    # save_attn_mlp: the unit whose backward runs at the peak holds its names in the working set
    # below (its un-rematted residuals), so they count once (measured on XLA:CPU: the compiled
    # step's temporaries over remat=full's are (L-1)/L of every layer's names, within 5%). The
    # offload variant keeps two units' names on the device: the slice written back to the host
    # and the one read ahead for the backward (TPU v5e compile: more, see BUILD_NOTES.md).
    unit_tok = np.where(s.piped, tok_m, s.tok)
    activations = activations + np.select([s.remat == SAVE_ATTN_MLP, offload], [-unit_tok, 2 * unit_tok], 0) * names
    # Working set: one unit's backward needs about its un-rematted residuals at once (a whole
    # chunk of them inside a pipeline tick); a 1-layer chunk compiles without an inner loop and
    # its residuals are the working set itself.
    # The circular schedule under a remat policy slices each unit's weights inside its
    # checkpoint (pipeline.stage_fn): one more unit's residuals are live (fitted on three
    # compiles: L4/D48, L4/D96, L8/D48 on data 2 x tensor 2 x pipe 2, within 13%).
    sliced = (s.sched == CIRCULAR) & (s.r > 1) & (s.remat != NONE)
    work_tok = np.where(s.piped & ~s.f1b, (s.Lc / s.unit + sliced) * tok_m,
                        np.where(s.f1b, np.where(s.Lc > 1, tok_m, 0), s.tok))
    # (an MoE FFN's backward keeps more than its residuals live: its own factor, fitted)
    moe_work = s.moe * moe_none * ((MOE_WORKING if s.cpu else ACCEL_WORKING) - (CPU_WORKING if s.cpu else ACCEL_WORKING))
    work = (CPU_WORKING if s.cpu else ACCEL_WORKING) * np.where(s.f1b, F1B_WORKING, 1.0) * work_tok * none
    work = work + np.where(s.f1b, F1B_WORKING, 1.0) * work_tok * moe_work
    # XLA:GPU's own terms where its traces were read: cuDNN's attention, not the table schedules
    # (Llama-3-8B on h100-64 with XLA's blockwise attention: the accelerator fit -1%, these -11%)
    gpu = (platform == "gpu") & ~s.f1b & (attention != "xla")
    gpu_unit = (s.unit * (GPU_NORM_BUFFERS * D * c + (2 * N + 2 * K) * H / t * c + scores)
                + dense * GPU_FFN_BUFFERS * F / t * c + s.moe * GPU_MOE_WORKING * moe_none)
    # a pipeline tick's backward walks its chunk one unit at a time (the flagship's h100-64 trace:
    # one BlockGroup's buffers live, not the chunk's)
    gpu_tok = np.where(s.piped, (1 + sliced) * tok_m, work_tok)
    # ... and beside it (the flagship's trace, GPipe on h100-64): the chunk's float32 weight
    # gradients stacked per layer by the tick's backward loop, the tick's saved inputs read back
    # from the step's buffer, and the stack outputs' [M, B/M, T, D] cotangent with the loop's copy
    gpu_tick = 4 * s.Lc * s.layer_t + gpipe_saved / s.ticks + 2 * c * s.tok * D / sp_t
    work = np.where(gpu, gpu_tok * gpu_unit + np.where(s.piped, gpu_tick, 0), work)
    work = work + np.where(s.f1b, 0, stage_acc)
    logits_k = CPU_LOGITS if s.cpu else ACCEL_LOGITS
    # The fused loss head (model/vocab.py) holds one chunk of T of the whole shard's rows (GPipe,
    # plain) or of one microbatch's (1F1B); the embedding is a gather (no [B, T, V] input).
    head_tok = np.where(s.f1b, tok_m, s.tok) / s.loss_chunks
    logits = logits_k * head_tok * vocab_t * 4
    # XLA:GPU: the head kernel's compute-dtype copy is live beside the chunk
    head_kernel = s.embed_t if w.model.tie_embeddings else s.head_t
    logits = logits + np.where(gpu, c * head_kernel, 0)
    if s.cpu and w.model.dtype != "float32":
        # XLA:CPU, bfloat16: the head's logits gradient gets a float32 copy for its weight-gradient
        # dot (layers.weight_grad_dot's upcast: it cannot run bf16 x bf16 -> f32), and the
        # embedding's float32 cotangent for its scatter-add (vocab.param_take) was seen live at
        # the peak (d8_full_bf16 of tests/test_cost_validation.py: +24 KiB = 2 x [B, T, D] f32).
        # On accelerators the scatter runs at the end of the backward pass, after the peak.
        logits = logits + head_tok * vocab_t * 4 + np.where(s.f1b, tok_m, s.tok) * D * 4
    if not s.cpu:
        # The accelerator compilers free the head's chunk before the blocks' backward pass: the
        # peak holds one or the other (calibrated: ACCEL_WORKING); XLA:CPU's holds both (CPU_LOGITS)
        head_peak = logits > work
        work, logits = np.where(head_peak, 0.0, work), np.where(head_peak, logits, 0.0)
    # ZeRO-3 with the `none` policy keeps every gathered layer for the backward pass on XLA:CPU
    # (see above; in the compute dtype: the matmul weights are cast before their gather,
    # constrain_param); XLA:TPU gathers them again in the backward pass instead (compiled for
    # v5e-8: twice the gathers, collectives._zero_gather_terms), so holds none of them
    gathered = np.where((s.zero == 3) & (s.remat == NONE) & ~s.piped & s.cpu, c * s.L * s.layer_t, 0)
    # pipelined ZeRO-3: each stage's gathered weights (Dims.unit_stage_gather; FP8's as calibrated
    # before its bits were gathered) and the tables: float32 (GPipe, circular), or in the compute
    # dtype where the table schedules carry them into the tick loop (pipeline_tables.carried_tables)
    stage = np.where(s.fp8, 4 * s.Ldev * s.layer_t, s.Ldev / s.unit * s.unit_stage_gather)
    # (XLA:GPU, GPipe and circular: only the head's float32 table or its gradient is live at the
    # peak; the embedding's is used before the loops and its gradient is a scatter-add after them:
    # 1B GPipe ZeRO-3 on h100-16 and Llama-3-405B on h100-16384, read off their traces)
    tables = np.where(s.f1b, s.c * s.outer_t, 4 * np.where(gpu, s.head_t, s.outer_t))
    gathered = gathered + np.where((s.zero == 3) & s.piped, stage + tables, 0)
    # ... and outside a pipeline one unit's full-size expert-weight gradient before and after
    # its all-reduce, plus (remat) the unit's experts gathered again. Dense weights do the same,
    # but the dense calibration (CPU_WORKING) absorbed that part; only the MoE fit needed it.
    gathered = gathered + np.where((s.zero == 3) & ~s.piped, 4 * s.unit_ex * (2 + (s.remat != NONE)), 0)
    batch = 2 * w.global_batch / s.dp * T * 4
    # Packed documents into cuDNN (model/kernels.py): the same-document mask [b, 1, T, T] as a bool
    # and as the bias cuDNN reads (compute dtype), one of each for every layer (they depend on the
    # segment ids only); b = the rows of one kernel call: the batch shard's, a microbatch's when
    # pipelined. Compiled for h100-8 (data 8, 2 layers, bf16, remat full): +25.5 MiB temporaries
    # at 2 rows x T 2,048 against this term's 24 MiB; remat none +23.7.
    mask_rows = np.where(s.piped, s.rows / s.M, s.rows)
    mask = (c + 1) * mask_rows * T * T if (w.packed and attention == "cudnn") else 0.0 * params
    # XLA:GPU: the embedding's float32 gradient (a scatter-add after the blocks' backward) is not
    # live at the peak; unpipelined ZeRO-3 holds the head kernel's float32 gradient whole before its
    # reduce-scatter; FP8 the layer weights converted once per step
    grads = grads - np.where(gpu & (not w.model.tie_embeddings), 4 * s.embed_t / np.where(s.zero == 3, dshard, 1), 0)
    grads = grads + np.where(gpu & ~s.piped & (s.zero == 3), 4 * s.head_t * (1 - 1 / dshard), 0)
    gathered = gathered + np.where(gpu & w.fp8, GPU_FP8_WEIGHT_BYTES * s.Ldev * s.layer_t, 0)
    parts = {"params": params, "optimizer": opt, "gradients": grads, "activations": activations,
             "working": work, "logits": logits, "gathered": gathered, "batch": batch * np.ones_like(params),
             "document_mask": mask * np.ones_like(params)}
    parts["total"] = sum(parts.values())
    # Not device memory: save_attn_mlp_offload's residuals in pinned host memory (every layer's;
    # a pipeline's as its device-side ones would be)
    host_tok = np.where(offload, names / s.unit, 0)
    parts["host"] = np.where(s.f1b, s.Lc * tok_m, np.where(s.piped, s.ticks * s.Lc * tok_m, s.L * s.tok)) * host_tok
    return parts


def model_flops_per_step(w: Workload) -> float:
    """The MFU numerator: 6 N + causal attention per token (transformer.py), times tokens per step."""
    from parallax.model.transformer import flops_per_token  # counts only; transformer.py's convention is the one logged

    return flops_per_token(w.model, w.seq_len) * w.global_batch * w.seq_len


def _forward_flops(s: Dims, attention: str) -> tuple[Any, Any, Any, Any]:
    """A unit's forward matmul FLOPs per token (over tensor): (the scores' coefficient, the last
    matmul's, the experts', the whole unit's)."""
    attn = {"xla": 4, "none": 0}.get(attention, 2)  # "none": without the scores (audit: a kernel's share)
    wo = 2 * s.F * s.D  # the last matmul: its output is dead in a recomputation (XLA drops it)
    block = 2 * s.D * s.H * (2 * s.N + 2 * s.K) + attn * s.N * s.H * s.T  # per token: projections, scores
    dense = 4 * s.D * s.F + wo
    # MoE: the experts compute on all E C slots of a sequence, full or not (capacity padding
    # counts); the float32 router and the combine's weighted sum are not split over tensor.
    experts = s.slots_tok * 6 * s.D * s.Fe
    moe = experts + 6 * s.D * s.S * s.Fe
    return attn, wo, experts, s.unit * block + (s.unit - s.moe) * dense + s.moe * moe


def hardware_flops_per_device(w: Workload, g: Grid, attention: str = "xla") -> dict[str, Any]:
    """FLOPs one device executes per step, by part (what sets its compute time).

    Blocks: split over every axis; remat=full and 1F1B recompute the block forward (+1/3); the
    GPipe/circular bubble ticks compute on zeros. The loss head (the embedding is a gather) is
    replicated over `pipe`: every stage runs it on its batch shard.
    XLA's attention computes the whole [T, T] score matrix and masks it (12 N H T per token and
    layer); a fused causal kernel skips the masked half (6 N H T, the model-FLOPs convention).
    The optimizer: Muon's Newton-Schulz iterations (optimizer_flops_per_device).
    """
    s = Dims(w, g, attention=attention)
    attn, wo, experts, fwd = _forward_flops(s, attention)
    moe_replicated = s.moe * (2 * s.D * s.E + 2 * s.k * s.D)
    dead = np.where(s.moe, 2 * s.S * s.Fe * s.D, wo)  # the unit's last matmul (shared experts' wo)
    # remat=full recomputes each unit's forward but its last matmul; 1F1B recomputes the stage
    # from its input, which needs every unit's output but the chunk's last; `dots` recomputes
    # the batched expert matmuls (it keeps only matmuls without batch dimensions).
    # save_attn_mlp (and its offload) keeps each block's attention output and gate/up: it
    # recomputes q/k/v and the attention (the output projection's weight gradient needs the
    # kernel's output), the dense MLPs' output projection but the unit's last (dead), and in an
    # MoE block the experts' output projection (the combine's backward needs their outputs).
    saved = s.unit * (2 * s.D * s.H * (s.N + 2 * s.K) + attn * s.N * s.H * s.T) + (s.unit - 1) * wo \
        + s.moe * s.slots_tok * 2 * s.D * s.Fe
    # Per unit, what B (and ZB-H1's W) compute again (Dims.rerun_chunk, Dims.by_unit):
    #   - what the remat policy recomputes, in every B (and, recomputing the chunk, ZB-H1's W);
    #   - recomputing the chunk: its forward from its input, the last unit's dead matmul dropped
    #     (ZB-H1: in B and again in W); under remat full outside ZB-H1, the first n - 1 of the
    #     chunk's n units, whose outputs are the next units' inputs;
    #   - ZB-H1 recomputing the chunk: W runs the input-gradient chain again (the weights'
    #     gradients of a unit need the cotangent of its output), about 1 fwd (a unit's
    #     input-gradient matmuls cost its forward's). From F's residuals the backward is split
    #     (Dims.zb_rerun): B and W together are 1F1B's B.
    # (Compiled for h100-8, 1F1B remat full at 4 and 8 layers per stage: -19% and -18% FLOPs when
    # a rerun B was counted as one forward of the chunk and no more: 2026-12-07.)
    n = s.Lc / s.unit  # units per chunk
    # (under remat full a one-unit chunk's forward is dead in its VJP, its input the one residual)
    chunk_fwd = np.where((s.remat == FULL) & (n == 1), 0, fwd - dead / n)
    stage_rerun = np.where(s.by_unit, fwd * (n - 1) / n, (1 + s.zb) * chunk_fwd)
    policy = np.select([s.remat == FULL, s.remat == DOTS, s.remat >= SAVE_ATTN_MLP], [fwd - dead, s.moe * experts, saved], 0)
    recompute = np.where(s.rerun_chunk, stage_rerun, 0) + policy * (1 + s.zb_rerun) + s.zb_rerun * fwd
    # attention in query blocks (parallel.attention_chunk): each block is checkpointed, so its
    # scores and values are computed once more in the backward pass, under any remat policy
    recompute = recompute + (s.query_rows < s.T) * s.unit * attn * s.N * s.H * s.T
    busy = np.where(s.piped & ~s.f1b, s.ticks / (s.r * s.M), 1.0)  # bubble ticks run the stage too
    rerun = np.where(s.rerun_chunk | (s.remat == FULL) | (s.remat >= SAVE_ATTN_MLP), 1, 0)  # router, combine
    units = s.Ldev / s.unit
    blocks = s.tok * units * ((3 * fwd + recompute) / s.t + (3 + rerun) * moe_replicated) * busy
    # the fused loss head: logits forward, again in the backward (vocab.fused_cross_entropy
    # recomputes them behind a barrier), the input and the weight gradients; 1F1B's compiled
    # head (forward and backward in one branch per tick) holds one logits matmul fewer. The
    # embedding is a gather and its gradient a scatter-add: no matmul FLOPs.
    head = s.tok * np.where(s.f1b, 6, 8) * s.D * s.V / s.t
    embed = 0.0 * s.tok
    optimizer = optimizer_flops_per_device(w, g) * np.ones_like(blocks)  # Muon's Newton-Schulz
    return {"blocks": blocks, "head": head * np.ones_like(blocks), "embedding": embed * np.ones_like(blocks),
            "optimizer": optimizer, "total": blocks + head + embed + optimizer}
