"""Circular pipeline: data=2 x tensor=2 x pipe=2 on 8 devices, 2 layer chunks per stage.

    parallax train experiments/pipe_circular.py

Each of the 2 stages holds 2 chunks of 1 layer (4 layers = repeats 2 x pipe 2 x 1); 4
microbatches go round the ring twice. Ticks per step: R*M + P - 1 = 2*4 + 1 = 9; bubble
(P-1)/(R*M+P-1) = 1/9 = 11%, against 1/5 = 20% for GPipe with the same M (metrics.jsonl logs
`bubble_fraction` and `pipeline_ticks`).
Batch arithmetic: 16 sequences x 128 tokens = 2,048 tokens per step; 4 microbatches of 4
sequences, 2 per data shard. 120 steps = 245,760 tokens of the built-in corpus. Runs in the CPU
quickstart budget (8 simulated devices, under 3 minutes on 2 cores).
"""

from parallax.config import Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="pipe_circular",
        mesh=MeshConfig(data=2, tensor=2, pipe=2),
        model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256),
        parallel=ParallelConfig(zero=1, microbatches=4, schedule="circular", repeats=2),
        optim=OptimConfig(warmup_steps=20),
        train=TrainConfig(steps=120, global_batch=16, seq_len=128, lr=3e-3, eval_every=60, log_every=10),
    )
