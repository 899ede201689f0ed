"""SLURM GPU cluster: 8 nodes x 8 H100 = 64 devices, data=2 x tensor=2 x pipe=16, a ~70B model.

The layout is `parallax plan experiments/multihost_slurm_64.py --devices 64 --device h100`'s first
choice (predicted MFU 39%, 62 GiB per device): tensor=2 stays inside a node's NVLink domain, and
pipe, outermost, carries the only traffic that crosses nodes besides the data-parallel gradient
reduction (one activation send per microbatch per tick). JAX reads the SLURM environment itself:
one process per GPU (JAX's default under SLURM), ranks node-major (SLURM's default block
distribution), so consecutive devices, hence tensor groups, share a node.

    sbatch train64.sbatch   # the script in experiments/README.md; its srun starts on every task
    parallax train experiments/multihost_slurm_64.py --workdir /shared/runs/slurm64

Batch arithmetic: 512 sequences x 4,096 tokens = 2,097,152 tokens per step; 256 microbatches of 2
sequences, one per data shard. Pipeline: 1F1B, 16 stages of 5 layers, bubble (P-1)/(M+P-1) =
15/271 = 5.5%. Model: d_model 8192, 80 layers, 64 heads (head dim 128), 8 kv heads, SwiGLU d_ff
28672, vocab 256 (bytes of the built-in corpus; set data.source and model.vocab_size for a token
file): about 69B matmul parameters, bf16 compute, ZeRO-1, full remat.
"""

from parallax.config import Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="multihost_slurm_64",
        mesh=MeshConfig(data=2, tensor=2, pipe=16),
        model=ModelConfig(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=256,
                          dtype="bfloat16"),
        parallel=ParallelConfig(zero=1, remat="full", microbatches=256, schedule="1f1b"),
        optim=OptimConfig(warmup_steps=2000),
        train=TrainConfig(steps=50000, global_batch=512, seq_len=4096, lr=1.5e-4, eval_every=1000, log_every=10),
    )
