"""MoE at the quickstart's activated size: the quickstart model with every 2nd block's FFN a
Mixture-of-Experts layer, on data=2 x tensor=2 x expert=2.

    parallax train experiments/moe_ep.py
    python experiments/report.py runs/quickstart runs/moe_ep --out experiments/results --name dense_vs_moe

Equal activated FLOPs to experiments/quickstart.py: each MoE layer has 8 SwiGLU experts of d_ff
256 and routes each token to 2 of them, so a token's FFN work equals the dense d_ff 512 (plus the
router, D x E). Parameters: 2.23M in all, 1.05M activated per token (printed by `parallax train`).
Capacity factor 1.25 per sequence of 128 tokens: C = ceil(1.25 x 128 x 2 / 8) = 40 slots per expert.
Mesh: the 2 MoE layers' experts 4 per device over `expert`, each expert's hidden dim split over
`tensor`; elsewhere `expert` is data parallelism (batch over data x expert = 4 shards, as in the
quickstart's data=4). Batch arithmetic as the quickstart: 16 x 128 = 2,048 tokens per step, 300 steps.
"""

from parallax.config import Config, MeshConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="moe_ep",
        mesh=MeshConfig(data=2, tensor=2, expert=2),
        model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=256,
                          moe=MoEConfig(num_experts=8, top_k=2, every=2, d_ff=256, capacity_factor=1.25)),
        parallel=ParallelConfig(zero=1, remat="none"),
        optim=OptimConfig(warmup_steps=30),
        train=TrainConfig(steps=300, global_batch=16, seq_len=128, lr=3e-3, eval_every=100, log_every=10),
    )
