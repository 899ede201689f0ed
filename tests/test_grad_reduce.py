"""Weight gradients leave their matmuls, and are reduced over `data`, in parallel.grad_reduce_dtype.

The claim is about dtypes on the wire, so it is read from the HLO right after SPMD partitioning
(data 4 x tensor 2, bfloat16 model, remat full): XLA:CPU later promotes bfloat16 collectives to
float32, so the optimized CPU HLO cannot tell the two settings apart. Every all-reduce or
reduce-scatter whose replica groups span `data` is counted, not sampled: the matmul weights'
(qkv, out, wi, wo in the scanned block, the embedding, the logits) are in grad_reduce_dtype, one
each, and everything else over data (norm scales, scalars) stays float32. The same is read from
the TPU compiler's own output for a compile-only v5e 2x4 (libtpu, from the test extra). On
c7513aa, before layers.param_matmul, the six matmul-weight reductions were bfloat16 with the
float32 default, in both.

Numerics, against plain autodiff of the cast (`grad_dtype=None`): a float32 model is
bit-identical, and so is a bfloat16 model with grad_reduce_dtype=bfloat16; a bfloat16 model with
float32 gradients has the same loss and gradients within 2^-6 of each leaf's largest magnitude
(the bfloat16 rounding of the plain path's partial sums and of its result: 5.1e-3 seen), and its
matmul-weight gradients are no longer bfloat16 values.
"""
import contextlib
import dataclasses
import io
import os
import platform
import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.analysis.audit import FAST_COMPILE, compile_step

from parallax.analysis.hlo import collectives
from parallax.config import Config, Fp8Config, MeshConfig, ModelConfig, ParallelConfig, TrainConfig
from parallax.analysis.collectives import collective_terms
from parallax.analysis.cost import Grid, Workload
from parallax.model.fp8 import FP8_COLLECTION, Fp8DotGeneral, fp8_variables
from parallax.model.layers import ParamUse
from parallax.model.logical import ParamPlacement
from parallax.parallel.mesh import make_mesh
from parallax.model.transformer import Transformer
from parallax.model.vocab import cross_entropy
from parallax.parallel.sharding import param_placer
from parallax.train.train_state import init_state, make_layout
from parallax.train.train_step import batch_sharding, make_grad_fn, make_train_step

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=256, dtype="bfloat16")
B, T, DATA, TENSOR = 8, 16, 4, 2
MESH_SHAPE = {"data": DATA, "tensor": TENSOR, "pipe": 1, "expert": 1}
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16"}
# Matmul weights per block (qkv, out, wi, wo), outside the stack the embedding and the logits.
BLOCK_WEIGHTS, OUTER_WEIGHTS = 4, 2
BF16_GRAD_RTOL = 2.0**-6  # bfloat16 model, float32 vs bfloat16 weight gradients (see the docstring)


def _config(zero: int, grad: str, remat: str = "full", fp8: bool = False, dtype: str = "bfloat16") -> Config:
    return Config(
        mesh=MeshConfig(data=DATA, tensor=TENSOR),
        model=dataclasses.replace(MODEL, dtype=dtype),
        parallel=ParallelConfig(zero=zero, remat=remat, grad_reduce_dtype=grad),
        fp8=Fp8Config(enabled=fp8, logits=fp8),
        train=TrainConfig(global_batch=B, seq_len=T),
    )


def partitioned_hlo(cfg: Config, dump_dir) -> str:
    """The train step's HLO right after SPMD partitioning (before XLA:CPU promotes bf16)."""
    compile_step(cfg, {**FAST_COMPILE, "xla_dump_to": str(dump_dir), "xla_dump_hlo_pass_re": "spmd-partitioning"})
    (dump,) = dump_dir.glob("*jit_step*after_spmd-partitioning*.txt")
    return dump.read_text()


@dataclasses.dataclass(frozen=True)
class Reduction:
    dtype: str
    dims: tuple[int, ...]
    kind: str
    in_block: bool  # inside the scanned block stack's loop
    backward: bool

    @property
    def elements(self) -> int:
        return int(np.prod(self.dims))


def data_reductions(hlo: str) -> list[Reduction]:
    """Every all-reduce / reduce-scatter whose replica groups span `data`, with its result type."""
    types = {name: (dtype, tuple(int(d) for d in dims.split(",") if d))
             for name, dtype, dims in re.findall(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]", hlo, re.M)}
    return [Reduction(*types[c.name], c.kind, "while/body" in c.op_name, "transpose(" in c.op_name)
            for c in collectives(hlo, MESH_SHAPE) if "data" in c.axes and c.kind in ("all-reduce", "reduce-scatter")]


def weight_gradients(found: list[Reduction]) -> list[Reduction]:
    """The matmul weights' gradient reductions: backward, rank >= 2 (norm scales are vectors)."""
    return [r for r in found if r.backward and len(r.dims) >= 2]


def matmul_weight_elements(cfg: Config) -> Counter:
    """Elements of one device's tensor-sharded (not ZeRO-sharded) matmul weights: per layer for
    the stack, whole for the embedding and logits."""
    layout = make_layout(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=0)),
                         make_mesh(cfg.mesh))
    out = Counter()
    flat = jax.tree_util.tree_leaves_with_path(layout.abstract_state.params)
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(layout.param_shardings)):
        shape = sharding.shard_shape(leaf.shape)
        if jax.tree_util.keystr(path).startswith("['layers']"):
            shape = shape[1:]
        if len(shape) >= 2:
            out[int(np.prod(shape))] += 1
    return out


CASES = {
    **{f"zero{z}_{g}": dict(zero=z, grad=g) for g in ("float32", "bfloat16") for z in (0, 1, 3)},
    "zero3_float32_dots": dict(zero=3, grad="float32", remat="dots"),
    "fp8_zero3_float32": dict(zero=3, grad="float32", fp8=True),
    "fp8_zero0_bfloat16": dict(zero=0, grad="bfloat16", fp8=True),
}


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    """case name -> (config, partitioned HLO), each case compiled once for all the tests here."""
    cache = {}

    def get(case: str) -> tuple[Config, str]:
        if case not in cache:
            cfg = _config(**CASES[case])
            cache[case] = cfg, partitioned_hlo(cfg, tmp_path_factory.mktemp(case))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_every_weight_gradient_is_reduced_over_data_in_grad_reduce_dtype(partitioned, case):
    cfg, hlo = partitioned(case)
    found = data_reductions(hlo)
    weights = weight_gradients(found)
    want = HLO_DTYPE[cfg.parallel.grad_reduce_dtype]
    assert [r.dtype for r in weights] == [want] * (BLOCK_WEIGHTS + OUTER_WEIGHTS), weights
    assert sum(r.in_block for r in weights) == BLOCK_WEIGHTS, weights
    # One reduction per matmul weight, each of that weight's full gradient (a reduce-scatter's
    # result is its 1/data shard).
    sizes = Counter(r.elements * (DATA if r.kind == "reduce-scatter" else 1) for r in weights)
    assert sizes == matmul_weight_elements(cfg), weights
    # Every other float reduction over data (norm-scale gradients, loss and norm scalars) is
    # float32 (ZeRO-1's `pred` ones are the update's finiteness checks).
    others = [r for r in found if r not in weights and r.dtype in ("f32", "bf16")]
    assert others and all(r.dtype == "f32" for r in others), others


@pytest.mark.parametrize("case", ["zero3_float32", "zero3_float32_dots", "fp8_zero3_float32"])
def test_zero3_weights_are_gathered_again_for_the_backward_not_saved(partitioned, case):
    """Remat full and dots recompute the block's gathered weights: the backward gathers the same
    arrays again as the forward (4 kernels, 2 norm scales), in the same dtypes: the compute dtype,
    or under FP8 the kernels' E4M3 bits (u8, half bf16's bytes: quantised once per step on their
    shards, fp8.quantize_weights)."""
    cfg, hlo = partitioned(case)
    types = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[", hlo, re.M))
    gathers = [c for c in collectives(hlo, MESH_SHAPE) if c.kind == "all-gather" and "while/body" in c.op_name]
    forward = Counter(types[c.name] for c in gathers if "transpose(" not in c.op_name)
    backward = Counter(types[c.name] for c in gathers if "transpose(" in c.op_name)
    kernels = "u8" if cfg.fp8.enabled else "bf16"
    assert forward == backward == Counter({kernels: BLOCK_WEIGHTS, "f32": 2}), (forward, backward)


@pytest.mark.parametrize("case", ["zero0_float32", "zero0_bfloat16"])
def test_cost_model_gradient_bytes_follow_grad_reduce_dtype(partitioned, case):
    """The accelerator cost model's data-axis gradient bytes per execution equal the partitioned
    HLO's (the dtypes the GPU/TPU compilers receive); the `cpu` platform's stay float32 (XLA:CPU
    promotes bf16 collectives). ZeRO-0 only: with ZeRO the accelerator model counts the
    reduce-scatter those compilers make of the partitioner's all-reduce + slice."""
    cfg, hlo = partitioned(case)
    found = [r for r in data_reductions(hlo) if r.backward and r.dims]
    wire, f32 = Counter(), Counter()
    for r in found:
        wire[r.in_block] += r.elements * (4 if r.dtype == "f32" else 2)
        f32[r.in_block] += r.elements * 4
    for platform, want in (("accelerator", wire), ("cpu", f32)):
        terms = {t.what: float(np.max(t.bytes))
                 for t in collective_terms(Workload.of(cfg), Grid.of(cfg, MESH_SHAPE), platform)
                 if "data" in t.axes and t.kind == "all-reduce"}
        got = {True: terms["layer gradients (in the backward loop)"],
               False: terms["embedding, head and final-norm gradients"]}
        assert got == dict(want), (platform, got, want)


# ----------------------------------------------------------------------------------------------
# Numerics: the custom VJP against plain autodiff of the cast (grad_dtype=None)


@pytest.fixture(scope="module")
def gradients():
    """(loss, grads) of one batch at the same initial parameters, ZeRO-3 on data 4 x tensor 2
    (the backward rule re-enters the mesh captured in the forward pass), per (dtype, grad_dtype)."""
    rows = np.random.default_rng(0).integers(0, MODEL.vocab_size, (B, T + 1)).astype(np.int32)
    out = {}
    for dtype, grads in (("float32", (None, "float32")), ("bfloat16", (None, "float32", "bfloat16"))):
        cfg = _config(3, "float32", dtype=dtype)
        mesh = make_mesh(cfg.mesh)
        batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, batch_sharding(mesh))
        params = None  # the same for every grad_dtype: initialised once
        for grad in grads:
            model = Transformer(cfg.model, remat="full", grad_dtype=grad, placer=param_placer(cfg.parallel))
            layout = make_layout(cfg, mesh, model=model)
            params = init_state(cfg, layout).params if params is None else params
            loss, g = make_grad_fn(layout)(params, batch)
            out[dtype, grad] = float(loss), jax.tree.map(np.asarray, g)
    return out


def _leaves(grads):
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(grads)]


def _bf16_valued(x: np.ndarray) -> bool:
    return bool(np.array_equal(x, np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))))


@pytest.mark.parametrize("dtype,grad", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_custom_vjp_is_bit_identical_to_plain_autodiff(gradients, dtype, grad):
    """float32 model: the same matmuls in the same order. bfloat16 model with bfloat16 gradients:
    the weight-gradient matmul emits bfloat16 as the cast's autodiff did (c7513aa's numerics)."""
    loss0, g0 = gradients[dtype, None]
    loss1, g1 = gradients[dtype, grad]
    assert loss1 == loss0
    for (name, a), (_, b) in zip(_leaves(g0), _leaves(g1)):
        np.testing.assert_array_equal(b, a, err_msg=name)


def test_bf16_model_float32_gradients_close_to_plain_and_not_rounded(gradients):
    loss0, g0 = gradients["bfloat16", None]
    loss1, g1 = gradients["bfloat16", "float32"]
    assert loss1 == loss0  # the forward pass is unchanged
    matmul = 0
    for (name, a), (_, b) in zip(_leaves(g0), _leaves(g1)):
        scale = np.max(np.abs(a))
        assert np.max(np.abs(b - a)) <= BF16_GRAD_RTOL * scale, name
        if not name.endswith("['scale']"):  # a matmul weight: plain autodiff gave bf16 values
            matmul += 1
            assert _bf16_valued(a) and not _bf16_valued(b), name
    assert matmul == BLOCK_WEIGHTS + OUTER_WEIGHTS


@pytest.mark.parametrize("grad", ["float32", "bfloat16"])
def test_fp8_weight_gradient_comes_out_in_grad_reduce_dtype(grad):
    """The FP8 dot handed the float32 master (layers.param_matmul) returns the same output and
    input gradient as when handed the bfloat16 copy, and a weight gradient rounded only as
    grad_dtype says: the old one was the same float32 product rounded to bfloat16."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(32, 24)) * 0.05, jnp.float32)
    g = jnp.asarray(rng.normal(size=(16, 24)), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    op = Fp8DotGeneral(amax_history_length=4)
    state = op.init(jax.random.key(0), x, w.astype(jnp.bfloat16), dims)[FP8_COLLECTION]
    use = ParamUse(ParamPlacement(), jnp.dtype(jnp.bfloat16), jnp.dtype(grad), jnp.dtype(jnp.float32))

    def run(kernel, **kw):
        def f(x, k):
            return op.apply(fp8_variables(state), x, k, dims, preferred_element_type=jnp.bfloat16, **kw)

        y, vjp = jax.vjp(f, x, kernel)
        return (y, *vjp(g))

    y0, dx0, dw0 = run(w.astype(jnp.bfloat16))
    y1, dx1, dw1 = run(w, param=use)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx0))
    assert dw1.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dw1.astype(jnp.bfloat16)), np.asarray(dw0))
    assert _bf16_valued(np.asarray(dw1)) == (grad == "bfloat16")


def _saved(f, *args) -> Counter:
    """Types of the residuals autodiff keeps for the backward pass (jax's own report)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return Counter(line.split(" ")[0] for line in out.getvalue().splitlines())


@pytest.mark.parametrize("remat,tied", [("none", False), ("full", False), ("dots", False), ("none", True)])
def test_remat_policies_save_what_they_saved_with_plain_autodiff(remat, tied):
    """A custom VJP's forward rule runs under the block's remat policy like any other code: `full`
    keeps the block inputs, `dots` also the matmul outputs, `none` everything autodiff needs. The
    residuals (types and counts) are those of plain autodiff, and the embedding lookup keeps no
    weight copy for an input gradient the one-hot does not have."""
    cfg = dataclasses.replace(MODEL, tie_embeddings=tied)
    tokens = jnp.zeros((2, T), jnp.int32)
    saved = {}
    for grad in (None, "float32"):
        model = Transformer(cfg, remat=remat, grad_dtype=grad)
        params = model.init(jax.random.key(0), tokens)
        saved[grad] = _saved(lambda p: cross_entropy(model.apply(p, tokens), tokens), params)  # noqa: B023
    assert saved["float32"] == saved[None]


# ----------------------------------------------------------------------------------------------
# The TPU compiler (compile-only, through libtpu's topologies: nothing runs)

TPU_MODEL = dataclasses.replace(MODEL, d_model=128, d_ff=256)  # TPU tiles are 128 lanes wide
TPU_SEQ = 64


TPU_CASES = {
    **{f"zero{z}_float32": dict(zero=z, grad="float32") for z in (0, 1, 3)},
    "zero3_bfloat16": dict(zero=3, grad="bfloat16"),
    # Pipelined (bf16 pipelines abort XLA:CPU, so only here): each stage's weight gradients leave
    # the shard_map as the float32 master's cotangent and are reduced over data in float32;
    # the embedding and head in grad_dtype (by the partitioner; 1F1B: inside the stages).
    "gpipe_bfloat16": dict(zero=0, grad="bfloat16", mesh=MeshConfig(data=2, tensor=2, pipe=2), schedule="gpipe"),
    "1f1b_bfloat16": dict(zero=0, grad="bfloat16", mesh=MeshConfig(data=2, tensor=2, pipe=2), schedule="1f1b"),
}


@pytest.fixture(scope="module")
def tpu_compiled():
    """case name -> (config, mesh, the compiled step's HLO) for a compile-only TPU v5e 2x4, the
    mesh built from its devices in make_mesh's order; each case compiled once."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        if os.environ.get("CI"):  # CI installs libtpu and must run these: never a silent skip there
            pytest.fail("the compile-only TPU tests need Linux x86_64 (libtpu's wheels) and CI runs them")
        pytest.skip("libtpu has wheels for Linux x86_64 only (where the test extra installs it)")
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices
    cache = {}

    def get(case: str):
        if case not in cache:
            kw = dict(TPU_CASES[case])
            mesh_cfg, schedule = kw.pop("mesh", MeshConfig(data=DATA, tensor=TENSOR)), kw.pop("schedule", "gpipe")
            cfg = _config(**kw)
            cfg = dataclasses.replace(cfg, mesh=mesh_cfg, model=TPU_MODEL,
                                      train=TrainConfig(global_batch=B, seq_len=TPU_SEQ), parallel=dataclasses.replace(cfg.parallel, schedule=schedule,
                                                                   microbatches=mesh_cfg.pipe))
            mesh = make_mesh(cfg.mesh, devices)
            assert "TPU" in mesh.devices.flat[0].device_kind
            layout = make_layout(cfg, mesh)
            state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 layout.abstract_state, layout.state_shardings)
            batch = {k: jax.ShapeDtypeStruct((B, TPU_SEQ), np.int32, sharding=batch_sharding(mesh))
                     for k in ("inputs", "targets")}
            cache[case] = cfg, mesh, make_train_step(cfg, layout).lower(state, batch).compile().as_text()
        return cache[case]

    return get


_REDUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) (?:all-reduce|reduce-scatter)(?:-start)?\(")  # name, result type


def _tpu_reduced_arrays(hlo: str, mesh_shape: dict[str, int]) -> Counter:
    """(dtype, elements) of every float array a data-axis all-reduce or reduce-scatter returns,
    each op counted once (the TPU HLO's loops carry no trip counts). The TPU compiler combines
    reductions into tuples, and ZeRO's reduce-scatter is a kCustom fusion calling an
    `all-reduce-scatter` computation whose all-reduce is found here at full size."""
    results = {m.group(1): m.group(2) for m in map(_REDUCTION.match, hlo.splitlines()) if m}
    out = Counter()
    for c in collectives(hlo, mesh_shape):
        if "data" in c.axes and c.kind in ("all-reduce", "reduce-scatter"):
            for dtype, dims in re.findall(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]", results[c.name]):
                if dtype in ("f32", "bf16"):
                    out[dtype, int(np.prod([int(d) for d in dims.split(",") if d]))] += 1
    return out


@pytest.mark.parametrize("case", ["zero0_float32", "zero1_float32", "zero3_float32", "zero3_bfloat16"])
def test_tpu_compiler_reduces_weight_gradients_in_grad_reduce_dtype(tpu_compiled, case):
    """What a TPU receives: the same six matmul-weight gradients (combined into tuple all-reduces,
    inside all-reduce-scatter fusions under ZeRO), each reduced once over data in grad_dtype; the
    other float reductions over data (norm scales, scalars) in float32. On c7513aa the six were
    bfloat16 here too."""
    cfg, mesh, hlo = tpu_compiled(case)
    arrays = _tpu_reduced_arrays(hlo, dict(mesh.shape))
    weights = matmul_weight_elements(cfg)
    assert all(n > TPU_MODEL.d_model * TPU_MODEL.n_layers for n in weights)  # no norm scale has a weight's size
    want = HLO_DTYPE[cfg.parallel.grad_reduce_dtype]
    assert Counter({n: k for (dtype, n), k in arrays.items() if n in weights and dtype == want}) == weights, arrays
    others = [dtype for dtype, n in arrays if n not in weights]
    assert others and set(others) == {"f32"}, arrays


@pytest.mark.parametrize("case", ["gpipe_bfloat16", "1f1b_bfloat16"])
def test_tpu_pipelined_gradient_bytes_match_the_accelerator_cost_model(tpu_compiled, case):
    """Pipelined, every gradient is reduced once per step (the stages' after the tick loop), so
    the TPU program's data-axis reduction bytes (every float array but scalars) are the cost
    model's per step: stage weights float32, the embedding and head in grad_dtype (1F1B sums
    them inside the stages). Unpipelined layouts are held to the partitioned CPU HLO above
    (the TPU compiler moves the norm-scale reductions out of the layer loop, whose trip count
    its HLO does not carry)."""
    cfg, mesh, hlo = tpu_compiled(case)
    hlo_bytes = sum(n * (4 if dtype == "f32" else 2) * k
                    for (dtype, n), k in _tpu_reduced_arrays(hlo, dict(mesh.shape)).items() if n > 1)
    # The reductions only (1F1B gathers its tables' summed shards back over data), a
    # reduce-scatter at its operand's size, as _tpu_reduced_arrays reads XLA:TPU's fusions.
    terms = [t for t in collective_terms(Workload.of(cfg), Grid.of(cfg, dict(mesh.shape)), "accelerator")
             if "data" in t.axes and "gradient" in t.what and t.kind in ("all-reduce", "reduce-scatter")]
    model = sum(float(np.max(t.bytes * t.executions * (t.group if t.kind == "reduce-scatter" else 1)))
                for t in terms)
    assert hlo_bytes == model, (case, hlo_bytes, model, [(t.what, float(np.max(t.bytes))) for t in terms])
    # the bfloat16 tables really are there: the same layout in float32 would move more
    f32 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grad_reduce_dtype="float32"))
    assert model < sum(float(np.max(t.bytes * t.executions))
                       for t in collective_terms(Workload.of(f32), Grid.of(f32, dict(mesh.shape)), "accelerator")
                       if "data" in t.axes and "gradient" in t.what)
