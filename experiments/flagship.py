"""Flagship: all four mesh axes and FP8 at once, MoE blocks inside pipeline stages.

    parallax train experiments/flagship.py                      # 16 simulated CPU devices
    parallax train experiments/flagship.py --set model.d_model=2048 ...   # the same file on a pod

Mesh: data=2 x tensor=2 x pipe=2 x expert=2 = 16 devices (16 simulated CPU devices when no
accelerator is found). Device order puts tensor innermost, then expert, data, pipe outermost.
- pipe: 2 stages, GPipe over 4 microbatches (bubble (P-1)/(M+P-1) = 1/5); each stage holds one
  2-block unit: a dense block, then a MoE block (model.moe.every=2).
- expert: the MoE block's 4 experts, 2 per device, reached by an all-to-all inside the stage's
  shard_map; elsewhere `expert` is more data parallelism (batch over data x expert = 4 shards).
- tensor: heads, the dense FFN and each expert's hidden dimension split in 2.
- data: ZeRO-1 shards the optimizer state over `data`.
- FP8: every block matmul (attention projections, dense FFN, experts) in E4M3/E5M2 with delayed
  scaling (history 16); amaxes pmax-ed over the stage's batch shards, combined over ticks by max.
Batch arithmetic: 16 sequences x 64 tokens = 1,024 tokens per step; 4 microbatches of 4
sequences, 1 per batch shard. 200 steps = 204,800 tokens of the built-in corpus.
Model: d_model 64, 4 blocks, 4 heads (head dim 16), 2 kv heads, dense d_ff 256; 2 MoE layers of
4 SwiGLU experts (d_ff 128), top-2, capacity factor 1.25 per sequence.
"""

from parallax.config import (Config, Fp8Config, MeshConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig,
                             TrainConfig)


def get_config() -> Config:
    return Config(
        name="flagship",
        mesh=MeshConfig(data=2, tensor=2, pipe=2, expert=2),
        model=ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256,
                          moe=MoEConfig(num_experts=4, top_k=2, every=2, d_ff=128, capacity_factor=1.25)),
        fp8=Fp8Config(enabled=True, amax_history_length=16),
        parallel=ParallelConfig(zero=1, microbatches=4),
        optim=OptimConfig(warmup_steps=20),
        train=TrainConfig(steps=200, global_batch=16, seq_len=64, lr=3e-3, eval_every=100, log_every=10),
    )
