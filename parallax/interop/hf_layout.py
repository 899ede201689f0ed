"""Hugging Face Llama/Mistral/Mixtral <-> parallax: the config translation and the tensor map.

Pure Python and NumPy (no JAX): `parallax import-hf` and `export-hf` (interop/hf.py) drive it.

The two models compute the same function (tests/test_hf.py shows it against `transformers`):
HF's Llama stores q/k already permuted for rotate-half rope, which is parallax's convention
(attention.apply_rope), so no weight is permuted; GQA's query head n reads kv head n // G in
both. Only the layouts differ: HF keeps one [out, in] matrix per projection, per layer (and per
expert), parallax fuses q/k/v into one [D, K, G+2, H] kernel and gate/up into [D, 2, F], and
stacks every block parameter on a leading L axis (one scan over the layers).

A `Part` is one HF tensor: which parallax leaf it fills, over which leading unit axes (the layer
L, and the expert E for expert weights), which region of one unit it is, and how the region maps
to HF's shape: reshaped to [in, out] at `split` and transposed, or as it is (`split` 0).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from parallax.config import ModelConfig, MoEConfig, UserError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
# What transformers assumes for a field config.json leaves out (its config classes' defaults).
DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.001},
}
# Tensors some checkpoints carry that hold nothing parallax (or transformers) loads: rope's inverse
# frequencies, computed from rope_theta.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The model fields that config.json fixes: `import-hf --set` may not change them.
FIXED_MODEL_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "tie_embeddings",
                      "rope_theta", "norm_eps", "moe.num_experts", "moe.top_k", "moe.every", "moe.d_ff",
                      "moe.shared_experts", "moe.renormalize")


class HFError(UserError):
    """A checkpoint or config parallax cannot read or represent: one line naming the file, tensor or field."""


# ----------------------------------------------------------------------------------------------
# config.json -> ModelConfig and back


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{str(path)!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{str(path)!r} cannot be read as JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(value, dict):
        raise HFError(f"{str(path)!r}: expected a JSON object, got {type(value).__name__}")
    return value


def model_type(hf: dict, where: str) -> str:
    kind = hf.get("model_type")
    archs = hf.get("architectures") or []
    if kind not in ARCHITECTURES:
        raise HFError(f"{where}: model_type={kind!r} is not supported (parallax reads {', '.join(ARCHITECTURES)}); "
                      f"architectures={archs}")
    if archs and list(archs) != [ARCHITECTURES[kind]]:
        raise HFError(f"{where}: architectures={archs} is not supported for model_type={kind!r} "
                      f"(parallax reads {ARCHITECTURES[kind]})")
    return kind


def _field(hf: dict, key: str, where: str, kind: type = int) -> Any:
    if key not in hf or hf[key] is None:
        raise HFError(f"{where}: field {key!r} is missing")
    value = hf[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise HFError(f"{where}: {key}={value!r} must be a positive integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise HFError(f"{where}: {key}={value!r} must be a positive number")
    return value


def _rope_theta(hf: dict, kind: str, where: str) -> float:
    """rope_theta from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`;
    any scaling (linear, dynamic, yarn, llama3, ...) is refused: parallax implements plain rope."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        rtype = params.get("rope_type", params.get("type", "default"))
        if rtype != "default":
            raise HFError(f"{where}: rope_parameters.rope_type={rtype!r} is not implemented (parallax's rope is the "
                          "unscaled 'default')")
        return float(_field(params, "rope_theta", f"{where}: rope_parameters", float))
    scaling = hf.get("rope_scaling")
    if scaling is not None and (not isinstance(scaling, dict)
                                or scaling.get("rope_type", scaling.get("type")) != "default"):
        raise HFError(f"{where}: rope_scaling={scaling!r} is not implemented (parallax's rope is unscaled)")
    return float(_field({**DEFAULTS[kind], **hf}, "rope_theta", where, float))


def model_config(hf: dict, where: str) -> ModelConfig:
    """The parallax ModelConfig of an HF config.json; refuses (naming the field) what it cannot represent."""
    kind = model_type(hf, where)
    full = {**DEFAULTS[kind], **{k: v for k, v in hf.items() if v is not None}}
    d, n = _field(full, "hidden_size", where), _field(full, "num_attention_heads", where)
    k = _field(full, "num_key_value_heads", where) if "num_key_value_heads" in full else n
    for key in ("attention_bias", "mlp_bias"):
        if full.get(key):
            raise HFError(f"{where}: {key}=true is not supported (parallax's projections have no bias)")
    act = full.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{where}: hidden_act={act!r} is not supported (parallax's MLP is SwiGLU: silu)")
    if d % n:
        raise HFError(f"{where}: hidden_size={d} is not a multiple of num_attention_heads={n}")
    if full.get("head_dim") not in (None, d // n):
        raise HFError(f"{where}: head_dim={full['head_dim']} is not supported: parallax's head_dim is "
                      f"hidden_size / num_attention_heads = {d // n}")
    if n % k:
        raise HFError(f"{where}: num_attention_heads={n} is not a multiple of num_key_value_heads={k}")
    if full.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(f"{where}: partial_rotary_factor={full['partial_rotary_factor']} is not supported (rope on every "
                      "dimension)")
    moe = MoEConfig()
    if kind == "mixtral":
        if full.get("router_jitter_noise", 0.0):
            raise HFError(f"{where}: router_jitter_noise={full['router_jitter_noise']} is not supported "
                          "(parallax's router adds no noise)")
        e, top = _field(full, "num_local_experts", where), _field(full, "num_experts_per_tok", where)
        # Dropless (capacity_factor 0), as Mixtral: every token reaches its top-k experts. No z-loss.
        moe = MoEConfig(num_experts=e, top_k=top, every=1, capacity_factor=0.0, renormalize=True,
                        aux_loss_weight=float(full.get("router_aux_loss_coef", 0.001)), z_loss_weight=0.0)
    return ModelConfig(
        d_model=d, n_layers=_field(full, "num_hidden_layers", where), n_heads=n, n_kv_heads=k,
        d_ff=_field(full, "intermediate_size", where), vocab_size=_field(full, "vocab_size", where),
        dtype="bfloat16" if full.get("dtype", full.get("torch_dtype")) == "bfloat16" else "float32",
        tie_embeddings=bool(full.get("tie_word_embeddings", False)), rope_theta=_rope_theta(hf, kind, where),
        norm_eps=float(_field(full, "rms_norm_eps", where, float)), moe=moe,
    )


def check_sequence(hf: dict, seq_len: int, where: str) -> None:
    """A sliding window shorter than train.seq_len attends differently from parallax's full causal
    attention; one at least as long is the same function on every sequence parallax trains on."""
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True) and window < seq_len:
        raise HFError(f"{where}: sliding_window={window} is shorter than train.seq_len={seq_len}; parallax attends to "
                      f"the whole sequence: set train.seq_len <= {window}")


def hf_config(m: ModelConfig, base: dict | None, seq_len: int) -> dict:
    """config.json for `m`: `base` (the imported model's own config.json) with the model fields set
    from `m`, or a fresh Llama/Mixtral one. Refuses what HF's classes cannot represent."""
    e = m.moe
    if e.num_experts and (e.every != 1 or e.shared_experts or not e.renormalize):
        what = ("model.moe.every=%d" % e.every if e.every != 1 else
                "model.moe.shared_experts=%d" % e.shared_experts if e.shared_experts else "model.moe.renormalize=False")
        raise HFError(f"{what} has no Mixtral equivalent (Mixtral: every block MoE, no shared experts, renormalized "
                      "top-k gates)")
    kind = "mixtral" if e.num_experts else "llama"
    if base is not None and base.get("model_type") in ARCHITECTURES and (base["model_type"] == "mixtral") == (kind == "mixtral"):
        kind, out = base["model_type"], dict(base)
    else:
        out = {"max_position_embeddings": seq_len, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
               "rope_scaling": None}
        if kind == "mixtral":
            out.update(sliding_window=None, router_jitter_noise=0.0)
    out.update(architectures=[ARCHITECTURES[kind]], model_type=kind, hidden_size=m.d_model,
               intermediate_size=m.moe.d_ff or m.d_ff, num_hidden_layers=m.n_layers,
               num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.d_model // m.n_heads,
               vocab_size=m.vocab_size, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings)
    if isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": m.rope_theta}
    else:
        out["rope_theta"] = m.rope_theta
    if kind == "mixtral":
        out.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k,
                   router_aux_loss_coef=e.aux_loss_weight)
    out["dtype" if "dtype" in out else "torch_dtype"] = "float32"  # the float32 master weights are written
    return out


# ----------------------------------------------------------------------------------------------
# The tensor map


@dataclass(frozen=True)
class Part:
    name: str  # HF tensor name; {i} the layer, {e} the expert
    leaf: str  # parallax parameter path, 'layers/attn/qkv/kernel'
    units: int  # leading unit axes of the leaf: 0 (not stacked), 1 (L), 2 (L, E)
    region: tuple = ()  # index into one unit (after the unit axes); () the whole unit
    split: int = 0  # HF [out, in] = region.reshape(prod(region[:split]), -1).T; 0: HF's shape is the region's

    def names(self, leaf_shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
        """(unit index, HF name) for every unit of the leaf."""
        for unit in np.ndindex(*leaf_shape[: self.units]):
            yield unit, self.name.format(i=unit[0] if unit else 0, e=unit[1] if len(unit) > 1 else 0)

    def region_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        # a zero-stride view: indexing it costs nothing, whatever the leaf's size
        return np.broadcast_to(np.zeros((), np.float32), leaf_shape[self.units:])[self.region].shape

    def hf_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        r = self.region_shape(leaf_shape)
        return r if not self.split else (math.prod(r[self.split:]), math.prod(r[: self.split]))

    def to_hf(self, region: np.ndarray) -> np.ndarray:
        if not self.split:
            return np.ascontiguousarray(region)
        return np.ascontiguousarray(region.reshape(math.prod(region.shape[: self.split]), -1).T)

    def from_hf(self, w: np.ndarray, leaf_shape: tuple[int, ...]) -> np.ndarray:
        return w if not self.split else w.T.reshape(self.region_shape(leaf_shape))


def parts(m: ModelConfig) -> list[Part]:
    """Every HF tensor of the model `m` describes, in the order transformers' own checkpoints list them."""
    g = m.n_heads // m.n_kv_heads
    layer = "model.layers.{i}."
    out = [Part("model.embed_tokens.weight", "embed/embedding", 0)]
    out += [
        Part(layer + "self_attn.q_proj.weight", "layers/attn/qkv/kernel", 1, (slice(None), slice(None), slice(0, g)), 1),
        Part(layer + "self_attn.k_proj.weight", "layers/attn/qkv/kernel", 1, (slice(None), slice(None), g), 1),
        Part(layer + "self_attn.v_proj.weight", "layers/attn/qkv/kernel", 1, (slice(None), slice(None), g + 1), 1),
        Part(layer + "self_attn.o_proj.weight", "layers/attn/out/kernel", 1, (), 2),
        Part(layer + "input_layernorm.weight", "layers/attn_norm/scale", 1),
        Part(layer + "post_attention_layernorm.weight", "layers/mlp_norm/scale", 1),
    ]
    if m.moe.num_experts:
        moe = layer + "block_sparse_moe."
        out += [
            Part(moe + "gate.weight", "layers/moe/router", 1, (), 1),
            Part(moe + "experts.{e}.w1.weight", "layers/moe/wi", 2, (slice(None), 0), 1),
            Part(moe + "experts.{e}.w3.weight", "layers/moe/wi", 2, (slice(None), 1), 1),
            Part(moe + "experts.{e}.w2.weight", "layers/moe/wo", 2, (), 1),
        ]
    else:
        out += [
            Part(layer + "mlp.gate_proj.weight", "layers/mlp/wi/kernel", 1, (slice(None), 0), 1),
            Part(layer + "mlp.up_proj.weight", "layers/mlp/wi/kernel", 1, (slice(None), 1), 1),
            Part(layer + "mlp.down_proj.weight", "layers/mlp/wo/kernel", 1, (), 1),
        ]
    out.append(Part("model.norm.weight", "final_norm/scale", 0))
    if not m.tie_embeddings:
        out.append(Part("lm_head.weight", "logits/kernel", 0, (), 1))
    return out


def check_leaves(all_parts: list[Part], leaf_shapes: dict[str, tuple[int, ...]]) -> None:
    """Every parallax parameter is filled by some part (else the map is out of date with the model)."""
    missing = sorted(set(leaf_shapes) - {p.leaf for p in all_parts})
    if missing:
        raise HFError(f"parallax parameters {missing} have no Hugging Face tensor in the map (interop/hf_layout.py)")


# ----------------------------------------------------------------------------------------------
# Reading a safetensors checkpoint


class Checkpoint:
    """DIR's safetensors: `model.safetensors`, or shards listed by `model.safetensors.index.json`.
    Opening reads only the headers (names, shapes, dtypes); `read` loads one tensor."""

    def __init__(self, directory: Path):
        from safetensors import safe_open  # a runtime dependency, loaded when used

        self.directory = directory
        index, single = directory / INDEX_FILE, directory / SINGLE_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFError(f"{str(index)!r} has no 'weight_map' object")
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [SINGLE_FILE]
        else:
            raise HFError(f"{str(directory)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.file_of: dict[str, str] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        self.dtype_of: dict[str, str] = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise HFError(f"{str(path)!r} (listed in {INDEX_FILE}) does not exist")
            try:
                with safe_open(str(path), framework="numpy") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        self.file_of[key], self.shape_of[key], self.dtype_of[key] = name, tuple(s.get_shape()), s.get_dtype()
            except Exception as e:  # safetensors raises its own SafetensorError on a bad header
                raise HFError(f"{str(path)!r} is not a readable safetensors file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
        if index.is_file():
            for key, name in weight_map.items():
                if self.file_of.get(key) != name:
                    raise HFError(f"tensor {key!r}: {INDEX_FILE} lists it in {name!r}, which does not hold it")

    def read(self, name: str) -> np.ndarray:
        """One tensor as float32 (bfloat16 and float16 widen exactly)."""
        from safetensors import safe_open

        path = str(self.directory / self.file_of[name])
        if self.dtype_of[name] in ("F32", "F16", "F64"):
            with safe_open(path, framework="numpy") as f:
                return f.get_tensor(name).astype(np.float32, copy=False)
        import jax  # safetensors' NumPy reader has no bfloat16: read through JAX, on the host CPU

        with jax.default_device(jax.devices("cpu")[0]), safe_open(path, framework="flax") as f:
            return np.asarray(f.get_tensor(name)).astype(np.float32)

    def check(self, all_parts: list[Part], leaf_shapes: dict[str, tuple[int, ...]], tied: bool) -> None:
        """Every tensor the model needs is present with the shape the parallax model implies;
        no tensor is left over that parallax would drop."""
        wanted = set()
        for part in all_parts:
            shape = part.hf_shape(leaf_shapes[part.leaf])
            for _, name in part.names(leaf_shapes[part.leaf]):
                wanted.add(name)
                if name not in self.shape_of:
                    raise HFError(f"{str(self.directory)!r}: tensor {name!r} is missing (the model config.json "
                                  "describes needs it)")
                if self.shape_of[name] != shape:
                    raise HFError(f"tensor {name!r} in {self.file_of[name]!r} has shape {list(self.shape_of[name])}; "
                                  f"the parallax model from config.json expects {list(shape)}")
        ignorable = ("lm_head.weight",) if tied else ()  # tied: transformers reuses the embedding too
        extra = sorted(n for n in self.shape_of if n not in wanted and n not in ignorable
                       and not n.endswith(IGNORED_SUFFIXES))
        if extra:
            raise HFError(f"tensor {extra[0]!r} in {self.file_of[extra[0]]!r} has no place in the parallax model "
                          f"({len(extra)} such tensor{'s' * (len(extra) > 1)}); is config.json this checkpoint's?")


# ----------------------------------------------------------------------------------------------
# Writing one


class Shards:
    """safetensors files of at most `max_bytes` (a tensor larger than that gets a file of its own)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, Any] = {}
        self.size, self.count, self.total = 0, 0, 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: Any) -> None:
        if self.pending and self.size + tensor.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.size += tensor.nbytes
        self.count += 1
        self.total += tensor.nbytes

    def flush(self) -> None:
        from safetensors.numpy import save_file

        name = f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, str(self.directory / name), metadata={"format": "pt"})  # transformers wants "pt"
        self.files.append((name, list(self.pending)))
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        if self.pending or not self.files:
            self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.directory / self.files[0][0], self.directory / SINGLE_FILE)
            return
        weight_map = {}
        for k, (tmp, names) in enumerate(self.files, 1):
            final = f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(self.directory / tmp, self.directory / final)
            weight_map.update({t: final for t in names})
        write_json(self.directory / INDEX_FILE, {"metadata": {"total_size": self.total}, "weight_map": weight_map})


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KiB', '1000' -> bytes (HF's max_shard_size spelling)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = text.strip().upper()
    number = s.rstrip("KMGIB")
    try:
        value = float(number) * units[s[len(number):]]
    except (ValueError, KeyError):
        raise HFError(f"--max-shard-size={text!r}: expected a size such as 5GB, 500MB or 1000000") from None
    if value < 1:
        raise HFError(f"--max-shard-size={text!r}: must be at least 1 byte")
    return int(value)


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(os.scandir(path))
