"""The analytic cost of one train step per device: collectives, memory and FLOPs.

Pure arithmetic on the config, no JAX. `parallax audit` sets it beside the compiled step (and the
tests hold the two together on 8 simulated devices); `parallax plan` evaluates it for every layout
at once: each function takes a `Grid` whose fields are numpy arrays (or plain ints) and broadcasts.

What it models is parallax's own program, not an idealised one:
- tensor: per block 2 all-reduces of [B/(data expert), T, D] forward and 2 backward (one more
  with remat=full: the recomputed attention output); the vocab-parallel embedding all-reduces
  once forward, the logits projection once backward, the cross-entropy 3 [B, T] float32 rows.
  Sequence parallelism: each of those activation all-reduces is an all-reduce + T-slice on
  XLA:CPU, a reduce-scatter (result 1/t) on GPU/TPU; 2 all-gathers per block each way (more
  when recomputed), one before the head, one of the embedding's cotangent; the norm scales'
  partial gradients; pipe sends and psums carry 1/t.
- data: the gradient all-reduce moves the tensor-sharded parameter bytes, per layer inside the
  backward loop, or once after the tick loop when pipelined: matmul-weight gradients in
  `parallel.grad_reduce_dtype` (layers.param_matmul; float32 on XLA:CPU, which promotes bf16
  collectives, and inside a pipeline, whose stage gradients are reduced as the float32 master's
  cotangent where the shard_map is transposed), norm scales and the MoE router in float32; ZeRO-1 all-gathers the
  updated parameters once; ZeRO-3 gathers each layer's weights forward (and again backward when a
  remat policy recomputes them), the embedding, head and final norm once.
- pipe: GPipe/circular send two half-microbatches per tick forward and two in the transpose,
  1F1B one microbatch each way per tick; one psum of the stack output forward and backward (1F1B:
  of the input cotangents and of the head gradients).
- expert (MoE): per MoE layer 2 all-to-alls of one device's [B/(data expert), E, C, D] slots
  forward and 2 backward (2 more when a remat policy recomputes the layer); over tensor the expert
  output [E/ep, B/data, C, D] is all-reduced (forward, and its input gradient backward); expert
  weights reduce their gradients over `data` only, everything else over (data, expert). ZeRO
  shards over `data` only (sharding.make_rules: `embed` -> data), never over `expert`.
Byte figures follow audit.py: the result buffer of one execution on one device. XLA:CPU runs
bfloat16 elementwise work and collectives in float32 (`platform='cpu'` models that).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from parallax.config import Config, ModelConfig, expert_d_ff

SCHEDULES = ("gpipe", "circular", "1f1b")
REMATS = ("none", "full", "dots")
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")  # config.GRAD_REDUCE_DTYPES, in this order
GPIPE, CIRCULAR, ONE_F_ONE_B = range(3)
NONE, FULL, DOTS = range(3)

# XLA:CPU activation memory, read off 71 compiles (experiments/calibrate_cost.py: d_model, d_ff,
# layers, heads, sequence, batch, vocab and tensor varied one at a time under each remat policy
# and dtype, plus pipeline and ZeRO layouts; a model the validation tests do not use).
CPU_FULL_SAVED = 2.0  # remat=full keeps the block input twice (the scan carry and its stack)
CPU_WORKING = 0.8  # one layer's backward needs ~0.8 of its un-rematted residuals live at once
CPU_LOGITS = 3.0  # logits, their softmax and gradient: ~3 float32 [B, T, V/tensor] buffers
F1B_WORKING = 1.5  # 1F1B: the stage vjp's backward temporaries on top of its residuals
# MoE FFN residuals per slot (D- and F-sized, activation dtype) and per token (float32 [E]-sized
# router buffers), un-rematted: see "Cost model: MoE" in BUILD_NOTES.md for the fit.
MOE_SLOT_D, MOE_SLOT_F, MOE_ROUTER, MOE_WORKING = 0.64, 5.9, 17.0, 1.5
# On accelerators (the planner; not measured here, no GPU run): one layer's residuals as the
# working set, the same logits buffers, bfloat16 activations stay bfloat16.
ACCEL_WORKING = 1.0
ACCEL_LOGITS = 3.0


@dataclass(frozen=True)
class Workload:
    """Everything but the layout: the model and the batch."""

    model: ModelConfig
    global_batch: int
    seq_len: int

    @classmethod
    def of(cls, cfg: Config) -> Workload:
        return cls(cfg.model, cfg.train.global_batch, cfg.train.seq_len)


@dataclass(frozen=True)
class Grid:
    """Layout fields, each an int or a numpy array (all broadcast together)."""

    data: Any = 1
    tensor: Any = 1
    pipe: Any = 1
    expert: Any = 1
    zero: Any = 0
    microbatches: Any = 1
    schedule: Any = GPIPE  # index into SCHEDULES
    repeats: Any = 1
    remat: Any = NONE  # index into REMATS
    sequence: Any = 0  # 1: sequence parallelism (the residual stream's T sharded over tensor)
    grad_reduce: Any = 0  # index into GRAD_REDUCE_DTYPES (parallel.grad_reduce_dtype)

    @classmethod
    def of(cls, cfg: Config, sizes: dict[str, int]) -> Grid:
        p = cfg.parallel
        return cls(sizes["data"], sizes["tensor"], sizes["pipe"], sizes["expert"], p.zero, p.microbatches,
                   SCHEDULES.index(p.schedule), p.repeats, REMATS.index(p.remat), int(p.sequence_parallel),
                   GRAD_REDUCE_DTYPES.index(p.grad_reduce_dtype))

    def pick(self, index: Any) -> Grid:
        return Grid(**{f.name: np.asarray(getattr(self, f.name))[index] if np.ndim(getattr(self, f.name)) else
                       getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass(frozen=True)
class Term:
    """One family of collectives the model predicts."""

    axes: tuple[str, ...]  # mesh axes of the group, in mesh order
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    what: str
    bytes: Any  # result buffer of one execution, one device
    executions: Any  # per step, as they run
    static: Any  # per step, as the HLO counts them (a conditional branch: every loop trip)
    overlap: str  # 'exposed' | 'backward' (hidden behind the backward pass) | 'compute' | 'tick'
    group: Any = 1  # devices in the group

    @property
    def bytes_per_step(self) -> Any:
        return self.bytes * self.executions


def moe_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """moe.capacity without JAX (tests/test_cost_moe.py holds the two equal): slots per expert
    per sequence; capacity_factor <= 0 (dropless) gives every expert all T slots."""
    if capacity_factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


class Dims:
    """The shape quantities every formula uses, broadcast over the grid.

    The scanned stack runs U = L / unit trips; a unit is one block, or `moe.every` blocks whose
    last one is MoE (config.stack_length). Parameter elements per device are counted per unit and
    split into expert weights (E/expert experts, F over tensor; their gradients reduce over data
    only) and the rest (attention, dense MLPs, norms, the replicated float32 router, shared experts).
    """

    def __init__(self, w: Workload, g: Grid, platform: str = "accelerator"):
        m = w.model
        self.w, self.g = w, g
        self.D, self.L, self.N, self.K, self.F, self.V = m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size
        self.H, self.T = m.d_model // m.n_heads, w.seq_len
        self.cpu = platform == "cpu"
        self.c = 4 if (self.cpu or m.dtype == "float32") else 2  # activation bytes
        t, p = np.asarray(g.tensor), np.asarray(g.pipe)
        self.t, self.p = t, p
        self.d, self.ep = np.asarray(g.data), np.asarray(g.expert)
        self.dp = self.d * self.ep  # batch shards
        self.M = np.asarray(g.microbatches)
        self.r = np.asarray(g.repeats)
        self.sched, self.remat, self.zero = np.asarray(g.schedule), np.asarray(g.remat), np.asarray(g.zero)
        self.piped = (p > 1) | (self.M > 1)
        self.f1b = self.piped & (self.sched == ONE_F_ONE_B)
        self.ticks = np.where(self.f1b, self.M + 2 * (p - 1), self.r * self.M + p - 1)
        self.rows = w.global_batch / self.dp  # rows per batch shard
        self.tok = self.rows * self.T  # tokens per batch shard
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
        # Gradient bytes on the wire over the batch axes: a matmul weight's in grad_reduce_dtype
        # (2 bytes for bfloat16 on GPU/TPU), the norm scales' and the router's in float32.
        # A pipeline stage's gradients are always float32 (see the module docstring).
        self.gb = np.where((np.asarray(g.grad_reduce) == 1) & (not self.cpu), 2, 4)
        self.gb_stage = np.where(self.piped, 4, self.gb)  # the block stack's matmul weights
        router = self.moe * self.D * self.E
        self.unit_ne_bytes = self.gb_stage * (self.unit_ne - self.unit_norms - router) + 4 * (self.unit_norms + router)
        self.unit_ex_bytes = self.gb_stage * self.unit_ex
        self.params_t = self.Ldev * self.layer_t + self.outer_t  # tensor-, expert- and pipe-sharded
        self.act = self.tok * self.D * self.c  # one [B/dp, T, D] buffer
        self.act_m = self.act / self.M
        # Sequence parallelism: the residual stream (and what is saved or sent of it) is [B/dp, T/t, D].
        self.sp = (np.asarray(g.sequence) != 0) & (t > 1)
        self.sp_t = np.where(self.sp, t, 1)


def _axes(*names: str) -> tuple[str, ...]:
    return tuple(a for a in ("data", "tensor", "pipe", "expert") if a in names)


def _batch_axes(g: Grid) -> tuple[str, ...]:
    """The gradient-reduction group: (data, expert). For one layout (the audit) only the axes of
    size > 1, as the compiled replica groups show them; for a grid (the planner) nominal."""
    if np.ndim(g.data) == 0 and np.ndim(g.expert) == 0:
        return _axes(*[a for a, n in (("data", g.data), ("expert", g.expert)) if n > 1]) or ("data",)
    return ("data", "expert")


def collective_terms(w: Workload, g: Grid, platform: str = "accelerator") -> list[Term]:
    """Every collective family of one step, per device. Terms of size 0 are kept (zero bytes)."""
    s = Dims(w, g, platform)
    t, p, M, f1b, piped = s.t, s.p, s.M, s.f1b, s.piped
    on_t, on_p, on_d = (t > 1), (p > 1), (s.dp > 1)
    on_data, on_e = s.d > 1, s.ep > 1
    batch_axes = _batch_axes(g)
    full = s.remat == FULL
    rows_f32 = s.tok * 4  # one float32 value per token
    one = np.ones_like(s.act)
    terms: list[Term] = []

    def add(axes, kind, what, nbytes, execs, on, overlap, static=None, group=1):
        execs = np.where(on, execs, 0) * one
        static = execs if static is None else np.where(on, static, 0) * one
        terms.append(Term(axes, kind, what, nbytes * one, execs, static, overlap, group))

    # tensor: Megatron all-reduces. Non-pipelined: L layers once; GPipe/circular: every tick runs
    # a chunk (bubble ticks compute too); 1F1B: conditional branches, M busy ticks of `ticks`.
    layers_run = np.where(piped, s.ticks * s.Lc, s.L)
    busy_layers = np.where(f1b, M * s.Lc, layers_run)
    units_run, busy_units = layers_run / s.unit, busy_layers / s.unit
    ar_bytes = np.where(piped, s.act_m, s.act)
    # Per unit, forward and again backward: 2 per dense block; an MoE block all-reduces its
    # attention output and (shared experts) the shared MLP's, plus the expert output below.
    per_unit = 2 * (s.unit - s.moe) + s.moe * (1 + int(s.S > 0))
    # Recomputation: the attention output again (the block output is dead), and in a unit of
    # several blocks both all-reduces of every block but the last, whose outputs feed the next;
    # 1F1B always recomputes the stage forward inside its backward (one fewer when Lc == 1).
    recompute = np.where(f1b, M * (2 * s.Lc - (s.Lc == 1)), np.where(full, units_run * (2 * s.unit - 1), 0))
    static_scale = np.where(f1b, s.ticks / M, 1)
    # GPipe/circular run each tick as two half-microbatches (pipeline.py): twice the ops, half the bytes.
    halves = np.where(piped & ~f1b & ((s.rows / M) % 2 == 0), 2, 1)
    # Sequence parallelism: each all-reduce of a [B, T, D] partial sum feeds the T-sharded residual.
    # The partitioner emits it as an all-reduce plus a slice of this device's T shard; the GPU and
    # TPU compilers fuse the pair into a reduce-scatter (result 1/t), XLA:CPU has no such pass and
    # keeps the all-reduce (its compiled steps are what the tests compare). Before each
    # column-parallel matmul the norm output is all-gathered (2 per block, attention and FFN); in
    # the backward pass the output cotangent is gathered and the input gradient reduce-scattered.
    sp, rs = s.sp, s.sp & (not s.cpu)

    def partial_sum(what, nbytes, execs, on, static=None):
        add(("tensor",), "all-reduce", what, nbytes, execs, on & ~rs, "exposed", static, t)
        add(("tensor",), "reduce-scatter", what, nbytes / t, execs, on & rs, "exposed", static, t)

    for what, n in (("block forward (2 per layer)", per_unit * busy_units),
                    ("block backward (2 per layer)", per_unit * busy_units), ("block recomputation", recompute)):
        partial_sum(what, ar_bytes / halves, n * halves, on_t, n * halves * static_scale)
    # Every recomputed block gathers its norm outputs again, under `dots` too (norms are not dots).
    gathers = 2 * busy_layers * halves
    regathers = 2 * np.where(f1b, M * s.Lc, np.where(s.remat != NONE, layers_run, 0)) * halves
    for what, n in (("sequence-parallel norm gathers forward (2 per layer)", gathers),
                    ("sequence-parallel cotangent gathers backward (2 per layer)", gathers),
                    ("sequence-parallel norm gathers recomputed", regathers)):
        add(("tensor",), "all-gather", what, ar_bytes / halves, n, on_t & sp, "exposed", n * static_scale, t)
    # Norm scales see only this device's tokens: their gradients are partial sums over tensor.
    add(("tensor",), "all-reduce", "sequence-parallel norm-scale gradients", 4 * s.unit_norms, busy_units * halves,
        on_t & sp, "exposed", busy_units * halves * static_scale, t)
    # MoE: the expert output [E/ep, B/data, C, D] sums its F shards (forward) and so does the
    # gradient of the expert input (backward); recomputed under any remat policy (`dots` keeps
    # only matmuls without batch dimensions, and the expert matmuls are batched over E).
    slot_bytes = np.where(piped, s.slots / M, s.slots) / halves
    moe_units = s.moe * busy_units * halves
    moe_recompute = s.moe * np.where(f1b, M * s.Lc / s.unit, np.where(s.remat != NONE, units_run, 0)) * halves
    for what, n in (("MoE expert output forward", moe_units), ("MoE expert input gradient backward", moe_units),
                    ("MoE expert output recomputation", moe_recompute)):
        add(("tensor",), "all-reduce", what, slot_bytes, n, on_t, "exposed", n * static_scale, t)
    partial_sum("embedding forward (vocab-parallel)", s.act, 1, on_t)
    partial_sum("logits backward (vocab-parallel)", np.where(f1b, s.act_m, s.act), np.where(f1b, M, 1), on_t,
                np.where(f1b, s.ticks, 1))
    # Sequence parallelism: the loss head gathers the final norm's output (1F1B: per microbatch),
    # the embedding's table gradient the cotangent of its output; the final norm's scale as above.
    add(("tensor",), "all-gather", "sequence-parallel final-norm gather", np.where(f1b, s.act_m, s.act),
        np.where(f1b, M, 1), on_t & sp, "exposed", np.where(f1b, s.ticks, 1), t)
    add(("tensor",), "all-gather", "sequence-parallel embedding cotangent gather", s.act, 1, on_t & sp, "exposed", None, t)
    add(("tensor",), "all-reduce", "sequence-parallel final-norm scale gradient", 4 * s.D, np.where(f1b, M, 1),
        on_t & sp, "exposed", np.where(f1b, s.ticks, 1), t)
    add(("tensor",), "all-reduce", "cross-entropy max, sum, target", np.where(f1b, rows_f32 / M, rows_f32),
        np.where(f1b, 3 * M, 3), on_t, "exposed", np.where(f1b, 3 * s.ticks, 3), t)

    # expert: dispatch and combine, one all-to-all each way per MoE layer, of one device's
    # [B/(data expert), E, C, D] slots (capacity padding moves too); exposed: the expert matmuls
    # need the dispatched slots and the combine needs the returned ones.
    for what, n in (("MoE dispatch + combine forward (2 per MoE layer)", 2 * moe_units),
                    ("MoE dispatch + combine backward (2 per MoE layer)", 2 * moe_units),
                    ("MoE dispatch + combine recomputation", 2 * moe_recompute)):
        add(("expert",), "all-to-all", what, slot_bytes, n, on_e, "exposed", n * static_scale, s.ep)

    # pipe: the ring and the reductions around the stack.
    send, sends = s.act_m / halves / s.sp_t, s.ticks * halves  # sequence parallelism: T/t of each
    # Sends overlap compute where something is left to compute: GPipe's first half-microbatch
    # behind the second, 1F1B's forward send behind the tick's backward; 1F1B's cotangent send
    # comes after all of the tick's compute.
    add(("pipe",), "collective-permute", "stage activations forward", send, sends, on_p, "tick", None, 2)
    add(("pipe",), "collective-permute", "stage cotangents backward", send, sends, on_p & ~f1b, "tick", None, 2)
    add(("pipe",), "collective-permute", "stage cotangents backward (1F1B)", send, sends, on_p & f1b, "exposed", None, 2)
    add(("pipe",), "all-reduce", "stack output / input cotangents (psum)", s.act / s.sp_t, np.where(f1b, 1, 2), on_p,
        "exposed", None, p)
    add(("pipe",), "all-reduce", "head gradients (1F1B psum)", 4 * s.outer_t, 1, on_p & f1b, "exposed", None, p)

    # data: gradient reduction, ZeRO gathers. XLA:CPU all-reduces the gradients; on GPU/TPU the
    # partitioner turns all-reduce + slice into a reduce-scatter when ZeRO shards the update
    # (half the traffic; the result buffer is the 1/data shard).
    dp = s.dp
    grad_loop = ~piped
    # A pipelined ZeRO-3 stage gathers its weights inside the shard_map: the transpose is a
    # reduce-scatter on every platform.
    scatter = (s.zero > 0) & (not s.cpu)
    # ZeRO shards the update over data only, so with experts the partitioner reduces a non-expert
    # gradient over data (full size, or reduce-scatter), then over expert on the 1/data slice it
    # keeps (seen under ZeRO-1 on XLA:CPU; ZeRO-3 there keeps one (data, expert) all-reduce). Norm
    # scales have no `embed` dimension (never ZeRO-sharded): one (data, expert) all-reduce.
    split = on_data & on_e & ((s.zero == 1) | scatter) & ~piped
    kinds = (("all-reduce", ~scatter, 1), ("reduce-scatter", scatter, dp))
    for kind, on, shard in kinds:
        add(batch_axes, kind, "layer gradients (in the backward loop)", s.unit_ne_bytes / shard, s.U,
            on_d & on & grad_loop & ~split, "backward", None, dp)
    for kind, on, shard in kinds:
        add(("data",), kind, "MoE expert-weight gradients (data only, in the backward loop)",
            s.unit_ex_bytes / np.where(shard > 1, s.d, 1), s.U, on_data & on & grad_loop, "backward", None, s.d)
        add(("data",), kind, "layer gradients but norms, over data (ZeRO-1 with experts)",
            (s.unit_ne_bytes - 4 * s.unit_norms) / np.where(shard > 1, s.d, 1), s.U, on & grad_loop & split, "backward",
            None, s.d)
    add(("expert",), "all-reduce", "layer gradients but norms, 1/data slice over expert (ZeRO-1 with experts)",
        (s.unit_ne_bytes - 4 * s.unit_norms) / s.d, s.U, grad_loop & split, "backward", None, s.ep)
    add(batch_axes, "all-reduce", "norm-scale gradients (ZeRO-1 with experts)", 4 * s.unit_norms, s.U,
        grad_loop & split, "backward", None, dp)
    # Pipelined: once after the tick loop; expert weights over `data` alone, as in the loop above.
    # Under ZeRO-3 with experts the stage's weights enter the shard_map varying over (data,
    # expert) and gathered over data: the transpose sums over expert (full size), then
    # reduce-scatters over data (pipeline.run_pipeline; the same on every platform).
    units_dev = s.Ldev / s.unit
    zero3_e = piped & (s.zero == 3) & on_e
    for kind, on in (("all-reduce", ~(scatter | (s.zero == 3))), ("reduce-scatter", scatter | (s.zero == 3))):
        scattered = kind == "reduce-scatter"
        add(batch_axes, kind, "layer gradients (once, after the tick loop)",
            4 * units_dev * s.unit_ne / (dp if scattered else 1), 1, on_d & on & piped & ~zero3_e, "exposed", None, dp)
        add(("data",), kind, "MoE expert-weight gradients (once, after the tick loop; data only)",
            4 * units_dev * s.unit_ex / (s.d if scattered else 1), 1, on_data & on & piped, "exposed", None, s.d)
    add(("expert",), "all-reduce", "layer gradients but experts, over expert (pipelined ZeRO-3)",
        4 * units_dev * s.unit_ne, 1, zero3_e, "exposed", None, s.ep)
    add(("data",), "reduce-scatter", "layer gradients but experts, over data (pipelined ZeRO-3)",
        4 * units_dev * s.unit_ne / s.d, 1, zero3_e & on_data, "exposed", None, s.d)
    # 1F1B reduces the embedding twice: its (zero) head-side gradient inside, the real one outside.
    outer_t = s.outer_t + np.where(f1b, s.embed_t, 0)
    # The embedding and head gradients' bytes; 1F1B's head-side ones come out of its stage
    # shard_map as float32 cotangents (seen compiling for TPU), the real embedding's does not.
    tables = np.where(f1b, s.gb * s.embed_t + 4 * (s.embed_t + s.head_t), s.gb * (s.embed_t + s.head_t))
    for kind, on, shard in kinds:
        add(batch_axes, kind, "embedding, head and final-norm gradients", (tables + 4 * s.D) / shard, 1,
            on_d & on & ~split, "backward", None, dp)
        add(("data",), kind, "embedding and head gradients over data (ZeRO-1 with experts)",
            tables / np.where(shard > 1, s.d, 1), 1, on & split, "backward", None, s.d)
    add(("expert",), "all-reduce", "embedding and head gradients, 1/data slice over expert (ZeRO-1 with experts)",
        tables / s.d, 1, split, "backward", None, s.ep)
    add(batch_axes, "all-reduce", "final-norm gradient (ZeRO-1 with experts)", 4 * s.D, 1, split, "backward", None, dp)
    # One gather per parameter array, over data (ZeRO shards over data only).
    z1, z3 = s.zero == 1, s.zero == 3
    n_outer = 3 - int(w.model.tie_embeddings)
    add(("data",), "all-gather", "ZeRO-1: updated parameters", 4 * s.params_t / (s.unit_arrays + n_outer),
        s.unit_arrays + n_outer, on_data & z1, "exposed", None, s.d)
    # ZeRO-3 outside the pipeline: per unit before use; the `none` policy keeps the gathered
    # weights for the backward pass, a remat policy gathers them again there. Matmul weights
    # are cast on their shard and gathered in the compute dtype (sharding.constrain_param; XLA:CPU
    # promotes bfloat16 collectives to float32); norm scales and the router stay float32. The
    # pipeline's stage gather (pipeline.run_pipeline) moves float32.
    wb = 4 if (s.cpu or w.model.dtype == "float32") else 2
    fp32_unit = s.unit_norms + s.moe * s.D * s.E
    unit_gather = wb * (s.unit_t - fp32_unit) + 4 * fp32_unit
    regather = np.where(s.remat == NONE, 1, 2)
    add(("data",), "all-gather", "ZeRO-3: layer weights", unit_gather / s.unit_arrays, s.unit_arrays * s.U * regather,
        on_data & z3 & ~piped, "compute", None, s.d)
    add(("data",), "all-gather", "ZeRO-3: stage weights (once per step)", 4 * s.Ldev * s.layer_t / s.unit_arrays,
        s.unit_arrays, on_data & z3 & piped, "exposed", None, s.d)
    add(("data",), "all-gather", "ZeRO-3: embedding, head, final norm", (wb * (s.outer_t - s.D) + 4 * s.D) / n_outer,
        n_outer, on_data & z3, "compute", None, s.d)
    return terms


def memory_parts(w: Workload, g: Grid, platform: str = "accelerator", attention: str = "xla") -> dict[str, Any]:
    """Bytes per device at the peak (the start of the backward pass), by part.

    `attention`: 'xla' is what parallax compiles today (jax.nn.dot_product_attention's XLA path
    keeps the [N, T, T] scores, their exponent and the probabilities); 'fused' a flash-style
    kernel that keeps one float32 log-sum-exp per head and token.
    """
    s = Dims(w, g, platform)
    c, D, F, H, N, K, T, t = s.c, s.D, s.F, s.H, s.N, s.K, s.T, s.t
    dshard = s.d  # ZeRO shards over data only (sharding.make_rules), experts or not
    params = 4 * s.params_t / np.where(s.zero == 3, dshard, 1)
    opt = 8 * s.params_t / np.where(s.zero >= 1, dshard, 1)
    # ZeRO-1 outside a pipeline: the backward loop slices each layer's reduced gradient to the
    # 1/data shard the update needs (the loop's output stacks are 1/data in the compiled step).
    layer_grads = 4 * s.Ldev * s.layer_t / np.where((s.zero == 3) | ((s.zero == 1) & ~s.piped), dshard, 1)
    grads = layer_grads + 4 * s.outer_t / np.where(s.zero == 3, dshard, 1)
    heads = N / t
    scores = heads * T * 13 if attention == "xla" else heads * 4  # bool mask + 3 float32 / log-sum-exp
    # Residuals of one un-rematted block per token (jax.ad_checkpoint.print_saved_residuals):
    # x, x after attention, 2 x (normed float32 + scaled) ; q, k, v, attention output; 6 F-sized.
    # Sequence parallelism (sp_t = t, else 1): the residual-stream buffers are T-sharded, but the
    # two norm outputs the column-parallel matmuls keep are the all-gathered, full-T ones.
    sp_t = s.sp_t
    attn_none = D * (c + 2 * 4) / sp_t + 2 * D * c + (2 * N + 2 * K) * H / t * c + scores
    attn_dots = 3 * D * c / sp_t + (N + 2 * K) * H / t * c  # x, attention and MLP outputs; qkv
    # An MoE FFN per token: its slots (E C / T per token, capacity padding included) each keep
    # D- and F-sized buffers, the router float32 [E]-sized ones; shared experts as a dense MLP.
    moe_none = (s.slots_tok * (MOE_SLOT_D * D + MOE_SLOT_F * s.Fe / t) * c + MOE_ROUTER * s.E * 4
                + s.k * D * c + 6 * s.S * s.Fe / t * c)  # + the combine's [T, k, D] picked outputs
    moe_dots = s.E * 4 + 2 * s.S * s.Fe / t * c  # router logits, shared gate/up (expert matmuls are batched)
    dense = s.unit - s.moe  # dense blocks per unit
    none = s.unit * attn_none + dense * 6 * F / t * c + s.moe * moe_none  # per unit
    dots = s.unit * attn_dots + dense * 2 * F / t * c + s.moe * moe_dots  # gate/up
    full = D * c * (CPU_FULL_SAVED if s.cpu else 1.0) / sp_t  # the unit's input
    saved_tok = np.select([s.remat == NONE, s.remat == FULL], [none, full], dots) / s.unit  # per layer
    if not s.cpu and w.model.dtype != "float32":  # bfloat16 copies of the weights kept per layer
        # (unpipelined ZeRO-3: those copies are the gathered weights, counted in `gathered`)
        saved_layer = np.where((s.remat == NONE) & ~((s.zero == 3) & ~s.piped), 2 * (s.layer_t - 2 * D), 0)
    else:
        saved_layer = 0
    tok_m = s.tok / s.M
    vocab_t = s.V / t
    # Saved activations. Plain: every layer once. GPipe/circular: every tick's chunk residuals
    # until the backward loop. 1F1B: 2P stage inputs in the ring buffer, the input cotangents
    # [M, B/M, T, D], one stage's residuals (Lc layers) while its vjp runs, and the gradient
    # accumulators carried through the tick loop.
    plain_saved = s.L * (s.tok * saved_tok + saved_layer)
    # The circular schedule slices its chunk's weights per tick; without a remat policy the
    # backward keeps each slice (pipeline._stage_fn).
    chunk_slices = np.where((s.sched == CIRCULAR) & (s.remat == NONE), 4 * s.Lc * s.layer_t, 0)
    gpipe_saved = s.ticks * (s.Lc * (tok_m * saved_tok + saved_layer) + chunk_slices)
    f1b_saved = (2 * s.p * tok_m * D * c + s.act) / sp_t + s.Lc * (tok_m * saved_tok + saved_layer) + 4 * s.params_t
    activations = np.where(s.f1b, f1b_saved, np.where(s.piped, gpipe_saved, plain_saved))
    # Working set: one unit's backward needs about its un-rematted residuals at once (a whole
    # chunk of them inside a pipeline tick); a 1-layer chunk compiles without an inner loop and
    # its residuals are the working set itself.
    # The circular schedule under a remat policy slices each unit's weights inside its
    # checkpoint (pipeline._stage_fn): one more unit's residuals are live (fitted on three
    # compiles: L4/D48, L4/D96, L8/D48 on data 2 x tensor 2 x pipe 2, within 13%).
    sliced = (s.sched == CIRCULAR) & (s.r > 1) & (s.remat != NONE)
    work_tok = np.where(s.piped & ~s.f1b, (s.Lc / s.unit + sliced) * tok_m,
                        np.where(s.f1b, np.where(s.Lc > 1, tok_m, 0), s.tok))
    # (an MoE FFN's backward keeps more than its residuals live: its own factor, fitted)
    moe_work = s.moe * moe_none * ((MOE_WORKING if s.cpu else ACCEL_WORKING) - (CPU_WORKING if s.cpu else ACCEL_WORKING))
    work = (CPU_WORKING if s.cpu else ACCEL_WORKING) * np.where(s.f1b, F1B_WORKING, 1.0) * work_tok * none
    work = work + np.where(s.f1b, F1B_WORKING, 1.0) * work_tok * moe_work
    logits_k = CPU_LOGITS if s.cpu else ACCEL_LOGITS
    # The loss head runs on the whole shard (GPipe, plain) or one microbatch (1F1B), plus the
    # one-hot embedding input of the whole shard.
    head_tok = np.where(s.f1b, tok_m, s.tok)
    logits = logits_k * head_tok * vocab_t * 4 + s.tok * vocab_t * c
    # ZeRO-3 with the `none` policy keeps every gathered layer for the backward pass (see above).
    # (in the compute dtype: the matmul weights are cast before their gather, constrain_param)
    gathered = np.where((s.zero == 3) & (s.remat == NONE) & ~s.piped, c * s.L * s.layer_t, 0)
    gathered = gathered + np.where((s.zero == 3) & s.piped, 4 * s.params_t, 0)
    # ... and outside a pipeline one unit's full-size expert-weight gradient before and after
    # its all-reduce, plus (remat) the unit's experts gathered again. Dense weights do the same,
    # but the dense calibration (CPU_WORKING) absorbed that part; only the MoE fit needed it.
    gathered = gathered + np.where((s.zero == 3) & ~s.piped, 4 * s.unit_ex * (2 + (s.remat != NONE)), 0)
    batch = 2 * w.global_batch / s.dp * T * 4
    parts = {"params": params, "optimizer": opt, "gradients": grads, "activations": activations,
             "working": work, "logits": logits, "gathered": gathered, "batch": batch * np.ones_like(params)}
    parts["total"] = sum(parts.values())
    return parts


def model_flops_per_step(w: Workload) -> float:
    """The MFU numerator: 6 N + causal attention per token (model.py), times tokens per step."""
    from parallax.model import flops_per_token  # counts only; model.py's convention is the one logged

    return flops_per_token(w.model, w.seq_len) * w.global_batch * w.seq_len


def hardware_flops_per_device(w: Workload, g: Grid, attention: str = "xla") -> dict[str, Any]:
    """FLOPs one device executes per step, by part (what sets its compute time).

    Blocks: split over every axis; remat=full and 1F1B recompute the block forward (+1/3); the
    GPipe/circular bubble ticks compute on zeros. Embedding (one-hot matmul, forward and table
    gradient) and loss head are replicated over `pipe`: every stage runs them on its batch shard.
    XLA's attention computes the whole [T, T] score matrix and masks it (12 N H T per token and
    layer); a fused causal kernel skips the masked half (6 N H T, the model-FLOPs convention).
    """
    s = Dims(w, g)
    attn = 4 if attention == "xla" else 2
    wo = 2 * s.F * s.D  # the last matmul: its output is dead in a recomputation (XLA drops it)
    block = 2 * s.D * s.H * (2 * s.N + 2 * s.K) + attn * s.N * s.H * s.T  # per token: projections, scores
    dense = 4 * s.D * s.F + wo
    # MoE: the experts compute on all E C slots of a sequence, full or not (capacity padding
    # counts); the float32 router and the combine's weighted sum are not split over tensor.
    experts = s.slots_tok * 6 * s.D * s.Fe
    moe = experts + 6 * s.D * s.S * s.Fe
    moe_replicated = s.moe * (2 * s.D * s.E + 2 * s.k * s.D)
    fwd = s.unit * block + (s.unit - s.moe) * dense + s.moe * moe  # per token and unit, over tensor
    dead = np.where(s.moe, 2 * s.S * s.Fe * s.D, wo)  # the unit's last matmul (shared experts' wo)
    # remat=full recomputes each unit's forward but its last matmul; 1F1B recomputes the stage
    # from its input, which needs every unit's output but the chunk's last; `dots` recomputes
    # the batched expert matmuls (it keeps only matmuls without batch dimensions).
    recompute = np.select([s.f1b, s.remat == FULL, s.remat == DOTS],
                          [fwd - dead * s.unit / s.Lc, fwd - dead, s.moe * experts], 0)
    busy = np.where(s.piped & ~s.f1b, s.ticks / (s.r * s.M), 1.0)  # bubble ticks run the stage too
    rerun = np.where(s.f1b | (s.remat == FULL), 1, 0)
    units = s.Ldev / s.unit
    blocks = s.tok * units * ((3 * fwd + recompute) / s.t + (3 + rerun) * moe_replicated) * busy
    head = s.tok * 6 * s.D * s.V / s.t
    embed = s.tok * 4 * s.D * s.V / s.t
    return {"blocks": blocks, "head": head * np.ones_like(blocks), "embedding": embed * np.ones_like(blocks),
            "total": blocks + head + embed}
