"""Quickstart: a tiny llama-style model on the built-in corpus, data x tensor parallel.

    pip install -e . && parallax train experiments/quickstart.py

Mesh: data=4 x tensor=2 on 8 devices (8 simulated CPU devices when no accelerator is found).
Batch arithmetic: 16 sequences x 128 tokens = 2,048 tokens per step, 4 sequences per data shard;
300 steps = 614,400 tokens (~5% of the ~11.6 MB training split of the stdlib corpus).
Model: d_model 128, 4 layers, 4 heads (head dim 32), 2 kv heads, SwiGLU d_ff 512, vocab 256
(bytes): 1.05M parameters. On a 2-core CPU it finishes in under 3 minutes.
"""

from parallax.config import Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="quickstart",
        mesh=MeshConfig(data=-1, tensor=2),
        model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256),
        parallel=ParallelConfig(zero=1, remat="none"),
        optim=OptimConfig(warmup_steps=30),
        train=TrainConfig(steps=300, global_batch=16, seq_len=128, lr=3e-3, eval_every=100, log_every=10),
    )
