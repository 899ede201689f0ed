"""Plain ssh hosts: 2 hosts x 4 GPUs = 8 devices, data=8 with ZeRO-3 (FSDP).

On every host (same command, its own --process-id; host0 is the coordinator):

    parallax train experiments/multihost_ssh_8.py --coordinator host0:8476 --num-processes 2 --process-id 0   # host0
    parallax train experiments/multihost_ssh_8.py --coordinator host0:8476 --num-processes 2 --process-id 1   # host1

The workdir (default runs/multihost_ssh_8) must be one shared directory (NFS) on both hosts:
Orbax writes the checkpoints cooperatively, process 0 alone writes metrics.jsonl.
Try it on one CPU machine (two processes on loopback, 4 simulated devices each):

    for i in 0 1; do parallax train experiments/multihost_ssh_8.py --set model.n_layers=2 \
        --set model.d_model=64 --set model.d_ff=256 --set train.seq_len=64 --set train.steps=20 \
        --set model.dtype=float32 --workdir /tmp/ssh8 \
        --coordinator 127.0.0.1:8476 --num-processes 2 --process-id $i & done; wait

Layout: `parallax plan experiments/multihost_ssh_8.py --devices 8 --device h100` ranks data=8 with
ZeRO-3 first (predicted MFU 54%, 9.4 GiB per device); a 0.4B model needs no tensor split. For a
bigger model, `--set mesh.data=2 --set mesh.tensor=4` keeps each tensor group inside one host.
Batch arithmetic: 32 sequences x 2,048 tokens = 65,536 tokens per step, 4 sequences per data
shard. Model: d_model 1024, 24 layers, 16 heads (head dim 64), 8 kv heads, SwiGLU d_ff 4096,
vocab 256 (bytes of the built-in corpus; set data.source and model.vocab_size for a token file):
about 0.4B parameters, bf16 compute.
"""

from parallax.config import Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="multihost_ssh_8",
        mesh=MeshConfig(data=8, tensor=1),
        model=ModelConfig(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, d_ff=4096, vocab_size=256,
                          dtype="bfloat16"),
        parallel=ParallelConfig(zero=3, remat="dots"),
        optim=OptimConfig(warmup_steps=200),
        train=TrainConfig(steps=5000, global_batch=32, seq_len=2048, lr=3e-4, eval_every=500, log_every=10),
    )
