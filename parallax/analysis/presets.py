"""The tables the planner reads: device types, model presets, published runs to check against.

Data only (plan.py does the arithmetic): device peaks, memory and link bandwidths; published model
shapes, bent where parallax's model cannot express them (said in each `note`); and the published
large runs whose layout and MFU `parallax plan` is compared with (tests/test_plan.py,
experiments/published_runs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.config import ModelConfig, MoEConfig
from parallax.train.metrics import PEAK_FLOPS

GiB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    peak_bf16: float  # dense FLOP/s
    peak_fp8: float | None
    hbm_bytes: float
    intra_bw: float  # bytes/s per device, one direction, inside the fast domain (NVLink, ICI)
    inter_bw: float  # bytes/s per device across fast domains (InfiniBand/Ethernet NIC, DCN)
    per_host: int  # fast-domain size: devices per NVLink host, or the ICI slice of a TPU
    efficiency: float  # calibrated fraction of peak the step's compute reaches (see CALIBRATION)

    @property
    def platform(self) -> str:
        """The JAX platform whose compiler builds this device's program ('tpu' or 'gpu')."""
        return "tpu" if self.name.startswith("TPU") else "gpu"


# Peaks reuse metrics.PEAK_FLOPS (dense, no sparsity). Memory and links: vendor datasheets (NVIDIA
# A100/H100/H200/DGX B200; Google Cloud TPU system-architecture pages). GPU inter-host: one NIC
# per GPU (HDR 200 Gb/s on A100 systems, NDR 400 Gb/s on Hopper/Blackwell). TPU intra: ICI per
# chip, one direction; inter: data-center network per chip (v5p: 50 Gb/s documented; v4/v5e/v6e
# from per-host NIC figures).
def _d(key, name, hbm_gb, intra_gbs, inter_gbs, per_host, efficiency) -> Device:
    p = PEAK_FLOPS[key]
    return Device(name, p["bf16"], p["fp8"], hbm_gb * 1e9, intra_gbs * 1e9, inter_gbs * 1e9, per_host, efficiency)


# CALIBRATION (BUILD_NOTES.md, "Planner"): efficiency is the fraction of dense peak the whole
# step's compute reaches. Hopper: set so the planner predicts MaxText's 52% BF16 MFU for
# Llama-2-70B on H100; TPU: MaxText's 65% for Llama-2-70B on v5p; A100: its large-GEMM
# efficiency (~0.8 of peak) times ~0.9 for the non-matmul work. B200 has no public figure we
# trust: Hopper's value, lower. None is fitted to the published runs the tests compare against.
DEVICES = {
    "a100-80gb": _d("a100", "A100-80GB SXM", 80, 300, 25, 8, 0.72),
    "h100": _d("h100", "H100 SXM", 80, 450, 50, 8, 0.60),
    "h200": _d("h200", "H200 SXM", 141, 450, 50, 8, 0.60),
    "b200": _d("b200", "B200 (DGX)", 180, 900, 50, 8, 0.55),
    "tpu-v4": _d("tpu v4", "TPU v4", 32 * GiB / 1e9, 300, 3.125, 4096, 0.70),
    "tpu-v5e": _d("tpu v5e", "TPU v5e", 16, 200, 3.125, 256, 0.70),
    "tpu-v5p": _d("tpu v5p", "TPU v5p", 95 * GiB / 1e9, 600, 6.25, 6144, 0.70),
    "tpu-v6e": _d("tpu v6e", "TPU v6e", 32, 400, 12.5, 256, 0.70),
}
ALIASES = {"a100": "a100-80gb", "v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e"}


# ----------------------------------------------------------------------------------------------
# Presets: published shapes, bent where parallax's model cannot express them (said in `note`)


@dataclass(frozen=True)
class Preset:
    model: ModelConfig
    global_batch: int
    seq_len: int
    note: str


def _m(d, L, n, k, f, v, moe: MoEConfig | None = None) -> ModelConfig:
    return ModelConfig(d_model=d, n_layers=L, n_heads=n, n_kv_heads=k, d_ff=f, vocab_size=v, dtype="bfloat16",
                       moe=moe or MoEConfig())


PRESETS = {
    "gpt3-175b": Preset(_m(12288, 96, 96, 96, 32768, 51200), 1536, 2048,
                        "GPT-3 175B (Brown et al. 2020): SwiGLU with d_ff 8D/3 keeps the 4D GELU MLP's parameter "
                        "count; vocab padded to 51200"),
    "dense-1t": Preset(_m(25600, 128, 160, 160, 68352, 51200), 8192, 2048,
                       "Megatron-LM's 1T shape (Narayanan et al. 2021; SwiGLU d_ff ~8D/3); batch 8192 x 2048 "
                       "(16.8M tokens) so that data=128 x pipe=16 has microbatches to fill the pipeline"),
    "llama3-405b": Preset(_m(16384, 126, 128, 8, 53248, 128256), 2048, 8192,
                          "Llama 3 405B (Dubey et al. 2024): 16M-token steps at 8K context; 126 layers: pipe "
                          "sizes that do not divide them pad the stack (uneven stages, as Meta's 16 were)"),
    "palm-540b": Preset(_m(18432, 118, 48, 12, 73728, 258048), 2048, 2048,
                        "PaLM 540B-like (Chowdhery et al. 2022): parallax ties head dim to d_model/heads (384, "
                        "PaLM 256) and shards kv heads over tensor (12 here, PaLM multi-query 1): 586B params; "
                        "vocab 256k padded to 258048 (divisible by 12)"),
    "llama2-70b": Preset(_m(8192, 80, 64, 8, 28672, 32000), 512, 4096, "Llama 2 70B (calibration: MaxText)"),
    "mixtral-8x7b": Preset(_m(4096, 32, 32, 8, 14336, 32000, MoEConfig(num_experts=8, top_k=2)), 1024, 4096,
                           "Mixtral 8x7B-like (Jiang et al. 2024): 8 experts, top-2, every layer MoE; parallax's "
                           "capacity factor 1.25 (Mixtral is dropless)"),
    "deepseek-moe-16b": Preset(_m(2048, 28, 16, 16, 10944, 102400,
                                  MoEConfig(num_experts=64, top_k=6, d_ff=1408, shared_experts=2)), 1024, 4096,
                               "DeepSeekMoE 16B-like (Dai et al. 2024): 64 fine-grained experts (d_ff 1408), top-6, "
                               "2 shared experts; every layer MoE here (DeepSeek's first layer is dense); capacity "
                               "factor 1.25; 4M-token batch (DeepSeek: 4.5M)"),
}


# ----------------------------------------------------------------------------------------------
# Published runs the planner is checked against (tests/test_plan.py, experiments/published_runs.py)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    preset: str
    devices: int
    device: str
    layout: dict  # data, tensor, pipe as published
    mfu: tuple[float, float]  # published MFU range (model FLOPs, BF16 peak)
    source: str
    per_host: int | None = None
    global_batch: int | None = None  # when the run's differs from the preset's
    # The published system had Megatron-style sequence parallelism (Korthikanti et al. 2022). The
    # comparison plans with the published system's features; the planner's unrestricted choice
    # is reported beside it (experiments/published_runs.py).
    sequence_parallel: bool = True
    # For a run planned without sequence parallelism: what the same system published once it had
    # it, the bar for the planner's unrestricted choice (range and source).
    mfu_with_sp: tuple[float, float] | None = None
    source_with_sp: str = ""


PUBLISHED = [
    PublishedRun("Megatron-LM 1T", "dense-1t", 3072, "a100-80gb",
                 {"data": 6, "tensor": 8, "pipe": 64}, (0.39, 0.39),
                 "Narayanan et al. 2021, table 1: 3072 A100s, TP8 PP64 DP6, batch 3072 x 2048, 163 TFLOP/s/GPU "
                 "= 52% of peak counting the recomputed forward (their FLOP formula); 52% x 3/4 = 39% in "
                 "model FLOPs; 2021, before sequence parallelism", global_batch=3072, sequence_parallel=False,
                 mfu_with_sp=(0.542, 0.542),
                 source_with_sp="Korthikanti et al. 2022 (abstract): Megatron-LM with sequence parallelism and "
                 "selective recomputation, 530B on 2240 A100s, 54.2% MFU (42.1% with full recomputation)"),
    PublishedRun("Llama 3 405B", "llama3-405b", 16384, "h100", {"data": 128, "tensor": 8, "pipe": 16}, (0.38, 0.43),
                 "Dubey et al. 2024, table 4: 38-43% BF16 MFU on 8K-16K H100s"),
    PublishedRun("PaLM 540B", "palm-540b", 6144, "tpu-v4", {"data": 512, "tensor": 12, "pipe": 1}, (0.462, 0.462),
                 "Chowdhery et al. 2022: 46.2% MFU on 6144 TPU v4 (2 pods of 3072 chips), 12-way model "
                 "parallel x 256-way FSDP per pod x 2 pods", per_host=3072),
    # (PaLM's layout is GSPMD's "2D finalized" one (Xu et al. 2021), whose activations between the
    # layers stay sharded over the model axis: T 2,048 is no multiple of 12, so the planner shards
    # the residual stream's D, parallel.sequence_parallel_dim='embed'. From the papers as
    # recalled, not re-read here: BUILD_NOTES.md)
]
