"""The one owner of a layout's rules: what a config may ask of a mesh, and what follows from it.

Pure Python and numpy, no JAX: the CLI checks a config before JAX starts, and the planner
evaluates the same rules over every candidate layout at once.

- `RULES` is the single table of cross-field and cross-axis constraints (the mesh against the
  model, the batch, ZeRO, the pipeline schedules, MoE, FP8, sequence parallelism, the noise
  scale) and of the platform guards (what XLA:CPU cannot compile or run); the data's own rules
  are config.check_data's. Each rule is one predicate over a `View` of the config and the
  layout, written with numpy operators so that it reads either one layout (scalars: `Parallelism.of` raises the first rule that fails, naming
  the field) or a grid of them (arrays: `legal`, which `plan.candidates` filters with).
- `Parallelism` is a validated layout: mesh sizes, ZeRO stage, remat, microbatches, schedule,
  sequence parallelism, and what follows (batch shards, whether the stack is pipelined, the
  pipeline `Schedule` with its work table, ticks and bubble). `train_state.make_layout` lays out
  only a `Parallelism`, so an unchecked config cannot be laid out.
- `pipelined`, `ticks`, `bubble`, `buffer_slots` and `lockstep_bubble` are the vectorised
  formulas that the cost model and the planner read; `Schedule` computes its own from its table
  and the tests hold the two equal. They live in schedules.py (the one owner of schedule facts,
  the tables of 1F1B, interleaved 1F1B and ZB-H1 included) and are re-exported here.

Lifting a limit is one edit here: e.g. repeats with 1F1B is the rule "repeats" below (and, for
what the program does, the pipeline schedule itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from parallax.config import Config, ConfigError, choice_error, chunk_length, expert_d_ff, stack_length
# The schedules' facts live in schedules.py; re-exported here, the layout's one entry point.
from parallax.schedules import (CIRCULAR, GPIPE, INTERLEAVED, ONE_F_ONE_B, OWN_GRADIENTS, SCHEDULES, TABLE_COSTS,  # noqa: F401
                                VIRTUAL, ZB_H1, COMPILED_COSTS, Schedule, Table, bubble, buffer_slots, lockstep_bubble,
                                make_table, own_gradients, pipelined, residual_slots,
                                stage_padding, stages_fill, ticks)

REMATS = ("none", "full", "dots", "save_attn_mlp", "save_attn_mlp_offload")  # transformer.REMAT_POLICIES
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
ZERO_STAGES = (0, 1, 3)
COMPUTE_DTYPES = ("float32", "bfloat16")
FP8_COMPUTE_DTYPES = ("float32", "bfloat16")  # what parallax/model/fp8.py quantises from and returns
FP8_RECIPES = ("delayed", "current")
MOE_DISPATCH = ("capacity", "ragged")
ATTENTIONS = ("auto", "xla", "cudnn", "splash")  # model.attention
# The platform each fused kernel exists on (model/kernels.py); `auto` picks it there.
KERNEL_PLATFORM = {"cudnn": "gpu", "splash": "tpu"}
KERNEL_NAMES = {"cudnn": "cuDNN flash attention", "splash": "the Pallas splash kernel"}
# Splash's query and key blocks are multiples of the TPU's 128 lanes, and T a multiple of a block.
SPLASH_MIN_BLOCK = 128
# cuDNN flash attention (jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention): a
# head dim that is a multiple of 8 and at most 128; bfloat16 or float16 inputs only. (jax allows
# 256 when the *local* GPU is Hopper or later, which a compile-only target on a machine with no
# GPU never is: 160 failed to compile for h100-16384 here, 2026-12-02. 128 holds everywhere.)
CUDNN_HEAD_DIM_MULTIPLE, CUDNN_MAX_HEAD_DIM = 8, 128
NONE, FULL, DOTS, SAVE_ATTN_MLP, SAVE_ATTN_MLP_OFFLOAD = range(5)
# The table schedules keep F's VJP residuals for B and W (parallel/residuals.py) under the remat
# policies that keep more than each unit's input; `full` recomputes the chunk from its input in
# B, one unit at a time (memory first), and offloaded residuals live in host memory, not in the
# tick loop's buffers.
KEEPS_RESIDUALS = (NONE, DOTS, SAVE_ATTN_MLP)


def keeps_residuals(schedule: Any, remat: Any, attention: str = "xla") -> Any:
    """Does a table schedule run B (and W) from F's residuals? Element-wise over codes; the one
    rule the pipeline, the step record, the cost model and the planner read. `attention`: the
    kernel the stage runs (attention_kernel). Not under remat none with a fused kernel (anything
    but 'xla'): its residuals are untyped in the stage (fused_attention.py) and B would compute
    them again from the stage input, about the whole forward."""
    fused = attention != "xla"
    return own_gradients(schedule) & np.isin(remat, KEEPS_RESIDUALS) & ~((np.asarray(remat) == NONE) & fused)


# The layout fields a grid varies (cost.Grid has the same names): mesh sizes, then the parallel
# settings as integers (schedule, remat and grad_reduce as indices into the tuples above).
LAYOUT_FIELDS = ("data", "tensor", "pipe", "expert", "zero", "microbatches", "schedule", "repeats", "remat",
                 "sequence", "grad_reduce")
# the residual stream's dimension sequence parallelism shards (parallel.sequence_parallel_dim); the
# layout field `sequence` is 0 without it, else 1 + its index here
SEQUENCE_DIMS = ("length", "embed")


# ----------------------------------------------------------------------------------------------
# The attention kernel a config runs on a platform


def attention_limit(kernel: str, cfg: Config) -> str | None:
    """The one line saying why `kernel` cannot take `cfg`'s shapes (naming the limit), or None."""
    m, t = cfg.model, cfg.train.seq_len
    h = m.d_model // max(m.n_heads, 1)
    if kernel == "splash" and t % SPLASH_MIN_BLOCK:
        return (f"model.attention='splash': train.seq_len={t} must be a multiple of {SPLASH_MIN_BLOCK} (the "
                f"kernel's query and key blocks are multiples of the TPU's {SPLASH_MIN_BLOCK} lanes)")
    if kernel == "cudnn" and m.dtype != "bfloat16":
        return (f"model.attention='cudnn': model.dtype={m.dtype!r}, but cuDNN flash attention takes bfloat16 "
                "inputs only; use model.dtype=bfloat16 or model.attention=xla")
    if kernel == "cudnn" and (h % CUDNN_HEAD_DIM_MULTIPLE or h > CUDNN_MAX_HEAD_DIM):
        return (f"model.attention='cudnn': head dim model.d_model / model.n_heads = {h}, but cuDNN flash attention "
                f"needs a multiple of {CUDNN_HEAD_DIM_MULTIPLE} and at most {CUDNN_MAX_HEAD_DIM}")
    if kernel in KERNEL_PLATFORM and chunk_length(cfg.parallel.attention_chunk, t) < t:
        return (f"parallel.attention_chunk={cfg.parallel.attention_chunk} splits XLA's attention into query blocks; "
                f"model.attention={kernel!r} never holds the [T, T] scores: set parallel.attention_chunk=0")
    return None


def attention_kernel(cfg: Config, platform: str) -> str:
    """The kernel the model's attention runs on `platform` ('cpu', 'gpu', 'tpu'; 'accelerator':
    unnamed): model.attention when forced; `auto`: the platform's fused kernel when the config's
    shapes fit it (attention_limit; an attention_chunk asks for XLA's blocks), else XLA."""
    asked = cfg.model.attention
    if asked != "auto":
        return asked
    kernel = {"gpu": "cudnn", "tpu": "splash"}.get(platform, "xla")
    return kernel if kernel == "xla" or attention_limit(kernel, cfg) is None else "xla"


# ----------------------------------------------------------------------------------------------
# The rules


class View:
    """What the rules read: the layout fields as numpy values (scalars or a grid of arrays), the
    rest of the config as it is, and the quantities every rule derives the same way."""

    def __init__(self, cfg: Config, layout: dict[str, Any], platform: str):
        self.cfg, self.m, self.platform = cfg, cfg.model, platform
        for name in LAYOUT_FIELDS:
            setattr(self, name, np.asarray(layout[name]))
        self.dp = self.data * self.expert  # batch shards: outside MoE layers `expert` is data parallelism
        self.piped = pipelined(self.pipe, self.microbatches)
        self.f1b = self.piped & own_gradients(self.schedule)  # 1F1B, interleaved, ZB-H1
        self.moe = bool(cfg.model.moe.num_experts)
        self.units = stack_length(cfg.model)
        self.cpu = platform == "cpu"


@dataclass(frozen=True)
class Rule:
    """One constraint: `ok(view)` is true where it holds (numpy-broadcasting); `says(view)`, for
    one layout that breaks it, is the error line, naming the field first. `layout`: whether it
    depends on the layout at all (the planner filters with these; the rest are the config's own)."""

    name: str
    ok: Callable[[View], Any]
    says: Callable[[View], str]
    layout: bool = True


def _tensor_divides(attr: str) -> Rule:
    return Rule(f"tensor_{attr}", lambda v: getattr(v.m, attr) % v.tensor == 0,
                lambda v: f"model.{attr}={getattr(v.m, attr)} must be divisible by mesh.tensor={v.tensor}")


def _divides_seq(field: str) -> Rule:
    """parallel.<field>: positions of T per chunk (config.chunk_length) must divide T."""
    def ok(v: View) -> Any:
        t = v.cfg.train.seq_len
        return np.asarray(t % chunk_length(getattr(v.cfg.parallel, field), t) == 0)

    return Rule(field, ok, lambda v: f"parallel.{field}={getattr(v.cfg.parallel, field)} must divide "
                                     f"train.seq_len={v.cfg.train.seq_len} (or be 0 or >= it: one chunk)", layout=False)


RULES: tuple[Rule, ...] = (
    # names (a bad one makes its index -1 in the View, so it is checked before anything reads it)
    Rule("dtype", lambda v: np.asarray(v.m.dtype in COMPUTE_DTYPES),
         lambda v: choice_error("model.dtype", v.m.dtype, COMPUTE_DTYPES), layout=False),
    Rule("zero", lambda v: np.isin(v.zero, ZERO_STAGES), lambda v: f"parallel.zero: must be 0, 1 or 3, got {v.zero}"),
    Rule("remat", lambda v: v.remat >= 0, lambda v: choice_error("parallel.remat", v.cfg.parallel.remat, REMATS)),
    Rule("schedule", lambda v: v.schedule >= 0,
         lambda v: choice_error("parallel.schedule", v.cfg.parallel.schedule, SCHEDULES)),
    Rule("grad_reduce", lambda v: v.grad_reduce >= 0,
         lambda v: choice_error("parallel.grad_reduce_dtype", v.cfg.parallel.grad_reduce_dtype, GRAD_REDUCE_DTYPES)),
    Rule("sequence_dim", lambda v: np.asarray(v.cfg.parallel.sequence_parallel_dim in SEQUENCE_DIMS),
         lambda v: choice_error("parallel.sequence_parallel_dim", v.cfg.parallel.sequence_parallel_dim, SEQUENCE_DIMS),
         layout=False),
    Rule("dispatch", lambda v: np.asarray(v.m.moe.dispatch in MOE_DISPATCH),
         lambda v: choice_error("model.moe.dispatch", v.m.moe.dispatch, MOE_DISPATCH), layout=False),
    Rule("attention", lambda v: np.asarray(v.m.attention in ATTENTIONS),
         lambda v: choice_error("model.attention", v.m.attention, ATTENTIONS), layout=False),
    Rule("fp8_recipe", lambda v: np.asarray(v.cfg.fp8.recipe in FP8_RECIPES),
         lambda v: choice_error("fp8.recipe", v.cfg.fp8.recipe, FP8_RECIPES), layout=False),
    # the model's own shapes
    Rule("heads", lambda v: np.asarray(v.m.d_model % v.m.n_heads == 0),
         lambda v: f"model.d_model={v.m.d_model} must be divisible by model.n_heads={v.m.n_heads}", layout=False),
    Rule("kv_heads", lambda v: np.asarray(v.m.n_heads % v.m.n_kv_heads == 0),
         lambda v: f"model.n_heads={v.m.n_heads} must be divisible by model.n_kv_heads={v.m.n_kv_heads}", layout=False),
    Rule("rotary", lambda v: np.asarray((v.m.d_model // v.m.n_heads) % 2 == 0),
         lambda v: f"model.d_model / model.n_heads = {v.m.d_model // v.m.n_heads} must be even (rotary)", layout=False),
    # tensor parallelism: Megatron's column/row split of heads, kv heads, mlp and vocab
    *(_tensor_divides(attr) for attr in ("n_heads", "n_kv_heads", "d_ff", "vocab_size")),
    Rule("zero_embed", lambda v: (v.zero == 0) | (v.m.d_model % v.data == 0),
         lambda v: f"model.d_model={v.m.d_model} must be divisible by mesh.data={v.data} for parallel.zero={v.zero} "
                   "(states are sharded on the embed dimension)"),
    # MoE over `expert`
    Rule("expert_needs_moe", lambda v: v.moe | (v.expert == 1),
         lambda v: f"mesh.expert={v.expert} needs MoE layers: set model.moe.num_experts (a multiple of mesh.expert), "
                   "or use mesh.expert=1"),
    Rule("moe_top_k", lambda v: np.asarray(not v.moe or 1 <= v.m.moe.top_k <= v.m.moe.num_experts),
         lambda v: f"model.moe.top_k={v.m.moe.top_k} must be in 1..model.moe.num_experts={v.m.moe.num_experts}",
         layout=False),
    Rule("moe_every", lambda v: np.asarray(not v.moe or (v.m.moe.every >= 1 and v.m.n_layers % v.m.moe.every == 0)),
         lambda v: f"model.moe.every={v.m.moe.every} must be >= 1 and divide model.n_layers={v.m.n_layers}",
         layout=False),
    Rule("moe_experts", lambda v: ~np.asarray(v.moe) | (v.m.moe.num_experts % v.expert == 0),
         lambda v: f"model.moe.num_experts={v.m.moe.num_experts} must be divisible by mesh.expert={v.expert}"),
    Rule("moe_d_ff", lambda v: ~np.asarray(v.moe) | (expert_d_ff(v.m) % v.tensor == 0),
         lambda v: f"model.moe.d_ff={v.m.moe.d_ff} must be >= 0 (0: model.d_ff) with an expert hidden size "
                   f"divisible by mesh.tensor={v.tensor}"),
    Rule("ragged_dropless", lambda v: np.asarray(not v.moe or v.m.moe.dispatch != "ragged"
                                                 or v.m.moe.capacity_factor <= 0),
         lambda v: "model.moe.dispatch='ragged' is dropless: set model.moe.capacity_factor=0 (or <= 0)", layout=False),
    Rule("ragged_fp8", lambda v: np.asarray(not v.moe or v.m.moe.dispatch != "ragged" or not v.cfg.fp8.enabled),
         lambda v: "model.moe.dispatch='ragged' has no FP8 expert matmuls: use dispatch=capacity with fp8.enabled",
         layout=False),
    # the pipeline over `pipe`
    Rule("repeats", lambda v: (v.repeats == 1) | np.isin(v.schedule, VIRTUAL),
         lambda v: f"parallel.repeats={v.repeats} needs a schedule with several chunks per stage (circular or "
                   f"interleaved_1f1b), got parallel.schedule={v.cfg.parallel.schedule!r}"),
    Rule("microbatches", lambda v: (v.pipe == 1) | (v.microbatches >= v.pipe),
         lambda v: f"parallel.microbatches={v.microbatches} must be >= mesh.pipe={v.pipe}"),
    Rule("circular_groups", lambda v: (v.schedule != CIRCULAR) | (v.microbatches % v.pipe == 0),
         lambda v: f"parallel.microbatches={v.microbatches} must be a multiple of mesh.pipe={v.pipe} (circular)"),
    # (Megatron's interleaved order runs microbatches in groups of P through each chunk: the last
    # stage's chunk-c output of a group reaches stage 0 exactly when chunk c+1 is due there)
    Rule("interleaved_groups", lambda v: (v.schedule != INTERLEAVED) | (v.repeats == 1) | (v.microbatches % v.pipe == 0),
         lambda v: f"parallel.microbatches={v.microbatches} must be a multiple of mesh.pipe={v.pipe} "
                   f"(interleaved_1f1b with parallel.repeats={v.repeats})"),
    Rule("stage_fill", lambda v: stages_fill(v.units, v.pipe, v.repeats)[0],
         lambda v: (f"model.n_layers={v.m.n_layers}" if v.units == v.m.n_layers else
                    f"model.n_layers / model.moe.every = {v.units}")
                   + f" is too few for mesh.pipe x parallel.repeats = {v.pipe} x {v.repeats}: padding the stack to a "
                   f"multiple of {v.pipe * v.repeats} would leave a pipeline stage with no layer"),
    # the batch over the batch axes (data x expert), and per microbatch
    Rule("batch", lambda v: v.cfg.train.global_batch % v.dp == 0,
         lambda v: f"train.global_batch={v.cfg.train.global_batch} must be divisible by mesh.data x mesh.expert = "
                   f"{v.dp}"),
    Rule("microbatch_rows", lambda v: (v.microbatches == 1) | (v.cfg.train.global_batch % (v.microbatches * v.dp) == 0),
         lambda v: f"train.global_batch={v.cfg.train.global_batch} must be divisible by parallel.microbatches x "
                   f"mesh.data x mesh.expert = {v.microbatches} x {v.dp}"),
    # gradient accumulation (train.grad_accum): microstep k takes row block k of every batch shard
    Rule("grad_accum_rows", lambda v: v.cfg.train.global_batch % (v.cfg.train.grad_accum * v.dp) == 0,
         lambda v: f"train.grad_accum={v.cfg.train.grad_accum} must divide the per-replica batch train.global_batch / "
                   f"(mesh.data x mesh.expert) = {v.cfg.train.global_batch} / {v.dp}"),
    Rule("grad_accum_pipe", lambda v: (v.cfg.train.grad_accum == 1) | ~v.piped,
         lambda v: f"train.grad_accum={v.cfg.train.grad_accum}: not with pipelining (mesh.pipe={v.pipe}, "
                   f"parallel.microbatches={v.microbatches}); use parallel.microbatches for the pipeline's microbatches"),
    Rule("grad_accum_noise", lambda v: np.asarray(v.cfg.train.grad_accum == 1 or not v.cfg.train.noise_scale),
         lambda v: f"train.grad_accum={v.cfg.train.grad_accum}: not with train.noise_scale (yet)", layout=False),
    # (the `current` recipe scales each microstep by its own amax: never the whole batch's numbers;
    # `delayed` shares the step's scales, and the amaxes combine by max: the whole batch's)
    Rule("grad_accum_fp8", lambda v: np.asarray(v.cfg.train.grad_accum == 1 or not v.cfg.fp8.enabled
                                                or v.cfg.fp8.recipe == "delayed"),
         lambda v: f"train.grad_accum={v.cfg.train.grad_accum}: not with fp8.recipe='current' (each microstep "
                   "would quantise with its own amax, not the batch's); use fp8.recipe='delayed'", layout=False),
    # FP8
    Rule("fp8_logits", lambda v: np.asarray(v.cfg.fp8.enabled or not v.cfg.fp8.logits),
         lambda v: "fp8.logits=True needs fp8.enabled=True (it would be silently ignored)", layout=False),
    Rule("fp8_dtype", lambda v: np.asarray(not v.cfg.fp8.enabled or v.m.dtype in FP8_COMPUTE_DTYPES),
         lambda v: f"fp8.enabled: model.dtype={v.m.dtype!r} cannot be served (needs one of {FP8_COMPUTE_DTYPES})",
         layout=False),
    # train.noise_scale needs two batch sizes, a batch shard's and the global batch's
    Rule("noise_pipe", lambda v: ~(np.asarray(v.cfg.train.noise_scale) & v.piped),
         lambda v: f"train.noise_scale: not with pipelining (mesh.pipe={v.pipe}, parallel.microbatches="
                   f"{v.microbatches}); use mesh.pipe=1 and parallel.microbatches=1"),
    Rule("noise_shards", lambda v: ~np.asarray(v.cfg.train.noise_scale) | (v.dp > 1),
         lambda v: "train.noise_scale: needs mesh.data x mesh.expert > 1 (a batch shard smaller than the global "
                   "batch is the second batch size)"),
    # (the per-shard vmap cannot carry the expert all-to-all's shard_map)
    Rule("noise_expert", lambda v: ~np.asarray(v.cfg.train.noise_scale) | (v.expert == 1),
         lambda v: f"train.noise_scale: not with mesh.expert={v.expert} (yet); use mesh.expert=1"),
    _divides_seq("loss_chunk"),
    _divides_seq("attention_chunk"),
    Rule("noise_ragged",
         lambda v: np.asarray(not (v.cfg.train.noise_scale and v.moe and v.m.moe.dispatch == "ragged")),
         lambda v: "train.noise_scale: not with model.moe.dispatch='ragged' (yet); use dispatch=capacity",
         layout=False),
    # (per-shard amaxes would change the quantisation of the full batch's tensors)
    Rule("noise_fp8", lambda v: np.asarray(not (v.cfg.train.noise_scale and v.cfg.fp8.enabled)),
         lambda v: "train.noise_scale: not with fp8.enabled (per-shard gradients would quantise with per-shard "
                   "amaxes)", layout=False),
    # Packed documents (data.eod_id >= 0): the masked loss is a mean over the whole batch's kept
    # tokens. The pipelines carry the segment ids and positions through the stages; GPipe and
    # circular run the head on the whole batch, 1F1B and grad_accum's microsteps weigh each part's
    # mean by its share of the kept tokens. The noise scale's per-shard gradients would be means
    # of different token counts, and its small-batch estimate assumes equal ones.
    Rule("packed_noise", lambda v: np.asarray(v.cfg.data.eod_id < 0 or not v.cfg.train.noise_scale),
         lambda v: f"data.eod_id={v.cfg.data.eod_id} (packed documents): not with train.noise_scale yet; "
                   "use data.eod_id=-1", layout=False),
    # sequence parallelism shards the residual stream's T over `tensor` (a no-op at tensor=1), or
    # its D (field 2), which tensor always divides: D = heads x head dim, heads over tensor
    Rule("sequence", lambda v: (v.sequence != 1) | (v.tensor == 1) | (v.cfg.train.seq_len % v.tensor == 0),
         lambda v: f"parallel.sequence_parallel: train.seq_len={v.cfg.train.seq_len} must be divisible by "
                   f"mesh.tensor={v.tensor} (the residual stream is sharded over tensor on T; "
                   "parallel.sequence_parallel_dim='embed' shards D instead)"),
    # a fused attention kernel asked for by name: its platform, then its shapes
    Rule("attention_platform", lambda v: np.asarray(v.m.attention not in KERNEL_PLATFORM or v.platform == "accelerator"
                                                    or v.platform == KERNEL_PLATFORM[v.m.attention]),
         lambda v: f"model.attention={v.m.attention!r}: {KERNEL_NAMES[v.m.attention]} runs on "
                   f"{KERNEL_PLATFORM[v.m.attention].upper()} only, and this mesh's devices are {v.platform}; use "
                   "model.attention=auto (the platform's kernel) or xla", layout=False),
    Rule("attention_shapes", lambda v: np.asarray(v.m.attention not in KERNEL_PLATFORM
                                                  or attention_limit(v.m.attention, v.cfg) is None),
         lambda v: attention_limit(v.m.attention, v.cfg), layout=False),
    # what XLA:CPU (jaxlib 0.10.2) cannot do
    Rule("cpu_pipelined_bf16", lambda v: ~(np.asarray(v.cpu and v.m.dtype == "bfloat16") & v.piped),
         lambda v: "model.dtype='bfloat16' with a pipelined layout crashes XLA:CPU; use float32 on CPU"),
    # (the expert > 1 ragged exchange needs ragged_all_to_all, which XLA:CPU rejects: jax #34755)
    Rule("cpu_ragged_exchange",
         lambda v: ~np.asarray(v.cpu and v.moe and v.m.moe.dispatch == "ragged") | (v.expert == 1),
         lambda v: "model.moe.dispatch='ragged' with mesh.expert > 1 needs ragged_all_to_all, which XLA:CPU cannot "
                   "run; on CPU use model.moe.dispatch=capacity with capacity_factor=0 (dropless)"),
    # (XLA:CPU lowers the host offload to nothing, so the option would silently be save_attn_mlp:
    # jaxlib 0.10.2, BUILD_NOTES.md)
    Rule("cpu_remat_offload", lambda v: ~(np.asarray(v.cpu) & (v.remat == SAVE_ATTN_MLP_OFFLOAD)),
         lambda v: "parallel.remat='save_attn_mlp_offload' offloads saved activations to pinned host memory, which "
                   "XLA:CPU cannot do; on CPU use parallel.remat=save_attn_mlp"),
)


def layout_fields(cfg: Config, sizes: dict[str, int]) -> dict[str, int]:
    """One layout's LAYOUT_FIELDS from a config and resolved mesh sizes (-1: a name not known)."""
    p = cfg.parallel
    index = lambda names, name: names.index(name) if name in names else -1  # noqa: E731
    return {**{a: sizes[a] for a in ("data", "tensor", "pipe", "expert")}, "zero": p.zero,
            "microbatches": p.microbatches, "schedule": index(SCHEDULES, p.schedule), "repeats": p.repeats,
            "remat": index(REMATS, p.remat),  # (a bad sequence_parallel_dim reads as length: its own rule names it)
            "sequence": 1 + max(index(SEQUENCE_DIMS, p.sequence_parallel_dim), 0) if p.sequence_parallel else 0,
            "grad_reduce": index(GRAD_REDUCE_DTYPES, p.grad_reduce_dtype)}


def legal(cfg: Config, grid: dict[str, Any], platform: str = "accelerator") -> Any:
    """Where every layout rule holds, over a grid of LAYOUT_FIELDS arrays (the planner's filter);
    the config-only rules are `Parallelism.of`'s to raise."""
    v = View(cfg, grid, platform)
    ok = np.ones(np.broadcast_shapes(*(np.shape(grid[k]) for k in LAYOUT_FIELDS)), bool)
    for rule in RULES:
        if rule.layout:
            ok &= np.asarray(rule.ok(v), bool)
    return ok


def check(cfg: Config, sizes: dict[str, int], platform: str = "accelerator") -> None:
    """Raise ConfigError for the first rule `cfg` breaks on a mesh of `sizes` (after every field's
    own range, config.check_fields)."""
    from parallax.config import check_fields

    check_fields(cfg)
    v = View(cfg, layout_fields(cfg, sizes), platform)
    for rule in RULES:
        if not bool(rule.ok(v)):
            raise ConfigError(rule.says(v))


# ----------------------------------------------------------------------------------------------
# A checked layout


def reduces_once(grad_accum: Any, fp8: bool, ragged: bool, zero: Any, batch_shards: Any, expert: Any) -> Any:
    """train.grad_accum > 1 with each batch shard's gradient accumulated unreduced over the
    microsteps (train_step.accumulate): the reduction over the batch axes runs once per step, not
    once per microstep. Where it does not hold the accumulator is laid out as the parameters and
    the partitioner reduces every microstep: ZeRO-3 (an unreduced accumulator would be the whole
    gathered gradient, `data` times the sharded one), one batch shard (nothing to reduce), the
    expert all-to-all, FP8 and ragged dispatch (their per-shard programs are not vmapped, as
    train.noise_scale's). Element-wise over arrays of layouts (the cost model's grids)."""
    return ((np.asarray(grad_accum) > 1) & (np.asarray(zero) < 3) & (np.asarray(batch_shards) > 1)
            & (np.asarray(expert) == 1) & (not fp8) & (not ragged))


@dataclass(frozen=True)
class Parallelism:
    """A layout that passed every rule: the mesh sizes, the parallel settings, what follows."""

    data: int
    tensor: int
    pipe: int
    expert: int
    zero: int  # 0 replicated, 1 optimizer state over data, 3 parameters too
    remat: str
    microbatches: int
    schedule_name: str
    repeats: int
    sequence_parallel: bool  # as configured; `sequence_sharded` says whether it does anything
    grad_reduce_dtype: str
    units: int  # the scanned stack's length (config.stack_length)
    platform: str  # 'cpu', 'tpu', 'gpu' (or 'accelerator': unnamed, for planning)
    attention: str = "xla"  # the kernel the attention runs on this platform (attention_kernel)
    sequence_parallel_dim: str = "length"  # the residual stream's dimension SP shards (SEQUENCE_DIMS)

    @classmethod
    def of(cls, cfg: Config, sizes: dict[str, int], platform: str = "accelerator") -> Parallelism:
        """Check `cfg` on resolved mesh `sizes` for `platform`; raises ConfigError naming the field."""
        check(cfg, sizes, platform)
        p = cfg.parallel
        return cls(sizes["data"], sizes["tensor"], sizes["pipe"], sizes["expert"], p.zero, p.remat, p.microbatches,
                   p.schedule, p.repeats, p.sequence_parallel, p.grad_reduce_dtype, stack_length(cfg.model), platform,
                   attention_kernel(cfg, platform), p.sequence_parallel_dim)

    @classmethod
    def of_mesh(cls, cfg: Config, mesh: Any) -> Parallelism:
        """For a `jax.sharding.Mesh` (read duck-typed: this module does not import JAX)."""
        return cls.of(cfg, dict(mesh.shape), mesh.devices.flat[0].platform)

    @property
    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "tensor": self.tensor, "pipe": self.pipe, "expert": self.expert}

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def batch_shards(self) -> int:
        """Devices the batch is split over: data x expert (outside MoE layers `expert` is data)."""
        return self.data * self.expert

    @property
    def pipelined(self) -> bool:
        return bool(pipelined(self.pipe, self.microbatches))

    @property
    def sequence_sharded(self) -> bool:
        """Sequence parallelism in effect: asked for, and a tensor axis to shard T (or D) over."""
        return self.sequence_parallel and self.tensor > 1

    @property
    def schedule(self) -> Schedule | None:
        """The pipeline schedule, None when the stack is not pipelined."""
        if not self.pipelined:
            return None
        return Schedule(self.pipe, self.microbatches, self.repeats, self.schedule_name, self.units)

    def matches(self, cfg: Config, sizes: dict[str, int]) -> bool:
        """Whether this was checked for `cfg`'s parallel settings on `sizes`."""
        p = cfg.parallel
        return self.sizes == dict(sizes) and (self.zero, self.remat, self.microbatches, self.schedule_name,
                                              self.repeats, self.sequence_parallel, self.grad_reduce_dtype,
                                              self.units, self.sequence_parallel_dim) == (
            p.zero, p.remat, p.microbatches, p.schedule, p.repeats, p.sequence_parallel, p.grad_reduce_dtype,
            stack_length(cfg.model), p.sequence_parallel_dim)
