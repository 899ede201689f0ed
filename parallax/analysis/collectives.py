"""The collectives of one train step per device, per axis family, as the cost model predicts them.

What it models is parallax's own program, not an idealised one:
- tensor: per block 2 all-reduces of [B/(data expert), T, D] forward and 2 backward (one more
  with remat=full: the recomputed attention output; none with save_attn_mlp, which keeps it);
  the vocab-parallel embedding all-reduces once forward, the logits projection once backward,
  the cross-entropy 3 [B, T] float32 rows.
  Sequence parallelism: each of those activation all-reduces is an all-reduce + T-slice on
  XLA:CPU, a reduce-scatter (result 1/t) on GPU/TPU; 2 all-gathers per block each way (more
  when recomputed), one before the head, one of the embedding's cotangent; the norm scales'
  partial gradients; pipe sends and psums carry 1/t.
- data: the gradient all-reduce moves the tensor-sharded parameter bytes, per layer inside the
  backward loop (a reduce-scatter under ZeRO on GPU/TPU), or once after the tick loop when
  pipelined (an all-reduce there under ZeRO-1 too, a reduce-scatter under ZeRO-3): matmul-weight gradients in
  `parallel.grad_reduce_dtype` (layers.param_matmul; float32 on XLA:CPU, which promotes bf16
  collectives, and inside a pipeline, whose stage gradients are reduced as the float32 master's
  cotangent where the shard_map is transposed), norm scales and the MoE router in float32; ZeRO-1 all-gathers the
  updated parameters once; ZeRO-3 gathers each layer's weights forward (and again backward when a
  remat policy recomputes them), the embedding, head and final norm once.
- pipe: GPipe/circular send two half-microbatches per tick forward and two in the transpose,
  1F1B one microbatch each way per tick; one psum of the stack output forward and backward (1F1B:
  of the embedding and head gradients only: stage 0 embeds each microbatch in the tick loop).
- expert (MoE): per MoE layer 2 all-to-alls of one device's [B/(data expert), E, C, D] slots
  forward and 2 backward (2 more when a remat policy recomputes the layer); over tensor the expert
  output [E/ep, B/data, C, D] is all-reduced (forward, and its input gradient backward); expert
  weights reduce their gradients over `data` only, everything else over (data, expert). ZeRO
  shards over `data` only (sharding.make_rules: `embed` -> data), never over `expert`.
Byte figures follow audit.py: the result buffer of one execution on one device. XLA:CPU runs
bfloat16 elementwise work and collectives in float32 (`platform='cpu'` models that).
`collective_terms` is `tensor_terms + expert_terms + pipe_terms + data_terms`, each on one `Dims`;
each family's docstring names the code it models and the implementation details it must follow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from parallax.analysis.cost import Dims, Grid, Workload, reduces_once_on
from parallax.parallelism import FULL, NONE, SAVE_ATTN_MLP


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


def _axes(*names: str) -> tuple[str, ...]:
    return tuple(a for a in ("data", "tensor", "pipe", "expert") if a in names)


def _batch_axes(g: Grid) -> tuple[str, ...]:
    """The gradient-reduction group: (data, expert). For one layout (the audit) only the axes of
    size > 1, as the compiled replica groups show them; for a grid (the planner) nominal."""
    if np.ndim(g.data) == 0 and np.ndim(g.expert) == 0:
        return _axes(*[a for a, n in (("data", g.data), ("expert", g.expert)) if n > 1]) or ("data",)
    return ("data", "expert")


class _Terms:
    """Terms under construction, every array field broadcast to the grid's shape. A family that
    is off for a layout (`on` False) keeps its term there with zero executions."""

    def __init__(self, s: Dims):
        self.one = np.ones_like(s.act)
        self.terms: list[Term] = []

    def add(self, axes, kind, what, nbytes, execs, on, overlap, static=None, group=1) -> None:
        execs = np.where(on, execs, 0) * self.one
        static = execs if static is None else np.where(on, static, 0) * self.one
        self.terms.append(Term(axes, kind, what, nbytes * self.one, execs, static, overlap, group))

    def partial_sum(self, s: Dims, what, nbytes, execs, on, static=None, sliced=True) -> None:
        """The all-reduce of a [B, T, D] partial sum over tensor. Under sequence parallelism it
        feeds the T-sharded residual: the partitioner emits all-reduce + slice of this device's T
        shard, which the GPU and TPU compilers fuse into a reduce-scatter (result 1/t); XLA:CPU
        has no such pass and keeps the all-reduce (its compiled steps are what the tests compare).
        `sliced` False: the slice is not beside the all-reduce (a loop writes the sums into a
        whole-T buffer first), so every compiler keeps the all-reduce."""
        rs = s.sp & (not s.cpu) & sliced
        self.add(("tensor",), "all-reduce", what, nbytes, execs, on & ~rs, "exposed", static, s.t)
        self.add(("tensor",), "reduce-scatter", what, nbytes / s.t, execs, on & rs, "exposed", static, s.t)


def collective_terms(w: Workload, g: Grid, platform: str = "accelerator", attention: str = "xla",
                     scatter_all_reduce_group: int = 0, gather_all_reduce_group: int = 0) -> list[Term]:
    """Every collective family of one step, per device, family by family (tensor, expert, pipe,
    data: the order audit.py and plan.py have always read). Terms of size 0 are kept (zero bytes).
    `attention`: the kernel the step runs (parallelism.attention_kernel; Dims).
    `scatter_all_reduce_group`, `gather_all_reduce_group`: the groups whose reduce-scatters and
    all-gathers the target's compiler writes as all-reduces (targets.Target; 0: none)."""
    if w.grad_accum > 1:
        terms = _accumulated_terms(w, g, platform, scatter_all_reduce_group)
    else:
        s = Dims(w, g, platform, attention, scatter_all_reduce_group)
        terms = tensor_terms(s) + expert_terms(s) + pipe_terms(s) + data_terms(s)
    return as_all_reduces(terms, scatter_all_reduce_group, gather_all_reduce_group)


def as_all_reduces(terms: list[Term], scatter_group: int, gather_group: int = 0) -> list[Term]:
    """Each reduce-scatter term over `scatter_group` devices, and each all-gather term over
    `gather_group`, as the all-reduce of the whole that the compiler writes in its place
    (targets.Target.scatter_all_reduce_group, .gather_all_reduce_group): a reduce-scatter's result
    becomes `group` times the shard, an all-gather's stays the whole. On a grid a term's group
    varies by layout: it is split into the two kinds, each on where it applies (zero executions
    elsewhere). A group of 0 rewrites nothing."""
    out = []
    for t in terms:
        group = {"reduce-scatter": scatter_group, "all-gather": gather_group}.get(t.kind, 0)
        if not group:
            out.append(t)
            continue
        whole = np.asarray(t.group) == group
        out.append(dataclasses.replace(t, executions=np.where(whole, 0, t.executions),
                                       static=np.where(whole, 0, t.static)))
        out.append(dataclasses.replace(t, kind="all-reduce", bytes=t.bytes * (t.group if t.kind == "reduce-scatter" else 1),
                                       executions=np.where(whole, t.executions, 0),
                                       static=np.where(whole, t.static, 0)))
    return out


LAYER_GATHERS = "ZeRO-3: layer weights"  # the one ZeRO gather family that runs in every microstep


def _accumulated_terms(w: Workload, g: Grid, platform: str, scatter_all_reduce_group: int = 0) -> list[Term]:
    """train.grad_accum = A (train_step.accumulate; no pipelining): every family of one microstep
    of B / A rows runs A times, but two. The gradient reductions over the batch axes run once,
    after the scan and exposed, where parallelism.reduces_once holds (per microstep, behind its
    backward pass, where not); ZeRO-1's gathers of the updated parameters once per step. ZeRO-3
    gathers the layer weights again in every microstep (inside the layer loop), the embedding,
    head and final norm once (the compiler hoists those loop-invariant gathers out of the scan:
    seen on XLA:CPU, data 4 x tensor 2)."""
    A, s = w.grad_accum, Dims(w.microstep, g, platform, scatter_all_reduce_group=scatter_all_reduce_group)
    once = reduces_once_on(w, g)
    times = lambda t, n, overlap=None: dataclasses.replace(  # noqa: E731
        t, executions=t.executions * n, static=t.static * n, overlap=overlap or t.overlap)
    out = [times(t, A) for t in tensor_terms(s) + expert_terms(s) + pipe_terms(s)]
    grads, r = _Terms(s), _Reduction.of(s)
    _loop_grad_terms(s, r, grads)
    _outer_grad_terms(s, r, grads)
    for t in grads.terms:  # each as two terms, one per path (a grid holds layouts of both)
        out += [times(t, np.where(once, 1, 0), "exposed"), times(t, np.where(once, 0, A))]
    gathers = _Terms(s)
    _zero_gather_terms(s, gathers)
    return out + [times(t, A if t.what == LAYER_GATHERS else 1) for t in gathers.terms]


def tensor_terms(s: Dims) -> list[Term]:
    """Over `tensor`: the blocks' Megatron partial sums and sequence-parallel gathers, the MoE
    experts' F-shard sums, and the vocab-parallel embedding and loss head."""
    out = _Terms(s)
    _block_tensor_terms(s, out)
    _moe_tensor_terms(s, out)
    _outer_tensor_terms(s, out)
    return out.terms


def _block_tensor_terms(s: Dims, out: _Terms) -> None:
    """transformer.Block / transformer.BlockGroup under the scanned stack: the row-parallel output projections
    (attention.Attention's, layers.MLP's wo) each end in a partial sum, forward and, for the input
    gradient of the column-parallel one, backward. Sequence parallelism (transformer.Block's
    `constrain(..., NORMED)` / `RESIDUAL`): each norm output is all-gathered before the
    column-parallel matmuls (2 per block), the output cotangent gathered backward, and the norm
    scales see only this device's tokens (their gradients are partial sums).

    Must follow: what a remat policy recomputes (transformer.remat_policy under transformer.Transformer's
    nn.remat: `full` recomputes the attention output, the block output being dead, and in a unit
    of several blocks both all-reduces of every block but the last, whose outputs feed the next;
    `save_attn_mlp` keeps the attention output (after its all-reduce), so only the MLP output of
    every block but a unit's last is recomputed (with its all-reduce); every recomputed block
    gathers its norm outputs again, under `dots` and `save_attn_mlp` too, norms not being dots);
    pipeline_1f1b's B and W (from F's residuals; or recomputing the chunk: its VJP, or under remat
    full backward_by_unit's first n - 1 units and each unit's VJP); Dims.halves and Dims.static_scale.
    """
    on_t, halves = s.t > 1, s.halves
    # Per unit: 2 per dense block; an MoE block all-reduces its attention output and (shared
    # experts) the shared MLP's; its expert output is _moe_tensor_terms'.
    per_unit = 2 * (s.unit - s.moe) + s.moe * (1 + int(s.S > 0))
    # Recomputed blocks, as cost.hardware_flops_per_device counts them: a table schedule's rerun B
    # (Dims.rerun_chunk) runs the chunk's forward (ZB-H1: in B and again in W, whose weight
    # gradients also need the input-gradient chain: the backward's partial sums twice), the
    # first n - 1 units under remat full outside ZB-H1 (Dims.by_unit), none of a one-unit chunk
    # under remat full; every B (and W) recomputes what the remat policy does besides.
    n = s.Lc / s.unit
    chunk_blocks = np.where(s.by_unit, s.Lc - s.unit, (1 + s.zb) * np.where((s.remat == FULL) & (n == 1), 0, s.Lc))
    chunk_runs = np.where(s.rerun_chunk, s.M * s.r * chunk_blocks, 0)  # blocks per step
    # (the chunk forward's last partial sum is dead when its one block is unrolled)
    chunk_sums = np.where(s.rerun_chunk, 2 * chunk_runs - s.M * s.r * (1 + s.zb) * ((s.Lc == 1) & (chunk_blocks > 0)), 0)
    # (remat full with sequence parallelism on the GPU and TPU compilers, the chunk's units run as
    # a loop of more than 2 trips: the last block's dead partial sum is recomputed too, as a
    # reduce-scatter: 96 per step at 16 layers compiled for h100-16 where 80 were counted, from 3
    # layers up; at 2 the loop is unrolled and it is dropped, as XLA:CPU and either compiler
    # without SP drop it; under save_attn_mlp nothing is recomputed there)
    # (not in backward_by_unit's per-unit VJPs: each unit's output is dead there, unrolled or not)
    dead = np.where(s.sp & (not s.cpu) & (s.Lc / s.unit > 2) & ~s.by_unit, 1, 0)
    # what the remat policy recomputes, in ZB-H1's B and W each where they recompute the chunk
    # (from F's residuals the backward is split: Dims.zb_rerun)
    policy_runs = s.policy_runs * (1 + s.zb_rerun)
    recompute = chunk_sums + np.select([s.remat == FULL, s.remat >= SAVE_ATTN_MLP],
                                       [policy_runs * (2 * s.unit - 1 + dead), policy_runs * (s.unit - 1)], 0)
    for what, n in (("block forward (2 per layer)", per_unit * s.busy_units),
                    ("block backward (2 per layer)", per_unit * s.busy_units * (1 + s.zb_rerun)),
                    ("block recomputation", recompute)):
        out.partial_sum(s, what, s.act_run / halves, n * halves, on_t, n * halves * s.static_scale)
    gathers = 2 * s.busy_layers * halves
    # ZB-H1's W recomputing the chunk gathers the output cotangents again: both of a block's under
    # remat none (a fused kernel) and full, one under save_attn_mlp, none under dots (compiled for
    # h100-8 with SP, 4 and 8 layers a stage, before the split; why the policies differ was not
    # read out of the HLO).
    w_gathers = np.select([(s.remat == NONE) | (s.remat == FULL), s.remat >= SAVE_ATTN_MLP], [1.0, 0.5], 0.0)
    # A split W (split_backward.py) reads B's values as B's program left them: the two row-parallel
    # outputs' cotangents T-sharded, which the partitioner gathers again for W's weight-gradient
    # dots (the gathers are GSPMD's, not the jaxpr's: nothing to stash). Under save_attn_mlp B
    # recomputes q/k/v from the attention norm's gathered output, and W, recomputing the norm
    # from the residual (cheap: not stashed), gathers it again; under dots only W gathers the
    # norms; under none they are residuals. (compiled for h100-8, 4 layers, SP: 2026-12-07)
    regathers = 2 * (chunk_runs + np.where(s.remat != NONE, policy_runs * s.unit, 0)) * halves \
        + s.zb_split * (s.remat >= SAVE_ATTN_MLP) * s.busy_layers * halves
    # (a row-parallel output's cotangent is gathered once, for both its dots, the input and the
    # weight gradient's: transformer.scatter_partial_sums. Left to the partitioner, XLA:CPU (D
    # sharded) and GPipe on XLA:GPU and XLA:TPU gathered it once for each.)
    cotangent_gathers = 1 + s.zb_rerun * w_gathers + s.zb_split
    for what, n in (("sequence-parallel norm gathers forward (2 per layer)", gathers),
                    ("sequence-parallel cotangent gathers backward (2 per layer)", gathers * cotangent_gathers),
                    ("sequence-parallel norm gathers recomputed", regathers)):
        out.add(("tensor",), "all-gather", what, s.act_run / halves, n, on_t & s.sp, "exposed", n * s.static_scale, s.t)
    # T sharded: the norm scales' gradients are partial sums over the tokens; D sharded: each
    # device's D slice of them is whole (no sum over tensor), but every norm evaluation (forward,
    # recomputed) and its backward sum over D in float32
    out.add(("tensor",), "all-reduce", "sequence-parallel norm-scale gradients", 4 * s.unit_norms,
            s.busy_units * halves, on_t & s.sp & ~s.sp_embed, "exposed", s.busy_units * halves * s.static_scale, s.t)
    stats = 2 * gathers + regathers
    out.add(("tensor",), "all-reduce", "sequence-parallel (embed) norm statistics", 4 * s.act_run / (s.c * s.D) / halves,
            stats, on_t & s.sp_embed, "exposed", stats * s.static_scale, s.t)
    # ... and the optimizer updates those D slices, then gathers each norm scale and its two AdamW
    # moments (float32) back whole, once per step (XLA:CPU, unpipelined; pipelined not read)
    out.add(("tensor",), "all-gather", "sequence-parallel (embed) norm scales and moments, updated", 4 * (
        s.U * s.unit_norms + s.D), 3, on_t & s.sp_embed & ~s.piped, "exposed", None, s.t)


def _moe_tensor_terms(s: Dims, out: _Terms) -> None:
    """moe.MoE's expert matmuls (capacity dispatch), F sharded over tensor: the expert output
    [E/ep, B/data, C, D] sums its F shards forward, and so does the expert input's gradient
    backward. Recomputed under any remat policy: `dots` keeps only matmuls without batch
    dimensions (transformer.remat_policy), and the expert matmuls are batched over E. Counts: Dims.moe_calls
    and Dims.moe_recalls (per call Dims.slots_run)."""
    for what, n in (("MoE expert output forward", s.moe_calls), ("MoE expert input gradient backward", s.moe_calls),
                    ("MoE expert output recomputation", s.moe_recalls)):
        out.add(("tensor",), "all-reduce", what, s.slots_run, n, s.t > 1, "exposed", n * s.static_scale, s.t)


def _outer_tensor_terms(s: Dims, out: _Terms) -> None:
    """Outside the stack. vocab.Embed: a gather with `vocab` over tensor, one [B, T, D] partial
    sum forward (transformer.Transformer.embed_tokens); the fused loss head (vocab.fused_cross_entropy)
    per chunk of T (Dims.loss_chunks): forward 3 float32 [B, chunk] all-reduces over the vocab
    shards (max, sum, target logit), backward one partial sum of its input gradient. Sequence
    parallelism: transformer.Transformer.head_loss gathers the final norm's output, the embedding's table
    gradient the cotangent of its output, and the final norm's scale gradient is a partial sum.
    The table schedules run the embedding, its table gradient and the head per microbatch, each
    in a `lax.cond` (pipeline_1f1b), counted every tick."""
    on_t, f1b, sp, t = s.t > 1, s.f1b, s.sp, s.t
    per_head, head_static = np.where(f1b, s.M, 1), np.where(f1b, s.ticks, 1)
    act_run = np.where(f1b, s.act_m, s.act)
    out.partial_sum(s, "embedding forward (vocab-parallel)", act_run, per_head, on_t, head_static)
    n = s.loss_chunks
    # (chunked: each chunk's input gradient is summed inside the chunk loop and written into the
    # whole-T cotangent, sliced to this device's T after the loop: an all-reduce per chunk)
    out.partial_sum(s, "logits backward (vocab-parallel)", np.where(f1b, s.act_m, s.act) / n, per_head * n, on_t,
                    head_static * n, sliced=n == 1)
    out.add(("tensor",), "all-gather", "sequence-parallel final-norm gather", np.where(f1b, s.act_m, s.act),
            per_head, on_t & sp, "exposed", head_static, t)
    out.add(("tensor",), "all-gather", "sequence-parallel embedding cotangent gather", act_run, per_head, on_t & sp,
            "exposed", head_static, t)
    out.add(("tensor",), "all-reduce", "sequence-parallel final-norm scale gradient", 4 * s.D, per_head,
            on_t & sp & ~s.sp_embed, "exposed", head_static, t)
    out.add(("tensor",), "all-reduce", "sequence-parallel (embed) final-norm statistics",
            4 * np.where(f1b, s.act_m, s.act) / (s.c * s.D), 2 * per_head, on_t & s.sp_embed, "exposed", 2 * head_static, t)
    rows_f32 = s.tok * 4  # one float32 value per token
    out.add(("tensor",), "all-reduce", "cross-entropy max, sum, target", np.where(f1b, rows_f32 / s.M, rows_f32) / n,
            np.where(f1b, 3 * s.M, 3) * n, on_t, "exposed", np.where(f1b, 3 * s.ticks, 3) * n, t)


def expert_terms(s: Dims) -> list[Term]:
    """Over `expert`: moe.MoE's capacity path through expert_parallel.EXPERT_EXCHANGE, whose
    `to_experts` / `from_experts` (_to_experts_local, _from_experts_local) are one all_to_all
    each of one device's [B/(data expert), E, C, D] slots (capacity padding moves too), forward,
    backward and when recomputed (Dims.moe_calls, Dims.moe_recalls). Exposed: the expert matmuls
    need the dispatched slots and the combine needs the returned ones.

    Must follow: the capacity dispatch only. `moe.dispatch='ragged'` (expert_parallel.make_ragged:
    ragged_all_to_all plus small all_to_alls of counts and offsets) is not modelled; nor is the
    gradient reduction over `expert`, which is data_terms'.
    """
    out = _Terms(s)
    for what, n in (("MoE dispatch + combine forward (2 per MoE layer)", 2 * s.moe_calls),
                    ("MoE dispatch + combine backward (2 per MoE layer)", 2 * s.moe_calls),
                    ("MoE dispatch + combine recomputation", 2 * s.moe_recalls)):
        out.add(("expert",), "all-to-all", what, s.slots_run, n, s.ep > 1, "exposed", n * s.static_scale, s.ep)
    return out.terms


def pipe_terms(s: Dims) -> list[Term]:
    """Over `pipe`. GPipe/circular (pipeline.run_pipeline's `tick`): one ppermute round the ring
    per half-microbatch (Dims.halves) each tick, and the same in the transpose; one psum of the
    stack outputs (only the last stage wrote them) and its transpose. The table schedules (1F1B,
    interleaved 1F1B, ZB-H1: pipeline_1f1b.make_scheduled_value_and_grad): one ppermute of
    activations and one of cotangents per tick of their table (ZB-H1: 3M + P - 1 unit ticks, both
    sends every tick, one of them zeros where the stage ran no F or no B); one psum of the
    embedding and head gradients `g_outer` (stage 0 embeds each microbatch inside the tick loop,
    so no input cotangents leave it).
    Sequence parallelism: what is sent or summed of the residual stream is T/t of it.

    Overlap ("tick": hidden behind the tick's compute in the planner's time): GPipe's first
    half-microbatch's send runs behind the second half's compute and the second half's behind the
    next tick's first half (pipeline.run_pipeline); 1F1B's forward send behind the tick's backward,
    its cotangent send, at the next tick's start, behind its F (pipeline_1f1b); the rings of
    circular and interleaved 1F1B as their chain and closing pair (pipeline.send_along). Compiled
    for h100-8 and v5e-8 (experiments/pipeline_overlap.py), all of the send bytes of GPipe, 1F1B,
    interleaved 1F1B and ZB-H1 overlap on h100-8, and circular's 75% (XLA:GPU issues the closing
    pair of its tail send after the first half's compute; all of it at 1B, M 4, on h100-16).
    """
    out = _Terms(s)
    on_p, f1b = s.p > 1, s.f1b
    send, sends = s.act_m / s.halves / s.sp_t, s.ticks * s.halves
    # (with one chunk, every schedule sends along a chain, not a ring: p - 1 of p stages send,
    # and bytes are per device, averaged over the devices as the audit reads them)
    chain = np.where(s.r == 1, (s.p - 1) / np.maximum(s.p, 1), 1.0)
    out.add(("pipe",), "collective-permute", "stage activations forward", send * chain, sends, on_p, "tick", None, 2)
    out.add(("pipe",), "collective-permute", "stage cotangents backward", send * chain, sends, on_p & ~f1b, "tick",
            None, 2)
    # sent at the next tick's start, behind its F
    out.add(("pipe",), "collective-permute", "stage cotangents backward (table schedules)", send * chain, sends,
            on_p & f1b, "tick", None, 2)
    out.add(("pipe",), "all-reduce", "stack output / input cotangents (psum)", s.act / s.sp_t, 2, on_p & ~f1b,
            "exposed", None, s.p)
    # (on the 1/data shard, after the reduce-scatter over data; pipeline_tables.reduce_table)
    tables = s.gb * (s.embed_t + s.head_t) / s.d
    out.add(("pipe",), "all-reduce", "embedding and head gradients (1F1B psum)", tables + 4 * s.D,
            1, on_p & f1b, "exposed", None, s.p)
    return out.terms


@dataclass(frozen=True)
class _Reduction:
    """How this layout reduces gradients over the batch axes (data_terms' helpers share it).

    `kinds`: (kind, on, shard) for the all-reduce (XLA:CPU, or no ZeRO) and the reduce-scatter
    the GPU/TPU partitioner makes of all-reduce + slice when ZeRO shards the update (result: the
    1/shard slice). `split`: ZeRO shards the update over data only (sharding.make_rules: `embed`
    -> data), so with experts the partitioner reduces a non-expert gradient over data (full size,
    or reduce-scatter), then over expert on the 1/data slice it keeps (seen under ZeRO-1 on
    XLA:CPU; ZeRO-3 there keeps one (data, expert) all-reduce: logical.ParamPlacement.to_storage
    goes through the compute layout). Norm scales have no `embed` dimension (never ZeRO-sharded).
    Where (data, expert) is the group the compiler keeps whole (v5p's whole slice:
    Dims.scatter_all_reduce_group) it is not split either: one all-reduce of the whole (compiled
    for v5p-32, data 4 x expert 4, ZeRO-3).
    """

    axes: tuple[str, ...]
    kinds: tuple
    scatter: Any
    split: Any

    @classmethod
    def of(cls, s: Dims) -> _Reduction:
        scatter = (s.zero > 0) & (not s.cpu)
        split = (s.d > 1) & (s.ep > 1) & ((s.zero == 1) | scatter) & ~s.piped & (s.dp != s.scatter_all_reduce_group)
        return cls(_batch_axes(s.g), (("all-reduce", ~scatter, 1), ("reduce-scatter", scatter, s.dp)), scatter, split)


def data_terms(s: Dims) -> list[Term]:
    """Over the batch axes (data, expert): the gradient reductions and ZeRO's gathers. Gradient
    bytes per element are Dims.gb / Dims.gb_stage (the dtype layers.param_matmul's custom VJP
    produces them in) and float32 for norm scales and the router."""
    out, r = _Terms(s), _Reduction.of(s)
    _loop_grad_terms(s, r, out)
    _stage_grad_terms(s, r, out)
    _outer_grad_terms(s, r, out)
    _zero_gather_terms(s, out)
    return out.terms


def _loop_grad_terms(s: Dims, r: _Reduction, out: _Terms) -> None:
    """Unpipelined: each unit's weight gradients are reduced inside the scanned backward loop
    (transformer.Transformer's nn.scan), per unit; expert weights (E/ep experts per device, already
    sharded over expert) over `data` only. See _Reduction for the ZeRO-with-experts split."""
    on_data, loop, split, dp = s.d > 1, ~s.piped, r.split, s.dp
    # (D-sharded sequence parallelism: a device holds its D slice of the norm scales' gradients)
    grads = s.unit_ne_bytes - 4 * s.unit_norms * np.where(s.sp_embed, 1 - 1 / s.t, 0)
    for kind, on, shard in r.kinds:
        out.add(r.axes, kind, "layer gradients (in the backward loop)", grads / shard, s.U,
                (dp > 1) & on & loop & ~split, "backward", None, dp)
    no_norms = s.unit_ne_bytes - 4 * s.unit_norms
    for kind, on, shard in r.kinds:
        d_shard = np.where(shard > 1, s.d, 1)
        out.add(("data",), kind, "MoE expert-weight gradients (data only, in the backward loop)",
                s.unit_ex_bytes / d_shard, s.U, on_data & on & loop, "backward", None, s.d)
        out.add(("data",), kind, "layer gradients but norms, over data (ZeRO-1 with experts)",
                no_norms / d_shard, s.U, on & loop & split, "backward", None, s.d)
    out.add(("expert",), "all-reduce", "layer gradients but norms, 1/data slice over expert (ZeRO-1 with experts)",
            no_norms / s.d, s.U, loop & split, "backward", None, s.ep)
    out.add(r.axes, "all-reduce", "norm-scale gradients (ZeRO-1 with experts)", 4 * s.unit_norms, s.U,
            loop & split, "backward", None, dp)


def _stage_grad_terms(s: Dims, r: _Reduction, out: _Terms) -> None:
    """Pipelined (pipeline.run_pipeline): the stage weights enter the shard_map replicated over
    the batch axes and marked varying once (`logical.vary`), so their gradients are reduced once, after
    the tick loop, where the shard_map is transposed, as the float32 master's cotangent; expert
    weights over `data` alone. ZeRO-3: `gather_zero3`'s all-gather over data transposes to a
    reduce-scatter on every platform; with experts the transpose first sums over expert (full
    size), then reduce-scatters over data. (1F1B: pipeline_1f1b's pmean of `g_chunk`.)"""
    on_data, piped, dp, z3 = s.d > 1, s.piped, s.dp, s.zero == 3
    zero3_e = piped & z3 & (s.ep > 1)
    # ZeRO-1 too is an all-reduce here on every compiler (compiled for v5e-8 and h100-8): the
    # stage gradients are summed whole where the shard_map is transposed, and the update's slice
    # is not beside the sum. ZeRO-3's gathers transpose to reduce-scatters.
    for kind, on in (("all-reduce", ~z3), ("reduce-scatter", z3)):
        scattered = kind == "reduce-scatter"
        out.add(r.axes, kind, "layer gradients (once, after the tick loop)",
                4 * s.units_dev * s.unit_ne / (dp if scattered else 1), 1, (dp > 1) & on & piped & ~zero3_e, "exposed",
                None, dp)
        out.add(("data",), kind, "MoE expert-weight gradients (once, after the tick loop; data only)",
                4 * s.units_dev * s.unit_ex / (s.d if scattered else 1), 1, on_data & on & piped, "exposed", None, s.d)
    out.add(("expert",), "all-reduce", "layer gradients but experts, over expert (pipelined ZeRO-3)",
            4 * s.units_dev * s.unit_ne, 1, zero3_e, "exposed", None, s.ep)
    out.add(("data",), "reduce-scatter", "layer gradients but experts, over data (pipelined ZeRO-3)",
            4 * s.units_dev * s.unit_ne / s.d, 1, zero3_e & on_data, "exposed", None, s.d)


def _outer_grad_terms(s: Dims, r: _Reduction, out: _Terms) -> None:
    """The embedding, head and final-norm gradients, once per step, as ZeRO asks. The table
    schedules (pipeline_tables.reduce_table) reduce the tables after the tick loop: a
    reduce-scatter over data (on every compiler: an explicit psum_scatter), the 1/data shard then
    summed over expert and pipe; under ZeRO that shard is the update's, without it gathered back
    over data once. The final norm's scale (and every table when data is 1) is summed over pipe,
    the batch axes' sum left to the partitioner, as here."""
    f1b, dp, split = s.f1b, s.dp, r.split
    tables = s.gb * (s.embed_t + s.head_t)
    f1b_z = f1b & (s.zero > 0)
    scattered = f1b & (f1b_z | (s.d > 1))
    for kind, on, shard in r.kinds:
        for layouts, overlap in ((~f1b, "backward"), (f1b & ~scattered, "exposed")):
            out.add(r.axes, kind, "embedding, head and final-norm gradients", (tables + 4 * s.D / s.sp_t_embed) / shard, 1,
                    (dp > 1) & on & ~split & layouts, overlap, None, dp)
    out.add(("data",), "reduce-scatter", "embedding and head gradients (1F1B, over data first)", tables / s.d, 1,
            scattered & (s.d > 1), "exposed", None, s.d)
    out.add(("expert",), "all-reduce", "embedding and head gradients (1F1B, their 1/data shard over expert)",
            tables / s.d, 1, scattered & (s.ep > 1), "exposed", None, s.ep)
    out.add(("data",), "all-gather", "embedding and head gradients (1F1B without ZeRO, gathered back)", tables, 1,
            scattered & ~f1b_z, "exposed", None, s.d)
    out.add(r.axes, "all-reduce", "final-norm gradient (1F1B)", 4 * s.D, 1, scattered & (dp > 1), "exposed", None, dp)
    # ZeRO-1 with experts: the tables' gradients leave the vocabulary ends (model/vocab.py) pinned
    # to their compute layout, so they are reduced over data x expert at once, whole
    out.add(r.axes, "all-reduce", "embedding and head gradients (ZeRO-1 with experts)", tables, 1, split, "backward",
            None, dp)
    out.add(r.axes, "all-reduce", "final-norm gradient (ZeRO-1 with experts)", 4 * s.D, 1, split, "backward", None, dp)


def _zero_gather_terms(s: Dims, out: _Terms) -> None:
    """ZeRO's all-gathers, over data (ZeRO shards over data only), one per parameter array
    (Dims.unit_arrays per unit, Dims.outer_arrays outside). ZeRO-1: the updated float32
    parameters once. ZeRO-3 outside a pipeline: logical.ParamPlacement.to_compute, per unit
    before use; matmul weights are cast on their shard and gathered in the compute dtype
    (layers.param_matmul -> logical.constrain_param; Dims.c: XLA:CPU promotes bfloat16 collectives to
    float32), norm scales and the router stay float32; the `none` policy keeps the gathered
    weights for the backward pass on XLA:CPU, a remat policy gathers them again
    (transformer.remat_policy), and so does XLA:TPU without one (compiled for v5e-8: the layer
    gathers twice per step at remat none; the accelerator model follows the TPU). Pipelined
    ZeRO-3: pipeline.gather_stage_weights, once per step, the matmul weights cast first as
    unpipelined (Dims.unit_stage_gather).
    FP8 (fp8.quantize_weights): the matmul weights are quantised on their shards once per step and
    gathered as their E4M3 bits, 1 byte (u8: no platform promotes it), unpipelined and in every
    pipeline schedule's stages (the table schedules: fp8.quantize_weights_now)."""
    on_data, z1, z3, piped = s.d > 1, s.zero == 1, s.zero == 3, s.piped
    n_outer = s.outer_arrays
    out.add(("data",), "all-gather", "ZeRO-1: updated parameters", 4 * s.params_t / (s.unit_arrays + n_outer),
            s.unit_arrays + n_outer, on_data & z1, "exposed", None, s.d)
    fp32_unit = s.unit_norms + s.router
    unit_gather = (1 if s.fp8 else s.c) * (s.unit_t - fp32_unit) + 4 * fp32_unit
    regather = np.where((s.remat == NONE) & s.cpu, 1, 2)  # XLA:TPU gathers again even without remat
    out.add(("data",), "all-gather", LAYER_GATHERS, unit_gather / s.unit_arrays,
            s.unit_arrays * s.U * regather, on_data & z3 & ~piped, "compute", None, s.d)
    stage_gather = s.Ldev / s.unit * s.unit_stage_gather
    out.add(("data",), "all-gather", "ZeRO-3: stage weights (once per step)", stage_gather / s.unit_arrays,
            s.unit_arrays, on_data & z3 & piped, "exposed", None, s.d)
    outer_gather = s.c * (s.outer_t - s.D) + 4 * s.D
    out.add(("data",), "all-gather", "ZeRO-3: embedding, head, final norm", outer_gather / n_outer, n_outer,
            on_data & z3, "compute", None, s.d)
