"""Cloud TPU pod slice: v5p-1024 = 512 chips on 128 hosts, data=512 with ZeRO-3 (FSDP), a ~70B model.

`parallax plan experiments/multihost_tpu_512.py --devices 512 --device tpu-v5p` ranks this first
(predicted MFU 54%, 42 GiB per chip): the ICI torus makes FSDP's per-layer all-gathers cheap, and
each chip holds 1/512 of the parameters, gradients and optimizer state. data=128 x tensor=4 (one
host's 4 chips per tensor group) is third, at 51.5%.
JAX reads the slice layout from the TPU metadata server: no flags needed.

    gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=all \
        --command "cd parallax && parallax train experiments/multihost_tpu_512.py --workdir /mnt/shared/tpu512"

(setup in experiments/README.md; the workdir must be a filesystem that every host mounts). With
several slices (multislice), make_mesh puts the slice boundary on pipe, then data
(mesh_utils.create_hybrid_device_mesh).
Batch arithmetic: 1,024 sequences x 4,096 tokens = 4,194,304 tokens per step, 2 per data shard.
Model: d_model 8192, 80 layers, 64 heads (head dim 128), 8 kv heads, SwiGLU d_ff 28672, vocab 256
(bytes of the built-in corpus; set data.source and model.vocab_size for a token file): about
69B matmul parameters, bf16 compute, full remat.
"""

from parallax.config import Config, MeshConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="multihost_tpu_512",
        mesh=MeshConfig(data=512, tensor=1),
        model=ModelConfig(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=256,
                          dtype="bfloat16"),
        parallel=ParallelConfig(zero=3, remat="full"),
        optim=OptimConfig(warmup_steps=2000),
        train=TrainConfig(steps=100000, global_batch=1024, seq_len=4096, lr=1.5e-4, eval_every=1000, log_every=10),
    )
