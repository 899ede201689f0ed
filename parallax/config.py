"""Typed, frozen configuration: the whole surface a user can set.

An experiment file defines `get_config() -> Config`; the CLI applies `--set section.field=value`
overrides on top. Values are parsed as Python literals (never evaluated), unknown keys and wrong
types are rejected, and every constraint error names the field it is about.

This module must not import JAX: the CLI reads the config before JAX starts so that it can size
the simulated CPU device count to the mesh.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path


class UserError(ValueError):
    """Something the user can fix (config, data, workdir): one line, exit status 2, no traceback."""


class ConfigError(UserError):
    """A configuration error; the message names the field and the constraint."""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; exactly one may be -1 to absorb the remaining devices."""

    data: int = -1
    tensor: int = 1
    pipe: int = 1
    expert: int = 1


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts FFN (parallax/model/moe.py) in every `every`-th block; num_experts=0 is dense."""

    num_experts: int = 0  # E
    top_k: int = 2  # experts per token
    every: int = 1  # block i is MoE when (i + 1) % every == 0 (the last block of each group)
    d_ff: int = 0  # hidden size of each expert (and shared expert); 0 means model.d_ff
    capacity_factor: float = 1.25  # slots per expert = ceil(cf * T * k / E) per sequence; <= 0 dropless
    renormalize: bool = True  # the k chosen gates of a token sum to 1
    aux_loss_weight: float = 0.01  # Switch/GShard load-balancing loss, mean over MoE layers
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE), mean over MoE layers
    shared_experts: int = 0  # always-on SwiGLU experts beside the routed ones (DeepSeek-style)
    dispatch: str = "capacity"  # capacity (all_to_all, runs everywhere) | ragged (GPU/TPU, dropless)


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 512
    vocab_size: int = 256
    dtype: str = "float32"  # compute dtype; parameters are always float32
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # The attention kernel (model/kernels.py, parallel/fused_attention.py): auto (the platform's
    # fused kernel where the shapes allow it: cuDNN flash attention on GPU, Pallas splash on TPU;
    # XLA on CPU, or with parallel.attention_chunk > 0) | xla | cudnn | splash (forced: refused
    # where the platform or the shapes cannot take it)
    attention: str = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass(frozen=True)
class Fp8Config:
    """FP8 matmuls with per-tensor scaling (parallax/model/fp8.py)."""

    enabled: bool = False
    recipe: str = "delayed"  # delayed (amax history) | current (this step's amax)
    amax_history_length: int = 1024  # as Flax/Praxis/MaxText; Transformer Engine uses 1
    margin: float = 0.0  # scale = amax * 2^margin / fp8_max
    logits: bool = False  # also the output projection (never the embedding lookup)


@dataclass(frozen=True)
class ParallelConfig:
    zero: int = 0  # 0 replicated, 1 optimizer state over data, 3 parameters too (FSDP)
    # none | full | dots | save_attn_mlp (keep the attention output and the MLP gate/up, recompute the
    # rest) | save_attn_mlp_offload (the same two kept in pinned host memory; not on XLA:CPU)
    remat: str = "none"
    microbatches: int = 1  # pipeline microbatches per step (M)
    schedule: str = "gpipe"  # gpipe | circular | 1f1b | interleaved_1f1b | zb_h1
    repeats: int = 1  # layer chunks per pipeline stage (circular; interleaved_1f1b: v)
    # Megatron sequence parallelism: the residual stream between tensor-parallel regions is
    # sharded over `tensor` on T (each tensor all-reduce -> reduce-scatter + all-gather); no-op at tensor=1
    sequence_parallel: bool = False
    # the residual stream's dimension sequence parallelism shards: length (T, Megatron's) | embed
    # (D, as GSPMD's 2D layout: the same bytes and memory where T is no multiple of mesh.tensor)
    sequence_parallel_dim: str = "length"
    # dtype the weight gradients are produced and reduced over the batch axes in (`data`, and
    # `expert` outside MoE layers): float32 as Megatron's main_grad, whatever model.dtype is;
    # bfloat16 halves the reduction's bytes at bf16 rounding of every partial sum
    grad_reduce_dtype: str = "float32"
    # positions of T per chunk of the fused loss head (model/vocab.py): the peak holds one chunk's
    # [B, chunk, V/tensor] float32 logits, never the whole [B, T, V]; 0: all T in one chunk
    loss_chunk: int = 1024
    # query positions per block of XLA's attention (model/attention.py): one block's float32
    # [B, N, chunk, T] scores live instead of [B, N, T, T], recomputed in the backward; 0: all T
    attention_chunk: int = 0


@dataclass(frozen=True)
class OptimConfig:
    # adamw | muon: Muon (optax.contrib.scale_by_muon: Nesterov momentum orthogonalised by
    # Newton-Schulz) for the blocks' matmul kernels, AdamW for embedding, output projection, norms
    # and router (optim.py); both read train.lr on the same schedule
    name: str = "adamw"
    # learning-rate schedule after the linear warmup (optim.py): cosine (decay over the whole run)
    # | wsd (warmup-stable-decay: flat at train.lr, then the last decay_fraction of the steps) | constant
    schedule: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine and wsd decay to lr * min_lr_ratio (constant ignores it)
    decay_fraction: float = 0.1  # wsd: the share of train.steps, at the end, that decays; in (0, 1]
    decay_shape: str = "linear"  # wsd: linear | 1-sqrt (1 - sqrt(progress), Hägele et al. 2024)
    # dtype of AdamW's first moment (optax.adamw's mu_dtype, MaxText's mu_dtype); bfloat16 saves 2
    # bytes per parameter; the second moment and the parameters stay float32
    mu_dtype: str = "float32"
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # <= 0 disables clipping
    muon_beta: float = 0.95  # muon: momentum decay
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per update
    # muon: each update's RMS is scaled to muon_rms (Liu et al. 2025, "Muon is Scalable": 0.2
    # matches AdamW's RMS, so one train.lr and weight_decay serve both halves)
    muon_rms: float = 0.2


@dataclass(frozen=True)
class DataConfig:
    """What the input pipeline (train/input.py) reads: one source or a weighted mixture of them."""

    # "stdlib" (the built-in corpus), a flat binary token file, or a prepared directory (`parallax prepare`)
    source: str = "stdlib"
    # a mixture: several sources as above, each drawn with its weight (share of windows, so of tokens);
    # when set, data.source stays at its default ("stdlib" is then named here if wanted)
    sources: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()  # one positive weight per data.sources entry; () gives equal weights
    shuffle: bool = True  # a seeded shuffle of each source's windows, reshuffled every epoch; False: in order
    prefetch: int = 2  # batches prepared ahead in background threads while the step runs; 0: on the loop's thread
    read_threads: int = 1  # threads preparing them (with prefetch > 0)
    token_dtype: str = "uint16"  # uint16 | uint32, for token files
    val_fraction: float = 0.05  # token files: the last fraction of tokens is validation
    # Packed documents (data.py): >= 0 turns document separation on. Token files: every occurrence
    # of this id ends a document. The built-in corpus: must be 0, the NUL byte appended after each
    # source file (no Python source holds one). -1: no boundaries, one token stream (as before).
    # A prepared directory's manifest names its id: -1 takes it, another value must equal it.
    eod_id: int = -1


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 0
    eval_every: int = 50  # <= 0 disables evaluation
    eval_batches: int = 2
    log_every: int = 1
    max_bad_steps: int = 10  # consecutive non-finite (skipped) steps that stop the run
    noise_scale: bool = False  # estimate the gradient noise scale from per-batch-shard gradients (train_step.py)
    # microsteps per step: the global batch runs as grad_accum scanned microsteps of global_batch / grad_accum
    # rows, gradients summed in float32 (train_step.accumulate); activations of one microstep at a time
    grad_accum: int = 1


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # steps between saves; <= 0 saves only at the end (and on preemption)
    keep: int = 3  # most recent checkpoints kept; >= 2 leaves a fallback if the newest is damaged
    # nice value (0..19) of a save's background threads: the write takes the host's idle cycles,
    # not the step's (0 leaves them at the training process's priority)
    background_nice: int = 19


@dataclass(frozen=True)
class MetricsConfig:
    """Experiment trackers beside metrics.jsonl and TensorBoard (train/tracker.py); off by default,
    and wandb is imported only when `wandb` is on."""

    wandb: bool = False  # every metrics record also goes to Weights & Biases; files under WORKDIR/wandb
    wandb_project: str = "parallax"
    wandb_name: str = ""  # the W&B run's display name; "" is the run's `name`
    wandb_mode: str = "offline"  # offline (no network; `wandb sync` uploads later) | online | disabled


@dataclass(frozen=True)
class Config:
    name: str = "experiment"
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


# ----------------------------------------------------------------------------------------------
# Overrides


def _field_types(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, raw: str, expected: typing.Any) -> typing.Any:
    """Parse `raw` as a literal of the field's declared type (strings may be left unquoted; a
    tuple field takes a literal list or tuple, or bare comma-separated items: `a,b`)."""
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word such as `--set data.source=stdlib`
    if typing.get_origin(expected) is tuple:  # tuple[X, ...]: each item an X
        item = typing.get_args(expected)[0]
        if isinstance(value, (tuple, list)):
            return tuple(_typed(key, v, v if isinstance(v, str) else repr(v), item) for v in value)
        return tuple(_coerce(key, p.strip(), item) for p in raw.split(",")) if raw else ()
    return _typed(key, value, raw, expected)


def _typed(key: str, value: typing.Any, raw: str, expected: type) -> typing.Any:
    """`value` (parsed from `raw`) as the field type `expected`, or the error naming `key`."""
    if expected is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif expected is str:
        return raw if not isinstance(value, str) else value
    raise ConfigError(f"{key}: expected {expected.__name__}, got {raw!r}")


def _replace_path(obj: typing.Any, path: list[str], key: str, raw: str) -> typing.Any:
    """`obj` with the field at `path` (nested dataclasses, e.g. model.moe.top_k) set from `raw`."""
    fields = _field_types(type(obj))
    name, rest = path[0], path[1:]
    prefix = key[: len(key) - len(".".join(path))].rstrip(".")
    if name not in fields:
        where = f"fields of {prefix}" if prefix else "sections"
        raise ConfigError(f"unknown config key {key!r} ({where}: {', '.join(fields)})")
    sub_type = fields[name]
    if dataclasses.is_dataclass(sub_type):
        if not rest:
            raise ConfigError(f"unknown config key {key!r}: a section; set one of its fields, e.g. "
                              f"{key}.{next(iter(_field_types(sub_type)))}=...")
        return dataclasses.replace(obj, **{name: _replace_path(getattr(obj, name), rest, key, raw)})
    if rest:
        raise ConfigError(f"unknown config key {key!r} ({'.'.join(path[:1])} is not a section)")
    return dataclasses.replace(obj, **{name: _coerce(key, raw.strip(), sub_type)})


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `section.field=value` (or `model.moe.field=value`) strings; unknown keys and wrong
    types raise ConfigError."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.steps=10")
        cfg = _replace_path(cfg, key.split("."), key, raw)
    return cfg


def _flat_fields(obj: typing.Any, prefix: str) -> dict[str, typing.Any]:
    out: dict[str, typing.Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat_fields(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def flatten(cfg: Config) -> dict[str, typing.Any]:
    """`{'name': ..., 'mesh.data': -1, 'model.moe.top_k': 2, ...}`: the config as flat keys."""
    return _flat_fields(cfg, "")


# ----------------------------------------------------------------------------------------------
# Validation of the fields themselves; the rules across fields and mesh axes are
# parallelism.py's (the mesh product is checked by mesh.make_mesh)


def resolve_mesh_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """Sizes with the single -1 filled in; raises naming the field on any bad size."""
    sizes = dataclasses.asdict(mesh)
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + k for k in free)}")
    for k, v in sizes.items():
        if v != -1 and v <= 0:
            raise ConfigError(f"mesh.{k}: must be a positive size or -1, got {v}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if n_devices % fixed:
            raise ConfigError(
                f"mesh.{free[0]}=-1: {n_devices} devices are not divisible by the other axes' product {fixed}"
            )
        sizes[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        shape = " x ".join(f"{k}={v}" for k, v in sizes.items())
        raise ConfigError(f"mesh: {shape} needs {fixed} devices but {n_devices} are available")
    return sizes


def devices_needed(mesh: MeshConfig, default: int = 8) -> int:
    """Devices a CPU-only run should simulate: the product, or `default` when an axis is -1."""
    sizes = dataclasses.asdict(mesh)
    fixed = math.prod(v for v in sizes.values() if v > 0)
    if any(v == -1 for v in sizes.values()):
        return max(fixed, default - default % fixed)
    return fixed


# The range of every numeric field, checked (with finiteness for every float) before anything
# starts: (low, high, low excluded, high excluded), None for no bound. Cross-field and mesh
# constraints follow in `parallelism.RULES`. Ints bounded by INT32 are sizes and step counts (the step
# counter is int32); the seed is what jax.random.key accepts. Unlisted ints must fit in int64.
INT32, INT64, FLOAT32_MAX = 2**31 - 1, 2**63 - 1, 3.4028234663852886e38
_SIZE, _COUNT, _POS = (1, INT32, False, False), (0, INT32, False, False), (0.0, None, True, False)
_NONNEG, _UNIT_OPEN_1 = (0.0, None, False, False), (0.0, 1.0, False, True)
FIELD_RANGES: dict[str, tuple] = {
    **{f"model.{k}": _SIZE for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size")},
    "model.rope_theta": _POS, "model.norm_eps": _POS, "model.init_std": _POS,
    "model.moe.num_experts": _COUNT, "model.moe.top_k": _SIZE, "model.moe.every": _SIZE, "model.moe.d_ff": _COUNT,
    "model.moe.shared_experts": _COUNT, "model.moe.aux_loss_weight": _NONNEG, "model.moe.z_loss_weight": _NONNEG,
    "fp8.amax_history_length": _SIZE, "fp8.margin": _NONNEG,
    "parallel.microbatches": _SIZE, "parallel.repeats": _SIZE, "parallel.loss_chunk": _COUNT, "parallel.attention_chunk": _COUNT,
    "optim.warmup_steps": _COUNT, "optim.min_lr_ratio": (0.0, 1.0, False, False), "optim.weight_decay": _NONNEG,
    "optim.b1": _UNIT_OPEN_1, "optim.b2": _UNIT_OPEN_1, "optim.eps": _POS,
    "optim.decay_fraction": (0.0, 1.0, True, False),
    "optim.muon_beta": _UNIT_OPEN_1, "optim.muon_ns_steps": _SIZE, "optim.muon_rms": _POS,
    "data.val_fraction": (0.0, 1.0, True, True), "data.prefetch": (0, 1024, False, False),
    "data.read_threads": (1, 64, False, False),
    "data.eod_id": (-1, 2**32 - 1, False, False),
    **{f"train.{k}": _SIZE for k in ("steps", "global_batch", "seq_len", "eval_batches", "log_every", "max_bad_steps",
                                     "grad_accum")},
    "train.lr": _POS, "train.seed": (0, INT64, False, False),
    "checkpoint.keep": _SIZE, "checkpoint.background_nice": (0, 19, False, False),
}


def _range_text(lo: typing.Any, hi: typing.Any, lo_open: bool, hi_open: bool) -> str:
    if isinstance(lo, int):  # an int field
        low, top = ("-2**63" if lo == -INT64 - 1 else str(lo)), ("2**63-1" if hi == INT64 else str(hi))
        return f"positive (1..{top})" if lo == 1 else f"an integer in {low}..{top}"
    if hi is None:
        return f"a finite number {'>' if lo_open else '>='} {lo:g}"
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def check_fields(cfg: Config) -> None:
    """Every float field finite, every numeric field in its FIELD_RANGES range (the error names the
    field and says the range). Needs no devices: runs before JAX starts."""
    for key, value in flatten(cfg).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and math.isfinite(value) and abs(value) > FLOAT32_MAX:  # inf on the device
            raise ConfigError(f"{key}: must be finite in float32, as the device computes with it (|x| <= 3.4e38), "
                              f"got {value}")
        if key not in FIELD_RANGES and not isinstance(value, int):  # an unlisted float: any finite value
            if not math.isfinite(value):
                raise ConfigError(f"{key}: must be a finite number, got {value}")
            continue
        lo, hi, lo_open, hi_open = FIELD_RANGES.get(key, (-INT64 - 1, INT64, False, False))
        if not math.isfinite(value) or (value <= lo if lo_open else value < lo) or (
                hi is not None and (value >= hi if hi_open else value > hi)):
            shown = f"an integer of {value.bit_length()} bits" if isinstance(value, int) and abs(value) >= 10**30 else value
            raise ConfigError(f"{key}: must be {_range_text(lo, hi, lo_open, hi_open)}, got {shown}")


TOKEN_DTYPES = ("uint16", "uint32")


def data_sources(d: DataConfig) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """(sources, weights) the input reads: data.sources with data.weights (equal when empty), or
    data.source alone with weight 1 (every config before mixtures)."""
    if not d.sources:
        return (d.source,), (1.0,)
    return d.sources, d.weights or (1.0,) * len(d.sources)


def check_data(cfg: Config) -> None:
    """The data settings against the model (the layout's rules are parallelism.py's): checked
    before JAX starts and again where the data is opened (input.open_input). What needs the files
    (a prepared directory's vocabulary and end-of-document id) is input.resolve_data's."""
    d = cfg.data
    if d.token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype: must be 'uint16' or 'uint32', got {d.token_dtype!r}")
    if d.sources and d.source != DataConfig.source:
        raise ConfigError(f"data.source={d.source!r} and data.sources={list(d.sources)}: set one of them "
                          "(a mixture lists every source in data.sources)")
    if d.weights and len(d.weights) != len(d.sources):
        raise ConfigError(f"data.weights: {len(d.weights)} weights for {len(d.sources)} data.sources; give one per "
                          "source (or none: equal weights)")
    for i, w in enumerate(d.weights):
        if not (math.isfinite(w) and w > 0):
            raise ConfigError(f"data.weights[{i}]: must be a finite number > 0, got {w}")
    sources, _ = data_sources(d)
    for i, src in enumerate(sources):
        if not src:
            raise ConfigError(f"data.sources[{i}]: an empty path" if d.sources else "data.source: an empty path")
    stdlib = "stdlib" in sources
    if stdlib and cfg.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} must be >= 256 for data.source='stdlib' (bytes)")
    eod = d.eod_id
    if eod >= cfg.model.vocab_size:
        raise ConfigError(f"data.eod_id={eod} must be < model.vocab_size={cfg.model.vocab_size} (or -1: no documents)")
    if stdlib and eod not in (-1, 0):
        raise ConfigError(f"data.eod_id={eod}: the built-in corpus 'stdlib' marks documents with byte 0 "
                          "(data.eod_id=0) or not at all (-1)")


OPTIMIZERS = ("adamw", "muon")  # optim.name
SCHEDULES = ("cosine", "wsd", "constant")  # optim.schedule
DECAY_SHAPES = ("linear", "1-sqrt")  # optim.decay_shape (wsd)
MU_DTYPES = ("float32", "bfloat16")  # optim.mu_dtype


def choice_error(key: str, value: str, allowed: tuple[str, ...]) -> str:
    """The one line refusing a named choice that is not one of `allowed` (parallelism.RULES too)."""
    return f"{key}: must be one of {', '.join(map(repr, allowed))}, got {value!r}"


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(choice_error(key, value, allowed))


def check_optim(cfg: Config) -> None:
    """The optimizer's named choices (its numeric fields are FIELD_RANGES'): checked before JAX
    starts and again where the optimizer is built (optim.make_optimizer)."""
    o = cfg.optim
    _one_of("optim.name", o.name, OPTIMIZERS)
    _one_of("optim.schedule", o.schedule, SCHEDULES)
    _one_of("optim.decay_shape", o.decay_shape, DECAY_SHAPES)
    _one_of("optim.mu_dtype", o.mu_dtype, MU_DTYPES)


def logs_at(t: TrainConfig, done: typing.Any) -> typing.Any:
    """Whether step `done` (1-based: the count after the step) is one the loop writes a record for
    by schedule: every train.log_every, the evaluations, the last. On Python ints (loop.py) and on
    traced arrays (train_step.py asks FP8 for its telemetry on exactly these steps). The loop also
    writes a --stop-at step and a non-finite step: their records carry no FP8 telemetry."""
    evals = (done % t.eval_every == 0) if t.eval_every > 0 else False
    return (done % t.log_every == 0) | (done == t.steps) | evals


def chunk_length(chunk: int, seq_len: int) -> int:
    """Positions of T per chunk for parallel.loss_chunk and parallel.attention_chunk: `chunk`, or
    all T (one chunk) when it is 0 or >= T. parallelism.RULES checks that it divides T."""
    return chunk if 0 < chunk < seq_len else seq_len


def expert_d_ff(m: ModelConfig) -> int:
    return m.moe.d_ff or m.d_ff


def moe_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group (moe.py: a group is a sequence of `tokens`); a token sends at
    most one assignment to any expert, so `tokens` slots never drop anything: capacity_factor
    <= 0 (dropless) gives every expert all of them. Pure Python: cost.py uses it too."""
    if capacity_factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


def stack_length(m: ModelConfig) -> int:
    """Length of the scanned block stack: one entry per block, or per group of `moe.every`
    blocks (the last one MoE) when `every` > 1."""
    return m.n_layers // m.moe.every if m.moe.num_experts and m.moe.every > 1 else m.n_layers


def default_workdir(cfg: Config) -> Path:
    """runs/<name>; a name that is not one plain path component (a '/', '.', '..') would put the
    workdir elsewhere, so it is refused."""
    name = cfg.name
    if not name or name in (".", "..") or "/" in name or "\0" in name or (os.altsep and os.altsep in name):
        raise ConfigError(f"name: {name!r} is not a plain file name (no '/', not '.' or '..'), so runs/<name> "
                          "would not be a directory under runs/; rename the run or pass --workdir")
    return Path("runs") / name


# ----------------------------------------------------------------------------------------------
# Experiment files


def load_experiment(path: str | Path) -> Config:
    """Import an experiment file and return its `get_config()`; errors name the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"experiment file {str(path)!r} is a directory, not a Python file defining get_config()")
    if not path.is_file():
        raise ConfigError(f"experiment file {str(path)!r} does not exist")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"experiment file {str(path)!r} cannot be read (permission denied)")
    spec = importlib.util.spec_from_file_location(f"parallax_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # sys.exit() at import would otherwise end parallax, maybe with status 0
        raise ConfigError(f"experiment file {str(path)!r} called sys.exit({e.code!r}) while being imported; "
                          "an experiment file must only define get_config()") from e
    except Exception as e:  # the user's file failed to import: say which file and why
        raise ConfigError(f"experiment file {str(path)!r} failed to import: {type(e).__name__}: {e}") from e
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"experiment file {str(path)!r} does not define get_config()")
    try:
        cfg = get_config()
    except SystemExit as e:
        raise ConfigError(f"experiment file {str(path)!r}: get_config() called sys.exit({e.code!r})") from e
    except Exception as e:  # the user's get_config() raised: name the file, keep the reason
        raise ConfigError(f"experiment file {str(path)!r}: get_config() failed: {type(e).__name__}: {e}") from e
    if not isinstance(cfg, Config):
        raise ConfigError(f"{str(path)!r}: get_config() must return parallax.config.Config, got {type(cfg).__name__}")
    check_types(cfg)
    if cfg.name == Config.name:
        cfg = dataclasses.replace(cfg, name=path.stem)
    return cfg


def check_types(cfg: Config) -> None:
    """Every field holds its declared type (experiment files bypass the override parser)."""
    _check_fields(cfg, "")


def _check_fields(obj: typing.Any, prefix: str) -> None:
    for name, expected in _field_types(type(obj)).items():
        value, key = getattr(obj, name), f"{prefix}{name}"
        if dataclasses.is_dataclass(expected):
            if not isinstance(value, expected):
                raise ConfigError(f"{key}: expected {expected.__name__}, got {type(value).__name__}")
            _check_fields(value, key + ".")
            continue
        if typing.get_origin(expected) is tuple:  # tuple[X, ...]: a tuple (not a list: the config is hashable) of X
            item = typing.get_args(expected)[0]
            if not isinstance(value, tuple) or not all(_holds(v, item) for v in value):
                raise ConfigError(f"{key}: expected a tuple of {item.__name__}, got {value!r}")
        elif not _holds(value, expected):
            raise ConfigError(f"{key}: expected {expected.__name__}, got {value!r}")


def _holds(value: typing.Any, expected: type) -> bool:
    """`value` is of the field type `expected` (bool is not an int; an int is a float)."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
