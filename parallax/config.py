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


@dataclass(frozen=True)
class Fp8Config:
    """FP8 matmuls with per-tensor scaling (parallax/fp8.py)."""

    enabled: bool = False
    recipe: str = "delayed"  # delayed (amax history) | current (this step's amax)
    amax_history_length: int = 1024  # as Flax/Praxis/MaxText; Transformer Engine uses 1
    margin: float = 0.0  # scale = amax * 2^margin / fp8_max
    logits: bool = False  # also the output projection (never the embedding lookup)


@dataclass(frozen=True)
class ParallelConfig:
    zero: int = 0  # 0 replicated, 1 optimizer state over data, 3 parameters too (FSDP)
    remat: str = "none"  # none | full | dots
    microbatches: int = 1  # pipeline microbatches per step (M)
    schedule: str = "gpipe"  # gpipe | circular | 1f1b
    repeats: int = 1  # layer chunks per pipeline stage (circular schedule)


@dataclass(frozen=True)
class OptimConfig:
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # <= 0 disables clipping


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib" or a path to a flat binary token file
    token_dtype: str = "uint16"  # uint16 | uint32, for token files
    val_fraction: float = 0.05  # token files: the last fraction of tokens is validation


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


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # steps between saves; <= 0 saves only at the end (and on preemption)
    keep: int = 3  # most recent checkpoints kept; >= 2 leaves a fallback if the newest is damaged


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


# ----------------------------------------------------------------------------------------------
# Overrides


def _field_types(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, raw: str, expected: typing.Any) -> typing.Any:
    """Parse `raw` as a literal of the field's declared type (strings may be left unquoted)."""
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word such as `--set data.source=stdlib`
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


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `section.field=value` strings; unknown keys and wrong types raise ConfigError."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.steps=10")
        section, _, name = key.partition(".")
        top = _field_types(Config)
        if key == "name":
            cfg = dataclasses.replace(cfg, name=_coerce(key, raw.strip(), str))
            continue
        if section not in top or not dataclasses.is_dataclass(top[section]):
            raise ConfigError(f"unknown config key {key!r} (sections: {', '.join(top)})")
        sub_cls = top[section]
        fields = _field_types(sub_cls)
        if name not in fields:
            raise ConfigError(f"unknown config key {key!r} (fields of {section}: {', '.join(fields)})")
        value = _coerce(key, raw.strip(), fields[name])
        sub = dataclasses.replace(getattr(cfg, section), **{name: value})
        cfg = dataclasses.replace(cfg, **{section: sub})
    return cfg


def flatten(cfg: Config) -> dict[str, typing.Any]:
    """`{'mesh.data': -1, ...}`: the config as flat keys, e.g. for logging."""
    out: dict[str, typing.Any] = {"name": cfg.name}
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub):
            out.update({f"{f.name}.{k}": v for k, v in dataclasses.asdict(sub).items()})
    return out


# ----------------------------------------------------------------------------------------------
# Validation that needs no devices (the mesh product is checked by mesh.make_mesh)


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


def validate(cfg: Config, sizes: dict[str, int]) -> None:
    """Check the model, batch and parallel settings against resolved mesh sizes."""
    m, t, tr = cfg.model, sizes["tensor"], cfg.train
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}: must be positive, got {getattr(m, name)}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.n_kv_heads}")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.d_model / model.n_heads = {m.d_model // m.n_heads} must be even (rotary)")
    for name in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(m, name) % t:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be divisible by mesh.tensor={t}")
    if m.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype: must be 'float32' or 'bfloat16', got {m.dtype!r}")
    if cfg.parallel.zero not in (0, 1, 3):
        raise ConfigError(f"parallel.zero: must be 0, 1 or 3, got {cfg.parallel.zero}")
    if cfg.parallel.zero and m.d_model % sizes["data"]:
        raise ConfigError(
            f"model.d_model={m.d_model} must be divisible by mesh.data={sizes['data']} "
            f"for parallel.zero={cfg.parallel.zero} (states are sharded on the embed dimension)"
        )
    if cfg.parallel.remat not in ("none", "full", "dots"):
        raise ConfigError(f"parallel.remat: must be 'none', 'full' or 'dots', got {cfg.parallel.remat!r}")
    _validate_pipeline(cfg, sizes)
    if sizes["expert"] != 1:
        raise ConfigError("mesh.expert: expert parallelism needs MoE layers, not built yet; use mesh.expert=1")
    for name in ("steps", "global_batch", "seq_len", "log_every", "eval_batches"):
        if getattr(tr, name) <= 0:
            raise ConfigError(f"train.{name}: must be positive, got {getattr(tr, name)}")
    if tr.lr <= 0:
        raise ConfigError(f"train.lr: must be positive, got {tr.lr}")
    if tr.max_bad_steps <= 0:
        raise ConfigError(f"train.max_bad_steps: must be positive, got {tr.max_bad_steps}")
    if cfg.checkpoint.keep <= 0:
        raise ConfigError(f"checkpoint.keep: must be positive, got {cfg.checkpoint.keep}")
    dp = sizes["data"] * sizes["expert"]
    if tr.global_batch % dp:
        raise ConfigError(
            f"train.global_batch={tr.global_batch} must be divisible by mesh.data x mesh.expert = {dp}"
        )
    mb = cfg.parallel.microbatches
    if mb > 1 and tr.global_batch % (mb * dp):
        raise ConfigError(
            f"train.global_batch={tr.global_batch} must be divisible by parallel.microbatches x mesh.data x "
            f"mesh.expert = {mb} x {dp}"
        )
    if cfg.data.token_dtype not in ("uint16", "uint32"):
        raise ConfigError(f"data.token_dtype: must be 'uint16' or 'uint32', got {cfg.data.token_dtype!r}")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.data.source == "stdlib" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} must be >= 256 for data.source='stdlib' (bytes)")
    _validate_fp8(cfg, sizes)


FP8_COMPUTE_DTYPES = ("float32", "bfloat16")  # what parallax/fp8.py quantises from and returns


def _validate_fp8(cfg: Config, sizes: dict[str, int]) -> None:
    f = cfg.fp8
    if f.recipe not in ("delayed", "current"):
        raise ConfigError(f"fp8.recipe: must be 'delayed' or 'current', got {f.recipe!r}")
    if f.amax_history_length < 1:
        raise ConfigError(f"fp8.amax_history_length: must be >= 1, got {f.amax_history_length}")
    if not (f.margin >= 0 and math.isfinite(f.margin)):
        raise ConfigError(f"fp8.margin: must be a finite number >= 0, got {f.margin}")
    if f.logits and not f.enabled:
        raise ConfigError("fp8.logits=True needs fp8.enabled=True (it would be silently ignored)")
    if not f.enabled:
        return
    if cfg.model.dtype not in FP8_COMPUTE_DTYPES:
        raise ConfigError(f"fp8.enabled: model.dtype={cfg.model.dtype!r} cannot be served (needs one of {FP8_COMPUTE_DTYPES})")
    if sizes["pipe"] > 1 or cfg.parallel.microbatches > 1:
        # The pipeline applies blocks outside the model's apply and would drop the fp8_meta
        # collection; a shard_map stage also needs the amax pmax-ed over pipe (fp8.py, amax_axes).
        raise ConfigError(
            f"fp8.enabled: not supported with pipelining yet (mesh.pipe={sizes['pipe']}, "
            f"parallel.microbatches={cfg.parallel.microbatches}); use mesh.pipe=1 and parallel.microbatches=1"
        )


def _validate_pipeline(cfg: Config, sizes: dict[str, int]) -> None:
    par, p = cfg.parallel, sizes["pipe"]
    if par.schedule not in ("gpipe", "circular", "1f1b"):
        raise ConfigError(f"parallel.schedule: must be 'gpipe', 'circular' or '1f1b', got {par.schedule!r}")
    if par.schedule == "1f1b" and par.zero > 1:
        raise ConfigError(f"parallel.zero={par.zero}: parallel.schedule='1f1b' supports ZeRO 0 and 1")
    if par.microbatches < 1 or par.repeats < 1:
        name = "microbatches" if par.microbatches < 1 else "repeats"
        raise ConfigError(f"parallel.{name}: must be >= 1, got {getattr(par, name)}")
    if par.repeats > 1 and par.schedule != "circular":
        raise ConfigError(f"parallel.repeats={par.repeats} needs parallel.schedule='circular', got {par.schedule!r}")
    if p > 1 and par.microbatches < p:
        raise ConfigError(f"parallel.microbatches={par.microbatches} must be >= mesh.pipe={p}")
    if par.schedule == "circular" and par.microbatches % p:
        raise ConfigError(f"parallel.microbatches={par.microbatches} must be a multiple of mesh.pipe={p} (circular)")
    if cfg.model.n_layers % (p * par.repeats):
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} must be divisible by mesh.pipe x parallel.repeats = {p} x {par.repeats}"
        )


# ----------------------------------------------------------------------------------------------
# Experiment files


def load_experiment(path: str | Path) -> Config:
    """Import an experiment file and return its `get_config()`; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"parallax_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file failed to import: say which file and why
        raise ConfigError(f"experiment file {str(path)!r} failed to import: {type(e).__name__}: {e}") from e
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"experiment file {str(path)!r} does not define get_config()")
    try:
        cfg = get_config()
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
    if not isinstance(cfg.name, str):
        raise ConfigError(f"name: expected str, got {cfg.name!r}")
    for section, sub_cls in _field_types(Config).items():
        if not dataclasses.is_dataclass(sub_cls):
            continue
        sub = getattr(cfg, section)
        if not isinstance(sub, sub_cls):
            raise ConfigError(f"{section}: expected {sub_cls.__name__}, got {type(sub).__name__}")
        for name, expected in _field_types(sub_cls).items():
            value = getattr(sub, name)
            ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok:
                raise ConfigError(f"{section}.{name}: expected {expected.__name__}, got {value!r}")
