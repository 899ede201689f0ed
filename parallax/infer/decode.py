"""KV-cache decoding of a trained checkpoint, on a mesh the user names.

`restore_run(workdir, cfg)` reads the newest checkpoint of a training workdir into a layout of
`cfg` (train/build.py: any mesh; checkpoint.py reads each shard straight into its placement).
`saved_config(workdir)` is the run's config, from the checkpoint's meta (checkpoint.make_meta).

`Decoder` runs the model with `decode=True` (model/attention.py): a fixed-size cache
[L, B, S, K, H] per key and value, laid out by the same logical rules as the training
activations (batch over the batch axes, kv heads over tensor). Two jitted programs: the prefill
(the whole prompt once, [B, P]) and the step (one token, [B, 1]); each compiles once for its
shapes, so decoding never retraces per token. The new token is sampled inside each program
(`sample_logits`: greedy at temperature 0, else top-k, then top-p over the temperature-scaled
softmax), with the key `fold_in(key(seed), i)` for the i-th new token: a seed fixes the text.

What decoding computes differs from the training forward in two stated ways:
- MoE layers route each token on its own, dropless (`capacity_factor` 0): with capacity limits a
  later token could evict an earlier one's expert slot, which no causal decoder can reproduce. It
  equals the training forward wherever that forward drops nothing.
- FP8 checkpoints decode in the compute dtype (model.dtype) without FP8 matmuls: the float32
  master weights are the parameters; the FP8 scales are restored and left unused.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import Config, UserError, apply_overrides, flatten
from parallax.model.moe import LOCAL
from parallax.model.transformer import Transformer
from parallax.parallel.sharding import BATCH_AXES, compute_rules, logical_context, logical_shardings
from parallax.train.build import Build, build
from parallax.train.checkpoint import CheckpointError, Checkpoints, Restored


# ----------------------------------------------------------------------------------------------
# The run's config and its checkpoint


def config_from_flat(flat: dict[str, Any]) -> Config:
    """A Config from `flatten`'s form (a checkpoint's meta). Keys this version does not know are
    left out (a field since removed); fields the meta lacks keep their defaults (added since)."""
    known = flatten(Config())
    return apply_overrides(Config(), [f"{k}={v!r}" for k, v in flat.items() if k in known])


def saved_config(workdir: str | Path) -> tuple[Config, int]:
    """(the run's config, the step) from the newest checkpoint whose meta reads; one line if none."""
    import orbax.checkpoint as ocp

    ckpts = Checkpoints(workdir)
    if not ckpts.workdir.is_dir():
        raise CheckpointError(f"workdir {str(workdir)!r} does not exist")
    steps = ckpts.steps()
    if not steps:
        raise CheckpointError(f"workdir {str(workdir)!r} holds no checkpoint (no finalized step in "
                              f"{str(ckpts.directory)!r}); train it first with `parallax train`")
    options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    with ocp.CheckpointManager(ckpts.directory, options=options,
                               item_handlers={"meta": ocp.JsonCheckpointHandler()}) as manager:
        for step in reversed(steps):
            try:
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                return config_from_flat(meta["config"]), step
            except Exception:  # unreadable meta: the restore reports it; try the next older one
                continue
    raise CheckpointError(f"no checkpoint in {str(ckpts.directory)!r} has a readable meta item")


def restore_run(workdir: str | Path, cfg: Config, devices: list[jax.Device] | None = None) -> tuple[Build, Restored]:
    """The newest readable checkpoint of `workdir` laid out by `cfg` on `devices` (None: all).
    The whole TrainState is read (optimizer state too: checkpoint.py's restore, with its shape
    checks and its fallback past damaged steps)."""
    built = build(cfg, devices)
    return built, Checkpoints(workdir, cfg.checkpoint).restore(cfg, built.layout)


def sampling_config(cfg: Config, mesh_sets: list[str], n_devices: int) -> Config:
    """The run's config laid out for decoding: the mesh data=1 x tensor=<the run's tensor, when
    the devices allow> (then the user's `mesh.*` settings), unpipelined, no expert axis, no
    sequence parallelism (a step has T=1), ZeRO 0 and no remat (nothing is differentiated), and a
    global batch that fits the mesh (the layout's init shapes only; decoding sets its own B)."""
    for s in mesh_sets:
        if not s.strip().startswith("mesh."):
            raise UserError(f"--set {s!r}: only mesh.* may be set here (the model is the checkpoint's)")
    t = cfg.mesh.tensor if 0 < cfg.mesh.tensor <= n_devices and n_devices % cfg.mesh.tensor == 0 else 1
    mesh = apply_overrides(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=1, tensor=t, pipe=1,
                                                                               expert=1)), mesh_sets).mesh
    if mesh.pipe != 1 or mesh.expert != 1:
        raise UserError(f"mesh.pipe={mesh.pipe}, mesh.expert={mesh.expert}: decoding runs the layers unpipelined "
                        "with every expert on each device; set mesh.pipe=1 and mesh.expert=1")
    if cfg.model.n_kv_heads % max(mesh.tensor, 1):
        raise UserError(f"mesh.tensor={mesh.tensor} must divide model.n_kv_heads={cfg.model.n_kv_heads} "
                        "(the KV cache's heads are split over tensor)")
    par = dataclasses.replace(cfg.parallel, microbatches=1, schedule="gpipe", repeats=1, sequence_parallel=False,
                              zero=0, remat="none")
    dp = mesh.data if mesh.data > 0 else n_devices // max(mesh.tensor, 1)
    train = dataclasses.replace(cfg.train, global_batch=max(dp, 1), grad_accum=1)
    return dataclasses.replace(cfg, mesh=mesh, parallel=par, train=train)


def mesh_devices(cfg: Config, devices: list[jax.Device]) -> list[jax.Device]:
    """The first devices the mesh needs (all of them when an axis is -1)."""
    sizes = dataclasses.asdict(cfg.mesh)
    if -1 in sizes.values():
        return devices
    n = int(np.prod(list(sizes.values())))
    if n > len(devices):
        raise UserError(f"mesh {sizes} needs {n} devices but {len(devices)} are available")
    return devices[:n]


# ----------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class Sampling:
    """How each new token is chosen. temperature 0: greedy (argmax); top_k 0: no top-k cut;
    top_p 1: no nucleus cut."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not self.temperature >= 0 or not np.isfinite(self.temperature):
            raise UserError(f"--temperature: must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"--top-k: must be >= 0 (0: off), got {self.top_k}")


def sample_logits(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """[B, V] float32 logits -> [B] int32 tokens. Top-k keeps the k most likely, top-p then the
    smallest most-likely prefix whose renormalised mass reaches p (the most likely always stays);
    categorical over what is left at `temperature`. Temperature 0 is the argmax. The knobs are
    traced scalars: other values do not recompile."""
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] most likely first (ties: lower id first)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    keep = jnp.arange(v)[None, :] < jnp.where(top_k > 0, top_k, v)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    keep = keep & (jnp.cumsum(probs, axis=-1) - probs < top_p)  # mass before this token < p
    choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def decode_model(cfg: Config) -> Transformer:
    """The run's model with KV caches, single-device math (no FP8, no ZeRO-3 placer), MoE
    dropless (module docstring). Every expert is on each device: the sampling mesh has expert=1."""
    m = cfg.model
    if m.moe.num_experts and m.moe.dispatch == "capacity":
        m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, capacity_factor=0.0))
    return Transformer(m, exchange=LOCAL, decode=True)


def check_lengths(prompt_len: int, max_new_tokens: int, context: int, seq_len: int) -> None:
    """The prompt and the new tokens must fit in the cache's `context` positions (one line if not)."""
    if prompt_len < 1:
        raise UserError("--prompt: empty (no tokens); give at least one character")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > context:
        raise UserError(
            f"the prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} = {prompt_len + max_new_tokens} "
            f"exceeds the context of {context} positions (default train.seq_len={seq_len}, the length the "
            "model was trained on; --context allocates a longer cache, rope extrapolating)")


@dataclass
class Generation:
    tokens: np.ndarray  # [B, N] int32 new tokens (N <= max_new_tokens: all rows may stop early)
    logits: list[np.ndarray]  # per new token [B, V] float32 (when asked for), else []
    timing: dict[str, float]


class Decoder:
    """Prefill and per-token step for `batch` rows and a cache of `context` positions, on the
    mesh of `built` (its rules and devices) with `params` in their layout shardings."""

    def __init__(self, built: Build, params: Any, batch: int, context: int):
        self.cfg, self.mesh, self.params = built.cfg, built.mesh, params
        self.batch, self.context = batch, context
        shards = int(np.prod([self.mesh.shape[a] for a in BATCH_AXES]))
        if batch % shards:
            raise UserError(f"{batch} sample(s) do not split over the mesh's {shards} batch shards (mesh.data); "
                            f"use a multiple of {shards}, or mesh.data=1")
        self.model = decode_model(self.cfg)
        self.rules = compute_rules(self.cfg.parallel)
        boxed = jax.eval_shape(lambda: self.model.init(jax.random.key(0), jnp.zeros((batch, context), jnp.int32)))
        specs = nn.get_partition_spec(boxed["cache"])
        self.cache_shardings = logical_shardings(specs, self.mesh, self.rules)
        self._cache_shapes = nn.unbox(boxed["cache"])
        self.tokens_sharding = NamedSharding(self.mesh, P(BATCH_AXES))
        replicated = NamedSharding(self.mesh, P())
        param_shardings = jax.tree.map(lambda x: x.sharding, params)
        knobs = (replicated,) * 4  # key, temperature, top_k, top_p
        outs = (self.tokens_sharding, NamedSharding(self.mesh, P(BATCH_AXES, None)), self.cache_shardings)
        self._jitted = jax.jit(self._run, in_shardings=(param_shardings, self.cache_shardings, self.tokens_sharding)
                               + knobs, out_shardings=outs, donate_argnums=(1,))
        self._compiled: dict[int, Any] = {}  # tokens per call (P: the prefill, 1: the step) -> executable
        self._empty = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._cache_shapes),
                              out_shardings=self.cache_shardings)

    def _run(self, params, cache, tokens, key, temperature, top_k, top_p):
        """[B, T] tokens at the cache's next positions -> (sampled [B], last logits [B, V], cache)."""
        def last_logits(m: Transformer, t: jax.Array) -> jax.Array:
            x, _ = m.run_blocks(m.embed_tokens(t))
            return m.head(x[:, -1:])[:, 0]  # the head on the last position only: [B, V]

        with logical_context(self.mesh, self.rules):
            logits, updated = self.model.apply({"params": params, "cache": cache}, tokens, method=last_logits,
                                               mutable=["cache"])
            token = sample_logits(logits, key, temperature, top_k, top_p)
        return token, logits, updated["cache"]

    def compiled(self, t: int) -> Any:
        """The program for [B, t] tokens per call, compiled once (t = P: the prefill; 1: the step)."""
        if t not in self._compiled:
            scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)  # noqa: E731
            key = jax.eval_shape(lambda: jax.random.key(0))
            self._compiled[t] = self._jitted.lower(
                self.params, jax.eval_shape(self._empty), jax.ShapeDtypeStruct((self.batch, t), jnp.int32), key,
                scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32)).compile()
        return self._compiled[t]

    def check_lengths(self, prompt_len: int, max_new_tokens: int) -> None:
        check_lengths(prompt_len, max_new_tokens, self.context, self.cfg.train.seq_len)

    def generate(self, prompts: np.ndarray, max_new_tokens: int, sampling: Sampling,
                 on_token: Callable[[np.ndarray], None] | None = None, stop_id: int = -1,
                 keep_logits: bool = False) -> Generation:
        """[B, P] int prompt tokens -> the new tokens. `on_token([B])` sees each as it comes;
        decoding stops early once every row has produced `stop_id` (>= 0)."""
        sampling.check()
        prompts = np.asarray(prompts, np.int32)
        if prompts.ndim != 2 or prompts.shape[0] != self.batch:
            raise UserError(f"prompts: expected [{self.batch}, P] token ids, got shape {prompts.shape}")
        self.check_lengths(prompts.shape[1], max_new_tokens)
        base = jax.random.key(sampling.seed)
        knobs = (jnp.float32(sampling.temperature), jnp.int32(sampling.top_k), jnp.float32(sampling.top_p))
        t0 = time.perf_counter()
        prefill, step = self.compiled(prompts.shape[1]), self.compiled(1)
        t1 = time.perf_counter()
        tokens = jax.device_put(prompts, self.tokens_sharding)
        token, logits, cache = prefill(self.params, self._empty(), tokens, jax.random.fold_in(base, 0), *knobs)
        out, kept, done = [], [], np.zeros(self.batch, bool)
        first = None
        for i in range(max_new_tokens):
            if i:
                token, logits, cache = step(self.params, cache, token[:, None], jax.random.fold_in(base, i), *knobs)
            host = np.asarray(token)
            if first is None:
                first = time.perf_counter()
            out.append(host)
            if keep_logits:
                kept.append(np.asarray(logits))
            if on_token is not None:
                on_token(host)
            done |= host == stop_id
            if stop_id >= 0 and done.all():
                break
        end = time.perf_counter()
        n = len(out)
        timing = {"compile_s": t1 - t0, "prefill_s": first - t1, "decode_s": end - first, "new_tokens": n,
                  "tokens_per_s": (n - 1) * self.batch / (end - first) if n > 1 and end > first else None}
        return Generation(np.stack(out, axis=1), kept, timing)
