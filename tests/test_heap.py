"""The heap-simulator replay (parallax/analysis/heap.py): its wire decoder, and its peak against
memory_analysis() on XLA:CPU and on the compile-only XLA:GPU target (h100-8); and the cost
model's XLA:GPU terms read off those traces (cost.GPU_*) against the compiled peak at 1B."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from parallax.analysis.audit import audit, compile_step
from parallax.analysis.heap import DUMP_OPTIONS, _fields, dumped_peak
from parallax.config import Config, Fp8Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
from test_targets import CFG, cuda_plugin  # noqa: F401 - the fixture: a failure under CI without the plugin


def test_the_wire_decoder_reads_varints_strings_and_fixed_fields():
    # field 1 varint 300 (two bytes), field 2 bytes 'ab', field 3 fixed32, field 4 fixed64, field 35 varint 7
    message = bytes([0x08, 0xAC, 0x02, 0x12, 0x02, 0x61, 0x62, 0x1D, 1, 2, 3, 4, 0x21, *range(8), 0x98, 0x02, 0x07])
    assert _fields(message) == [(1, 300), (2, b"ab"), (3, bytes([1, 2, 3, 4])), (4, bytes(range(8))), (35, 7)]


def test_the_replayed_peak_is_the_cpu_temporaries_and_names_its_buffers(tmp_path):
    def step(x):  # the dump options select the module named jit_step
        y = jnp.sin(x) @ x
        return (jnp.cos(y) @ y).sum()

    compiled = jax.jit(jax.grad(step)).lower(jnp.ones((512, 512))).compile(
        {**DUMP_OPTIONS, "xla_dump_to": str(tmp_path)})
    temp = compiled.memory_analysis().temp_size_in_bytes
    peak = dumped_peak(str(tmp_path))
    assert 0.9 * temp <= peak.bytes <= temp, (peak.bytes, temp)
    assert sum(b.bytes for b in peak.buffers) == peak.bytes
    # four [512, 512] float32 values (1 MiB each) meet at the peak; the dots are named by their op_name
    assert peak.bytes >= 4 * 2**20
    assert any("dot_general" in b.op_name for b in peak.buffers), peak.buffers


def test_the_replayed_peak_holds_the_gpu_targets_temporaries(cuda_plugin, tmp_path):  # noqa: F811
    step = compile_step(CFG, {**DUMP_OPTIONS, "xla_dump_to": str(tmp_path)}, "h100-8")
    peak = dumped_peak(str(tmp_path))
    temp = step.memory["temp"]
    # the allocator packs the live buffers into the temporary allocation with little slack
    assert 0.9 * temp <= peak.bytes <= temp, (peak.bytes, temp)
    assert any("Transformer" in b.op_name for b in peak.buffers), peak.buffers


def test_a_dump_without_the_proto_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        dumped_peak(str(tmp_path))


# A Llama-3.2-1B shape on data 4 x tensor 2 (experiments/targets.py's calibration rows "1b dp x tp,
# ZeRO-1/h100-8" and "1b FP8 dp x tp/h100-8"): XLA:GPU compiles it in seconds on this machine.
LLAMA_1B = ModelConfig(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256,
                       dtype="bfloat16", rope_theta=500000.0)


@pytest.mark.parametrize("fp8, remat", [(False, "full"), (True, "full"), (False, "dots")], ids=["bf16", "fp8", "dots"])
def test_the_gpu_memory_terms_hold_the_compiled_peak_at_1b(cuda_plugin, fp8, remat):  # noqa: F811
    """cost.GPU_*: the terms read off these programs' heap traces. The accelerator fit they replace
    said +18.7% (bf16) here; issue 15's bound is 10%. remat=dots keeps two [B, T, D] stacks per
    layer (x and the attention output), not three: +13% before (the MLP output counted)."""
    cfg = Config(name="1b", model=LLAMA_1B, mesh=MeshConfig(data=4, tensor=2),
                 parallel=ParallelConfig(zero=1, remat=remat), fp8=Fp8Config(enabled=fp8),
                 train=TrainConfig(global_batch=32, seq_len=4096))
    a = audit(cfg, None, "h100-8")
    assert abs(a["memory"]["error"]) <= 0.05, a["memory"]


def test_the_gpu_memory_terms_hold_a_gpipe_peak_at_1b(cuda_plugin):  # noqa: F811
    """GPipe on h100-16 (experiments/targets.py's "1b GPipe, ZeRO-1" layout): the peak falls in a
    tick's backward, where the chunk's float32 gradient stack, the tick's saved inputs read back
    and the stack outputs' cotangent with its copy sit beside one unit's working set (cost.py's
    gpu_tick; read off the flagship's h100-64 trace). Without them: -7.0%."""
    cfg = Config(name="1b", model=LLAMA_1B, mesh=MeshConfig(data=4, tensor=2, pipe=2),
                 parallel=ParallelConfig(zero=1, remat="full", microbatches=8),
                 train=TrainConfig(global_batch=32, seq_len=4096))
    a = audit(cfg, None, "h100-16")
    assert abs(a["memory"]["error"]) <= 0.05, a["memory"]


def test_interleaved_1f1b_holds_one_chunks_weight_gradient(cuda_plugin):  # noqa: F811
    """Interleaved 1F1B's tick runs the VJP of one chunk (1/v of the stage), so the weight
    gradient beside the accumulator is the chunk's: Llama 2 70B at data 4 x pipe 16, v 5,
    ZeRO-3, remat save_attn_mlp on h100-64 (the planner's second choice there) compiles to 53.1
    GiB; counting the whole stage's gradient the model said 66.9 (+26%)."""
    from parallax.analysis.presets import PRESETS

    pre = PRESETS["llama2-70b"]
    cfg = Config(name="70b", model=pre.model, mesh=MeshConfig(data=4, pipe=16),
                 parallel=ParallelConfig(zero=3, remat="save_attn_mlp", microbatches=128,
                                         schedule="interleaved_1f1b", repeats=5),
                 train=TrainConfig(global_batch=pre.global_batch, seq_len=pre.seq_len))
    a = audit(cfg, None, "h100-64")
    assert abs(a["memory"]["error"]) <= 0.05, a["memory"]
