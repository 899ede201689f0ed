"""The compiled train step holds the collectives the design promises, no more.

Megatron tensor parallelism: per block, 2 all-reduces of [B/data, T, D] over `tensor` in the
forward pass and 2 in the backward pass. Data parallelism: the gradient all-reduce over `data`
moves exactly the parameter bytes a device holds, inside the backward layer loop (so it can overlap
the next layer's backward). No weight all-gathers unless ZeRO; ZeRO-1 all-gathers the updated
parameters once, outside the layer loops; ZeRO-3 all-gathers each layer's weights inside the loop.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from parallax.analysis.audit import FAST_COMPILE, compile_step

from parallax.analysis.hlo import collectives, groups_to_axes, summarize
from parallax.config import Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
from parallax.parallel.mesh import make_mesh
from parallax.train.train_state import init_state, make_layout

from numerics import bytes_per_device

MODEL = ModelConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256)
B, T, DATA, TENSOR = 8, 32, 4, 2


def _config(zero: int) -> Config:
    return Config(
        mesh=MeshConfig(data=DATA, tensor=TENSOR),
        model=MODEL,
        parallel=ParallelConfig(zero=zero),
        train=TrainConfig(global_batch=B, seq_len=T),
    )


@pytest.fixture(scope="module", params=[0, 1, 3])
def compiled(request):
    cfg = _config(request.param)
    mesh = make_mesh(cfg.mesh)
    layout = make_layout(cfg, mesh)
    hlo = compile_step(cfg, FAST_COMPILE).hlo  # one compile per layout, shared with test_cost_validation.py
    params = layout.abstract_state.params
    param_bytes = sum(
        4 * int(np.prod(s.shard_shape(p.shape)))
        for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(make_layout(_config(0), mesh).param_shardings))
    )  # bytes of the tensor-sharded (not ZeRO-sharded) parameters on one device
    layer_bytes = sum(
        4 * int(np.prod(s.shard_shape(p.shape)[1:]))
        for p, s in zip(jax.tree.leaves(params["layers"]), jax.tree.leaves(make_layout(_config(0), mesh).param_shardings["layers"]))
    )
    return request.param, collectives(hlo, dict(mesh.shape)), param_bytes, layer_bytes


def _forward_loop(found):
    return [c for c in found if c.in_loop and "transpose(" not in c.op_name]


def _backward_loop(found):
    return [c for c in found if c.in_loop and "transpose(" in c.op_name]


ACTIVATION_BYTES = (B // DATA) * T * MODEL.d_model * 4  # one [B/data, T, D] fp32 block output


def test_two_tensor_all_reduces_per_block_forward_and_backward(compiled):
    _, found, _, _ = compiled
    for loop in (_forward_loop(found), _backward_loop(found)):
        tp = [c for c in loop if c.axes == ("tensor",)]
        assert [c.kind for c in tp] == ["all-reduce", "all-reduce"], tp
        assert all(c.bytes == ACTIVATION_BYTES and c.executions == MODEL.n_layers for c in tp), tp


def test_gradient_reduction_moves_the_parameter_bytes_inside_the_backward_loop(compiled):
    _, found, param_bytes, layer_bytes = compiled
    in_loop = [c for c in _backward_loop(found) if c.axes == ("data",) and c.kind in ("all-reduce", "reduce-scatter")]
    assert sum(c.bytes for c in in_loop) == layer_bytes, in_loop
    # XLA may fold a small gradient (the final norm's) into a reduction over (data, tensor).
    total = sum(c.bytes_per_step for c in found if "data" in c.axes and c.kind in ("all-reduce", "reduce-scatter"))
    assert 0 <= total - param_bytes < 1024, (total, param_bytes)  # + scalars (loss, norm pieces)


def test_weight_all_gathers_only_as_zero_promises(compiled):
    zero, found, param_bytes, layer_bytes = compiled
    gathers = [c for c in found if c.kind == "all-gather"]
    assert all(c.axes == ("data",) for c in gathers), gathers
    assert not [c for c in found if c.kind in ("all-to-all", "collective-permute")]
    if zero == 0:
        assert gathers == []
    elif zero == 1:  # the updated parameters, once per step, outside the layer loops
        assert not [c for c in gathers if c.in_loop]
        assert sum(c.bytes_per_step for c in gathers) == param_bytes
    else:  # each layer's weights just before use, inside the forward loop
        fwd = [c for c in gathers if c in _forward_loop(found)]
        assert sum(c.bytes for c in fwd) == layer_bytes
        assert all(c.executions == MODEL.n_layers for c in fwd)
        # never the activations all-reduced over data instead (GSPMD's choice without the pin)
        assert not [c for c in _forward_loop(found) if c.axes == ("data",) and c.kind == "all-reduce"]


def test_zero_shards_state_bytes_per_device():
    mesh = make_mesh(MeshConfig(data=DATA, tensor=TENSOR))
    states = {}
    for zero in (0, 1, 3):
        cfg = _config(zero)
        states[zero] = init_state(cfg, make_layout(cfg, mesh))
    opt = {z: bytes_per_device(s.opt_state) for z, s in states.items()}
    par = {z: bytes_per_device(s.params) for z, s in states.items()}
    count_bytes = 8  # optax's int32 step counts (clip has none; adam and the schedule one each)
    assert opt[1] - count_bytes == (opt[0] - count_bytes) // DATA
    assert opt[3] == opt[1]
    assert par[1] == par[0] and par[3] == par[0] // DATA


def test_replica_group_formats_map_to_mesh_axes():
    shape = {"data": 4, "tensor": 2, "pipe": 1, "expert": 1}
    assert groups_to_axes([[0, 1], [2, 3], [4, 5], [6, 7]], shape) == ("tensor",)
    assert groups_to_axes([[0, 2, 4, 6], [1, 3, 5, 7]], shape) == ("data",)
    assert groups_to_axes([list(range(8))], shape) == ("data", "tensor")
    hlo = "\n".join([
        "ENTRY %main (p: f32[8]) -> f32[8] {",
        "  %a = f32[8]{0} all-reduce(%p), replica_groups=[4,2]<=[8], to_apply=%add",
        "  %b = f32[8]{0} all-reduce(%p), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add",
        "  %c = f32[2]{0} all-gather(%p), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}",
        "  %d = f32[]{0} all-reduce(%p), replica_groups=mesh['axis_0'=4,'axis_1'=2], to_apply=%add",
        "}",
    ])
    got = summarize(collectives(hlo, shape))
    assert got[("all-reduce", ("tensor",))] == {"ops": 1, "executions": 1, "bytes": 32}
    # A mesh laid over a permuted device list (seen under ZeRO-1 with experts, mesh data=4 x
    # expert=2): devices [0,2,4,6,1,3,5,7] grouped along the size-4 axis -> over data only.
    moe_shape = {"data": 4, "tensor": 1, "pipe": 1, "expert": 2}
    permuted = ("ENTRY %main (p: f32[8]) -> f32[8] {\n  %e = f32[8]{0} all-reduce(%p), replica_groups=mesh['axis_0'=1,"
                "'axis_1'=2,'axis_2'=1,'axis_3'=4], device_ids=([4,2]T(1,0)) {'axis_3'}, to_apply=%add\n}")
    assert summarize(collectives(permuted, moe_shape)) == {("all-reduce", ("data",)): {"ops": 1, "executions": 1, "bytes": 32}}
    assert groups_to_axes([[0, 1], [2, 3], [4, 5], [6, 7]], moe_shape) == ("expert",)
    assert got[("all-reduce", ("data",))] == {"ops": 1, "executions": 1, "bytes": 32}
    assert got[("all-gather", ("data",))]["bytes"] == 8
    assert got[("all-reduce", ("data", "tensor"))]["ops"] == 1


def test_zero3_gathers_weights_in_the_compute_dtype(tmp_path):
    """bfloat16 model under ZeRO-3: each weight is cast on its shard and all-gathered in bfloat16,
    half the bytes of its float32 master (logical.constrain_param). Read from the HLO right after
    SPMD partitioning: XLA:CPU later promotes bfloat16 collectives to float32, so its compiled step
    still moves float32 (what the cost model's `cpu` platform counts)."""
    cfg = Config(mesh=MeshConfig(data=4, tensor=2), model=dataclasses.replace(MODEL, dtype="bfloat16"),
                 parallel=ParallelConfig(zero=3, remat="full"), train=TrainConfig(global_batch=8, seq_len=32))
    compile_step(cfg, {**FAST_COMPILE, "xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "spmd-partitioning"})
    (dump,) = tmp_path.glob("*jit_step*after_spmd-partitioning*.txt")
    gathers = re.findall(r"= (\w+)\[[\d,]*\]\{[\d,]*\} all-gather\(", dump.read_text())
    # per block (scanned: one op each) 4 kernels and 2 norm scales, again in the recomputation;
    # outside, the embedding and logits tables and the final norm's scale. Norms stay float32.
    assert sorted(gathers) == ["bf16"] * (2 * 4 + 2) + ["f32"] * (2 * 2 + 1), gathers
