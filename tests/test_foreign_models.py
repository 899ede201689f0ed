"""Foreign Flax models (Linen and NNX, written here in the style of Flax's own examples, no parallax
layers) laid out by `parallax.parallel.sharding.check` with `DEFAULT_RULES` on a (data=2, tensor=2, pipe=2)
mesh and trained one step; plus every error `check` and the rules table must raise."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import MeshConfig, ParallelConfig
from parallax.model.logical import ShardingError, validate_rules
from parallax.parallel.mesh import AXES, make_mesh
from parallax.parallel.sharding import (
    DEFAULT_RULES,
    ParamLayout,
    check,
    logical_shardings,
    make_rules,
)

VOCAB, D_MODEL, D_FF, HEADS, HEAD_DIM = 256, 32, 64, 4, 8
B, T = 8, 16
LR = 0.1
# Sharded vs single-device: the same float32 math, only the reduction order of the sharded dots and
# of the batch-mean all-reduce differs, so the loss agrees to rtol 1e-5 (measured: ~3e-7).
# Updated parameters: rtol 1e-5, plus atol 1e-7 for entries near zero (zero-init biases); the
# largest absolute difference measured is ~1.5e-8.
RTOL, ATOL = 1e-5, 1e-7

BATCH_SPEC = P(("data", "expert"), None)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, tensor=2, pipe=2))


def _tokens():
    return jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB, dtype=jnp.int32)


def _next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def _rows_by_name(rows):
    return {r.name: r for r in rows}


def _assert_updates_match(old, new, ref_old, ref_new):
    def one(o, n, ro, rn):
        upd, ref = np.asarray(n) - np.asarray(o), np.asarray(rn) - np.asarray(ro)
        assert np.abs(ref).max() > 0
        np.testing.assert_allclose(upd, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    jax.tree.map(one, old, new, ref_old, ref_new)


def _sharding_constraints(lowered_text: str) -> int:
    # Shardy (the default partitioner) lowers them as sdy.sharding_constraint, GSPMD as @Sharding
    return lowered_text.count("sharding_constraint") + lowered_text.count("@Sharding(")


# ----------------------------------------------------------------------------------------------
# A Linen LM in the style of flax/examples/lm1b and wmt (models.py): logical partitioning on every
# kernel, logical constraints on activations.


def _lp(init, names):
    return nn.with_logical_partitioning(init, names)


class LinenMlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_uniform()
        y = nn.DenseGeneral(
            self.mlp_dim,
            kernel_init=_lp(init, ("embed", "mlp")),
            bias_init=_lp(nn.initializers.normal(1e-6), ("mlp",)),
            name="wi",
        )(x)
        y = nn.relu(y)
        y = nn.with_logical_constraint(y, ("batch", "length", "mlp"))
        y = nn.Dense(
            x.shape[-1],
            kernel_init=_lp(init, ("mlp", "embed")),
            bias_init=_lp(nn.initializers.normal(1e-6), ("embed",)),
            name="wo",
        )(y)
        return nn.with_logical_constraint(y, ("batch", "length", "embed"))


class LinenMlpLM(nn.Module):
    vocab_size: int = VOCAB
    emb_dim: int = D_MODEL
    mlp_dim: int = D_FF
    num_heads: int = HEADS
    head_dim: int = HEAD_DIM

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(stddev=0.02)
        x = nn.Embed(
            self.vocab_size,
            self.emb_dim,
            embedding_init=_lp(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
            name="embed",
        )(tokens)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        # a token-wise "attention value/out" pair, heads fused into joined_kv as in Flax examples
        h = nn.LayerNorm(
            scale_init=_lp(nn.initializers.ones, ("embed",)),
            bias_init=_lp(nn.initializers.zeros, ("embed",)),
            name="ln_0",
        )(x)
        v = nn.Dense(
            self.num_heads * self.head_dim,
            kernel_init=_lp(init, ("embed", "joined_kv")),
            use_bias=False,
            name="value",
        )(h)
        v = v.reshape(v.shape[:-1] + (self.num_heads, self.head_dim))
        v = nn.with_logical_constraint(v, ("batch", "length", "heads", "kv"))
        v = v.reshape(v.shape[:-2] + (-1,))
        o = nn.Dense(
            self.emb_dim,
            kernel_init=_lp(init, ("joined_kv", "embed")),
            use_bias=False,
            name="out",
        )(v)
        x = x + nn.with_logical_constraint(o, ("batch", "length", "embed"))
        x = x + LinenMlpBlock(self.mlp_dim, name="mlp")(nn.LayerNorm(use_scale=False, use_bias=False)(x))
        logits = nn.Dense(
            self.vocab_size,
            kernel_init=_lp(init, ("embed", "vocab")),
            bias_init=_lp(nn.initializers.zeros, ("vocab",)),
            name="logits",
        )(x)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


LINEN_EXPECTED = {
    "params/embed/embedding": ((VOCAB, D_MODEL), ("vocab", "embed"), P("tensor", None)),
    "params/ln_0/scale": ((D_MODEL,), ("embed",), P(None)),
    "params/ln_0/bias": ((D_MODEL,), ("embed",), P(None)),
    "params/value/kernel": ((D_MODEL, HEADS * HEAD_DIM), ("embed", "joined_kv"), P(None, "tensor")),
    "params/out/kernel": ((HEADS * HEAD_DIM, D_MODEL), ("joined_kv", "embed"), P("tensor", None)),
    "params/mlp/wi/kernel": ((D_MODEL, D_FF), ("embed", "mlp"), P(None, "tensor")),
    "params/mlp/wi/bias": ((D_FF,), ("mlp",), P("tensor")),
    "params/mlp/wo/kernel": ((D_FF, D_MODEL), ("mlp", "embed"), P("tensor", None)),
    "params/mlp/wo/bias": ((D_MODEL,), ("embed",), P(None)),
    "params/logits/kernel": ((D_MODEL, VOCAB), ("embed", "vocab"), P(None, "tensor")),
    "params/logits/bias": ((VOCAB,), ("vocab",), P("tensor")),
}


def _linen_abstract():
    model = LinenMlpLM()
    return model, jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((B, T), jnp.int32))


def _linen_step_fn(model, tx):
    def step(params, opt_state, tokens):
        def loss_fn(p):
            return _next_token_loss(model.apply({"params": p}, tokens), tokens)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


@pytest.fixture(scope="module")
def linen_run(mesh):
    """One SGD step of the Linen LM: sharded on the mesh, and the same step on one device."""
    model, abstract = _linen_abstract()
    tokens = _tokens()
    tx = optax.sgd(LR)
    step = _linen_step_fn(model, tx)
    init_fn = lambda key: nn.unbox(model.init(key, jnp.zeros((B, T), jnp.int32)))  # noqa: E731

    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, DEFAULT_RULES)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        params = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0))["params"]
        opt_state = tx.init(params)
        batch = jax.device_put(tokens, NamedSharding(mesh, BATCH_SPEC))
        jitted = jax.jit(step)
        lowered_text = jitted.lower(params, opt_state, batch).as_text()
        loss, new_params, _ = jitted(params, opt_state, batch)

    # single device, no mesh, no rules: the logical constraints are no-ops
    dev0 = jax.devices()[0]
    ref_init = jax.jit(init_fn)(jax.device_put(jax.random.key(0), dev0))["params"]
    ref_step = jax.jit(step)
    ref_tokens = jax.device_put(tokens, dev0)
    ref_text = ref_step.lower(ref_init, tx.init(ref_init), ref_tokens).as_text()
    ref_loss, ref_params, _ = ref_step(ref_init, tx.init(ref_init), ref_tokens)
    assert {d for x in jax.tree.leaves(ref_params) for d in x.devices()} == {dev0}
    return dict(
        shardings=shardings["params"],
        params=params,
        loss=loss,
        new_params=new_params,
        lowered_text=lowered_text,
        ref_init=ref_init,
        ref_loss=ref_loss,
        ref_params=ref_params,
        ref_text=ref_text,
    )


def test_check_linen_rows(mesh):
    _, abstract = _linen_abstract()
    rows = check(abstract, DEFAULT_RULES, mesh)
    assert all(isinstance(r, ParamLayout) for r in rows)
    by_name = _rows_by_name(rows)
    # every parameter is reported, annotated ones with their logical names and mesh spec
    assert set(by_name) == set(LINEN_EXPECTED)
    for name, (shape, logical, spec) in LINEN_EXPECTED.items():
        row = by_name[name]
        assert row.shape == shape, name
        assert row.logical == logical, name
        assert row.spec == spec, (name, row.spec)
    assert by_name["params/mlp/wi/kernel"].spec == P(None, "tensor")
    assert by_name["params/embed/embedding"].spec == P("tensor", None)


def test_check_linen_matches_flax_resolution(mesh):
    # check()'s specs, parallax's logical_shardings and Flax's own resolution of DEFAULT_RULES agree
    _, abstract = _linen_abstract()
    rows = _rows_by_name(check(abstract, DEFAULT_RULES, mesh))
    flax_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, DEFAULT_RULES)
    ours = logical_shardings(nn.get_partition_spec(abstract), mesh, DEFAULT_RULES)
    flat_flax = {
        "/".join(k.key for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(flax_shardings)[0]
    }
    flat_ours = {"/".join(k.key for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(ours)[0]}
    assert set(flat_flax) == set(rows) == set(flat_ours)
    for name, row in rows.items():
        want = NamedSharding(mesh, row.spec)
        assert flat_flax[name].is_equivalent_to(want, len(row.shape)), name
        assert flat_ours[name].is_equivalent_to(want, len(row.shape)), name


def test_check_uses_the_ambient_mesh_for_divisibility(mesh):
    # vocab 255 on tensor=2: caught by the mesh set with jax.set_mesh, not caught without any mesh
    model = LinenMlpLM(vocab_size=255)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((B, T), jnp.int32))
    rows = _rows_by_name(check(abstract, DEFAULT_RULES))  # no mesh: names only
    assert rows["params/embed/embedding"].spec == P("tensor", None)
    with pytest.raises(ShardingError, match=r"params/embed/embedding: dimension 0 \('vocab'\) of size 255"):
        check(abstract, DEFAULT_RULES, mesh)
    with jax.set_mesh(mesh):
        with pytest.raises(ShardingError, match=r"params/embed/embedding.*255.*not divisible"):
            check(abstract, DEFAULT_RULES)


def test_linen_sharded_init_places_params_by_the_rules(linen_run, mesh):
    params = linen_run["params"]
    flat = {"params/" + "/".join(k.key for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert set(flat) == set(LINEN_EXPECTED)
    for name, (shape, _, spec) in LINEN_EXPECTED.items():
        x = flat[name]
        assert x.shape == shape
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape)), (name, x.sharding)
    # tensor-sharded: each device holds half of the embedding rows
    emb = flat["params/embed/embedding"]
    assert {s.data.shape for s in emb.addressable_shards} == {(VOCAB // 2, D_MODEL)}
    # the sharded init is the same as the single-device init (partitionable threefry)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, linen_run["ref_init"])


def test_linen_train_step_on_mesh(linen_run):
    loss = float(linen_run["loss"])
    assert np.isfinite(loss)
    assert abs(loss - np.log(VOCAB)) < 1.0  # near uniform at init
    old, new = linen_run["params"], linen_run["new_params"]
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), old, new)
    assert all(jax.tree.leaves(changed)), changed
    # the update kept every parameter in its rules' sharding
    new_leaves, treedef = jax.tree.flatten(new)
    want_leaves = treedef.flatten_up_to(linen_run["shardings"])
    assert len(new_leaves) == len(LINEN_EXPECTED)
    for x, want in zip(new_leaves, want_leaves):
        assert x.sharding.is_equivalent_to(want, x.ndim), (x.shape, x.sharding, want)
    # the Flax-style activation constraints were resolved under DEFAULT_RULES (none without a mesh)
    assert _sharding_constraints(linen_run["lowered_text"]) > 0
    assert _sharding_constraints(linen_run["ref_text"]) == 0


def test_linen_sharded_step_equals_single_device(linen_run):
    # rtol 1e-5 (see RTOL above): same math, different reduction order
    np.testing.assert_allclose(float(linen_run["loss"]), float(linen_run["ref_loss"]), rtol=RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL),
        linen_run["new_params"],
        linen_run["ref_params"],
    )
    # and the update itself (new - old) matches, not only the (dominant) initial values; an update
    # is a sum over the batch, so its absolute error scales with the leaf's largest update
    _assert_updates_match(
        linen_run["params"], linen_run["new_params"], linen_run["ref_init"], linen_run["ref_params"]
    )


# ----------------------------------------------------------------------------------------------
# The same LM in Flax NNX, in the style of Flax's NNX examples: `nnx.with_partitioning` on every
# initializer, the model created under a mesh and the logical rules (eager sharding).


def _wp(init, names):
    return nnx.with_partitioning(init, names)


class NnxMlpLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab_size: int = VOCAB):
        init = nnx.initializers.normal(stddev=0.02)
        self.embed = nnx.Embed(
            vocab_size, D_MODEL, embedding_init=_wp(nnx.initializers.normal(1.0), ("vocab", "embed")), rngs=rngs
        )
        self.norm = nnx.LayerNorm(
            D_MODEL,
            scale_init=_wp(nnx.initializers.ones_init(), ("embed",)),
            bias_init=_wp(nnx.initializers.zeros_init(), ("embed",)),
            rngs=rngs,
        )
        self.value = nnx.LinearGeneral(
            D_MODEL, (HEADS, HEAD_DIM), kernel_init=_wp(init, ("embed", "heads", "kv")), use_bias=False, rngs=rngs
        )
        self.out = nnx.LinearGeneral(
            (HEADS, HEAD_DIM), D_MODEL, axis=(-2, -1), kernel_init=_wp(init, ("heads", "kv", "embed")),
            use_bias=False, rngs=rngs,
        )  # fmt: skip
        self.wi = nnx.Linear(
            D_MODEL, D_FF, kernel_init=_wp(init, ("embed", "mlp")),
            bias_init=_wp(nnx.initializers.normal(1e-6), ("mlp",)), rngs=rngs,
        )  # fmt: skip
        self.wo = nnx.Linear(
            D_FF, D_MODEL, kernel_init=_wp(init, ("mlp", "embed")),
            bias_init=_wp(nnx.initializers.normal(1e-6), ("embed",)), rngs=rngs,
        )  # fmt: skip
        self.head = nnx.Linear(
            D_MODEL, vocab_size, kernel_init=_wp(init, ("embed", "vocab")),
            bias_init=_wp(nnx.initializers.zeros_init(), ("vocab",)), rngs=rngs,
        )  # fmt: skip

    def __call__(self, tokens):
        x = nn.with_logical_constraint(self.embed(tokens), ("batch", "length", "embed"))
        v = nn.with_logical_constraint(self.value(self.norm(x)), ("batch", "length", "heads", "kv"))
        x = x + nn.with_logical_constraint(self.out(v), ("batch", "length", "embed"))
        h = nn.with_logical_constraint(nnx.relu(self.wi(x)), ("batch", "length", "mlp"))
        x = x + self.wo(h)
        return nn.with_logical_constraint(self.head(x), ("batch", "length", "vocab"))


NNX_EXPECTED = {
    "embed/embedding": ((VOCAB, D_MODEL), ("vocab", "embed"), P("tensor", None)),
    "norm/scale": ((D_MODEL,), ("embed",), P(None)),
    "norm/bias": ((D_MODEL,), ("embed",), P(None)),
    "value/kernel": ((D_MODEL, HEADS, HEAD_DIM), ("embed", "heads", "kv"), P(None, "tensor", None)),
    "out/kernel": ((HEADS, HEAD_DIM, D_MODEL), ("heads", "kv", "embed"), P("tensor", None, None)),
    "wi/kernel": ((D_MODEL, D_FF), ("embed", "mlp"), P(None, "tensor")),
    "wi/bias": ((D_FF,), ("mlp",), P("tensor")),
    "wo/kernel": ((D_FF, D_MODEL), ("mlp", "embed"), P("tensor", None)),
    "wo/bias": ((D_MODEL,), ("embed",), P(None)),
    "head/kernel": ((D_MODEL, VOCAB), ("embed", "vocab"), P(None, "tensor")),
    "head/bias": ((VOCAB,), ("vocab",), P("tensor")),
}


def _nnx_abstract(mesh, vocab_size=VOCAB):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
        return nnx.eval_shape(lambda: NnxMlpLM(nnx.Rngs(0), vocab_size))


def _flat_params(module):
    return {"/".join(map(str, path)): v[...] for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@nnx.jit
def _nnx_train_step(model, optimizer, tokens):
    def loss_fn(m):
        return _next_token_loss(m(tokens), tokens)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.fixture(scope="module")
def nnx_run(mesh):
    """One SGD-with-momentum step of the NNX LM on the mesh, and the same step on one device."""
    tokens = _tokens()
    tx = optax.sgd(LR, momentum=0.9)  # a momentum trace: optimizer state shaped like the params
    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
        model = NnxMlpLM(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        init = _flat_params(model)
        batch = jax.device_put(tokens, NamedSharding(mesh, BATCH_SPEC))
        loss = _nnx_train_step(model, optimizer, batch)
    new = _flat_params(model)
    opt_state = nnx.state(optimizer, nnx.OptState)
    trace = {
        "/".join(map(str, path[path.index("trace") + 1 :])): v[...]
        for path, v in nnx.to_flat_state(opt_state)
        if "trace" in path
    }
    # check() reads the optimizer state's inherited annotations too
    opt_rows = {
        r.name.split("trace/", 1)[1]: r.spec for r in check(opt_state, DEFAULT_RULES, mesh) if "trace/" in r.name
    }

    # single device: no mesh, no rules, no eager sharding
    dev0 = jax.devices()[0]
    with nnx.use_eager_sharding(False):
        ref_model = NnxMlpLM(nnx.Rngs(0))
        ref_optimizer = nnx.Optimizer(ref_model, tx, wrt=nnx.Param)
    ref_init = _flat_params(ref_model)
    ref_loss = _nnx_train_step(ref_model, ref_optimizer, jax.device_put(tokens, dev0))
    ref_new = _flat_params(ref_model)
    assert {d for x in ref_new.values() for d in x.devices()} == {dev0}
    return dict(
        init=init, loss=loss, new=new, trace=trace, opt_rows=opt_rows, ref_init=ref_init, ref_loss=ref_loss, ref_new=ref_new
    )


def test_check_nnx_rows(mesh):
    model = _nnx_abstract(mesh)
    for variables in (model, nnx.state(model), nnx.state(model, nnx.Param)):  # module or state
        rows = _rows_by_name(check(variables, DEFAULT_RULES, mesh))
        assert set(rows) == set(NNX_EXPECTED)
        for name, (shape, logical, spec) in NNX_EXPECTED.items():
            assert (rows[name].shape, rows[name].logical, rows[name].spec) == (shape, logical, spec), name


def test_check_nnx_matches_flax_resolution(mesh):
    model = _nnx_abstract(mesh)
    rows = _rows_by_name(check(model, DEFAULT_RULES, mesh))
    with nnx.logical_axis_rules(DEFAULT_RULES):
        specs = nnx.get_partition_spec(nnx.state(model))
    flat = {"/".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(specs)}
    assert set(flat) == set(rows)
    for name, row in rows.items():
        got = NamedSharding(mesh, flat[name])
        assert got.is_equivalent_to(NamedSharding(mesh, row.spec), len(row.shape)), (name, flat[name])


def test_check_nnx_divisibility(mesh):
    model = _nnx_abstract(mesh, vocab_size=255)
    with pytest.raises(ShardingError, match=r"embed/embedding: dimension 0 \('vocab'\) of size 255"):
        check(model, DEFAULT_RULES, mesh)


def test_nnx_train_step_on_mesh(nnx_run, mesh):
    loss = float(nnx_run["loss"])
    assert np.isfinite(loss)
    assert abs(loss - np.log(VOCAB)) < 1.0
    init, new = nnx_run["init"], nnx_run["new"]
    assert set(new) == set(NNX_EXPECTED)
    for name, (shape, _, spec) in NNX_EXPECTED.items():
        want = NamedSharding(mesh, spec)
        assert bool(jnp.any(init[name] != new[name])), f"{name} did not change"
        assert init[name].sharding.is_equivalent_to(want, len(shape)), (name, init[name].sharding)
        assert new[name].sharding.is_equivalent_to(want, len(shape)), (name, new[name].sharding)
        # the optimizer's momentum follows its parameter's layout
        assert nnx_run["trace"][name].sharding.is_equivalent_to(want, len(shape)), name
        assert nnx_run["opt_rows"][name] == spec, name
    assert {s.data.shape for s in new["wi/kernel"].addressable_shards} == {(D_MODEL, D_FF // 2)}


def test_nnx_sharded_step_equals_single_device(nnx_run):
    # rtol 1e-5 (see RTOL above): same math, different reduction order
    np.testing.assert_allclose(float(nnx_run["loss"]), float(nnx_run["ref_loss"]), rtol=RTOL)
    for name in NNX_EXPECTED:
        np.testing.assert_array_equal(np.asarray(nnx_run["init"][name]), np.asarray(nnx_run["ref_init"][name]))
        np.testing.assert_allclose(
            np.asarray(nnx_run["new"][name]), np.asarray(nnx_run["ref_new"][name]), rtol=RTOL, atol=ATOL
        )
    _assert_updates_match(nnx_run["init"], nnx_run["new"], nnx_run["ref_init"], nnx_run["ref_new"])


# ----------------------------------------------------------------------------------------------
# Errors: every ambiguity is a ShardingError that names the parameter and the logical axis.


class OneKernel(nn.Module):
    """A single Dense layer whose kernel carries the logical names under test."""

    names: tuple
    features: int = D_FF

    @nn.compact
    def __call__(self, x):
        return nn.Dense(
            self.features, kernel_init=_lp(nn.initializers.lecun_normal(), self.names), use_bias=False, name="proj"
        )(x)


def _one_kernel(names, features=D_FF, d_in=D_MODEL):
    return jax.eval_shape(OneKernel(names, features).init, jax.random.key(0), jnp.zeros((B, d_in)))


def test_error_logical_name_without_rule(mesh):
    abstract = _one_kernel(("embed", "hidden"))
    with pytest.raises(ShardingError, match=r"params/proj/kernel: logical axis 'hidden' is covered by no rule"):
        check(abstract, DEFAULT_RULES, mesh)
    with pytest.raises(ShardingError, match="'hidden'"):  # also without a mesh: it is a naming error
        check(abstract, DEFAULT_RULES)


def test_error_logical_name_without_rule_nnx(mesh):
    class Proj(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Linear(
                D_MODEL, D_FF, kernel_init=_wp(nnx.initializers.lecun_normal(), ("embed", "hidden")), rngs=rngs
            )

    # under the rules Flax itself would fail with "Resource axis: hidden is not found in mesh" (it
    # passes an unknown logical name through as a mesh axis): build the abstract model unsharded
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Proj(nnx.Rngs(0)))
    with pytest.raises(ShardingError, match=r"proj/kernel: logical axis 'hidden' is covered by no rule"):
        check(model, DEFAULT_RULES, mesh)


def test_error_two_dims_on_one_mesh_axis(mesh):
    # 'mlp' and 'heads' both -> tensor; Flax would silently replicate the second dimension
    abstract = _one_kernel(("mlp", "heads"), d_in=D_FF)
    with pytest.raises(ShardingError) as err:
        check(abstract, DEFAULT_RULES, mesh)
    msg = str(err.value)
    assert "params/proj/kernel" in msg and "'mlp'" in msg and "'heads'" in msg and "'tensor'" in msg
    flax_spec = nn.logical_to_mesh_axes(("mlp", "heads"), DEFAULT_RULES)
    # what check() refuses to let happen silently: Flax gives tensor to 'heads' (the earlier rule)
    # and quietly replicates the 'mlp' dimension
    assert flax_spec == P(None, "tensor")


def test_error_not_divisible_on_tensor4():
    mesh4 = make_mesh(MeshConfig(data=2, tensor=4))
    abstract = _one_kernel(("embed", "mlp"), features=6)
    with pytest.raises(ShardingError) as err:
        check(abstract, DEFAULT_RULES, mesh4)
    msg = str(err.value)
    assert "params/proj/kernel" in msg and "dimension 1 ('mlp') of size 6" in msg and "size 4" in msg
    # the same kernel fits tensor=2, and 8 fits tensor=4
    assert check(abstract, DEFAULT_RULES, make_mesh(MeshConfig(data=2, tensor=2, pipe=2)))[0].spec == P(None, "tensor")
    assert check(_one_kernel(("embed", "mlp"), features=8), DEFAULT_RULES, mesh4)[0].spec == P(None, "tensor")


def test_error_not_divisible_by_a_product_of_mesh_axes(mesh):
    # a dimension on two mesh axes must divide by their product (tensor=2 x pipe=2 = 4)
    rules = tuple((n, ("tensor", "pipe") if n == "mlp" else a) for n, a in DEFAULT_RULES)
    assert check(_one_kernel(("embed", "mlp"), features=8), rules, mesh)[0].spec == P(None, ("tensor", "pipe"))
    with pytest.raises(ShardingError, match=r"dimension 1 \('mlp'\) of size 6 .*\('tensor', 'pipe'\) of size 4"):
        check(_one_kernel(("embed", "mlp"), features=6), rules, mesh)


def test_error_rank_mismatch(mesh):
    # names for the flattened 2-D kernel on a DenseGeneral whose kernel is 3-D
    class Heads(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.DenseGeneral((HEADS, HEAD_DIM), kernel_init=_lp(nn.initializers.lecun_normal(), ("embed", "kv")))(x)

    abstract = jax.eval_shape(Heads().init, jax.random.key(0), jnp.zeros((B, D_MODEL)))
    with pytest.raises(ShardingError, match=r"params/DenseGeneral_0/kernel: 2 logical names .* rank-3 array"):
        check(abstract, DEFAULT_RULES, mesh)


def test_error_mesh_axes_instead_of_logical_names(mesh):
    class MeshNamed(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tensor"))
            return nn.Dense(D_FF, kernel_init=init, name="proj")(x)

    abstract = jax.eval_shape(MeshNamed().init, jax.random.key(0), jnp.zeros((B, D_MODEL)))
    with pytest.raises(ShardingError, match="params/proj/kernel: annotated with mesh axes"):
        check(abstract, DEFAULT_RULES, mesh)


def test_unannotated_variables_are_reported_replicated(mesh):
    model = nn.Dense(D_FF)  # a plain Flax layer: no logical names at all
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((B, D_MODEL)))
    rows = _rows_by_name(check(abstract, DEFAULT_RULES, mesh))
    assert rows == {
        "params/kernel": ParamLayout("params/kernel", (D_MODEL, D_FF), None, P()),
        "params/bias": ParamLayout("params/bias", (D_FF,), None, P()),
    }


@pytest.mark.parametrize(
    "extra, old, new",
    [
        ((("mlp", "data"),), "tensor", "data"),  # a real conflict
        ((("mlp", "tensor"),), "tensor", "tensor"),  # even an identical duplicate
        ((("embed", ("data", "expert")),), "None", "data"),
    ],
)
def test_error_conflicting_rules(mesh, extra, old, new):
    rules = DEFAULT_RULES + extra
    name = extra[0][0]
    abstract = _one_kernel(("embed", "mlp"))
    for call in (
        lambda: validate_rules(rules),
        lambda: validate_rules(rules, AXES),
        lambda: validate_rules(rules, mesh),
        lambda: check(abstract, rules, mesh),
        lambda: check(abstract, rules),
        lambda: logical_shardings(nn.get_partition_spec(abstract), mesh, rules),
    ):
        with pytest.raises(ShardingError, match=rf"conflicting rules for logical axis '{name}'.*{old}.*{new}"):
            call()


def test_conflict_is_not_silently_deduplicated_by_position(mesh):
    # the duplicate may come first: still an error, not "first rule wins" as in Flax
    rules = (("mlp", "data"),) + DEFAULT_RULES
    assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P(None, "data")  # Flax: first wins
    with pytest.raises(ShardingError, match="'mlp'"):
        check(_one_kernel(("embed", "mlp")), rules, mesh)


def test_error_rule_names_unknown_mesh_axis(mesh):
    rules = tuple((n, "model" if n == "mlp" else a) for n, a in DEFAULT_RULES)
    with pytest.raises(ShardingError, match=r"rule for 'mlp' names mesh axis 'model'"):
        check(_one_kernel(("embed", "mlp")), rules, mesh)
    with pytest.raises(ShardingError, match=r"'model'"):
        check(_one_kernel(("embed", "mlp")), rules)  # without a mesh, against parallax's four axes
    with pytest.raises(ShardingError, match=r"'model'"):
        validate_rules(rules, AXES)  # against axis names given as names
    assert validate_rules(rules)["mlp"] == ("model",)  # no mesh, no axis names: not checked
    # inside a tuple of axes too
    with pytest.raises(ShardingError, match=r"rule for 'batch' names mesh axis 'replica'"):
        validate_rules((("batch", ("data", "replica")),), mesh)


def test_error_malformed_rule():
    with pytest.raises(ShardingError, match="expected \\(logical_name, mesh_axes\\)"):
        validate_rules(DEFAULT_RULES + (("mlp",),))
    with pytest.raises(ShardingError, match="expected"):
        validate_rules(DEFAULT_RULES + ((None, "tensor"),))


def test_sharding_error_is_a_user_error():
    from parallax.config import UserError

    assert issubclass(ShardingError, UserError) and issubclass(ShardingError, ValueError)


# ----------------------------------------------------------------------------------------------
# The rules table as Flax sees it


def test_default_rules_are_valid_and_unique(mesh):
    table = validate_rules(DEFAULT_RULES, mesh)
    assert len(table) == len(DEFAULT_RULES)
    assert table["batch"] == ("data", "expert") and table["embed"] == () and table["mlp"] == ("tensor",)


def test_default_rules_in_linen_context(mesh):
    with nn.logical_axis_rules(DEFAULT_RULES):
        assert nn.get_logical_axis_rules() == DEFAULT_RULES
        assert nn.logical_to_mesh_axes(("batch", "length", "embed")) == P(("data", "expert"), None, None)
        assert nn.logical_to_mesh_axes(("embed", "mlp")) == P(None, "tensor")
        assert nn.logical_to_mesh_axes(("vocab", "embed")) == P("tensor", None)
        # every single logical name resolves in Flax exactly as in check()
        for name, axes in DEFAULT_RULES:
            want = check({"x": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8,), jnp.float32), (name,))}, DEFAULT_RULES)
            assert nn.logical_to_mesh_axes((name,)) == want[0].spec, name

        @jax.jit
        def f(x):
            return nn.with_logical_constraint(x * 2, ("batch", "length", "embed"))

        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.ones((B, T, D_MODEL)), NamedSharding(mesh, P()))
            y = f(x)
            text = f.lower(x).as_text()
    assert _sharding_constraints(text) == 1
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "expert"), None, None)), 3)


def test_default_rules_in_nnx_context(mesh):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
        from flax.core.spmd import get_logical_axis_rules

        assert get_logical_axis_rules() == DEFAULT_RULES
        layer = nnx.Linear(
            D_MODEL, D_FF, kernel_init=_wp(nnx.initializers.lecun_normal(), ("embed", "mlp")), rngs=nnx.Rngs(0)
        )
        emb = nnx.Embed(VOCAB, D_MODEL, embedding_init=_wp(nnx.initializers.normal(), ("vocab", "embed")), rngs=nnx.Rngs(0))
    assert layer.kernel[...].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tensor")), 2)
    assert emb.embedding[...].sharding.is_equivalent_to(NamedSharding(mesh, P("tensor", None)), 2)


def test_zero3_rules_shard_embed_over_data(mesh):
    zero3 = make_rules(ParallelConfig(zero=3))
    assert dict(zero3)["embed"] == "data"
    assert dict(DEFAULT_RULES)["embed"] is None
    assert make_rules(ParallelConfig(zero=0)) == DEFAULT_RULES
    assert [n for n, _ in zero3] == [n for n, _ in DEFAULT_RULES]  # only the target changed
    _, abstract = _linen_abstract()
    rows = _rows_by_name(check(abstract, zero3, mesh))
    assert rows["params/mlp/wi/kernel"].spec == P("data", "tensor")
    assert rows["params/embed/embedding"].spec == P("tensor", "data")
    assert rows["params/ln_0/scale"].spec == P("data")
    # the activation batch stays on data: ZeRO-3 uses the parameter name 'embed', not 'batch'
    with nn.logical_axis_rules(zero3):
        assert nn.logical_to_mesh_axes(("batch", "length", "activation_embed")) == P(("data", "expert"), None, None)
    # an activation annotated with the *parameter* name 'embed' would now clash with the batch
    with pytest.raises(ShardingError, match="'data'"):
        check({"act": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((B, T, D_MODEL), jnp.float32),
                                              ("batch", "length", "embed"))}, zero3, mesh)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Ambiguities Flax resolves silently (or with a confusing error) that check() refuses up front.


def test_refuses_same_logical_name_twice_in_one_array(mesh):
    abstract = _one_kernel(("embed", "embed"), features=D_MODEL)
    with pytest.raises(ValueError, match="more than once"):  # Flax's own resolution refuses it
        nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, DEFAULT_RULES)
    try:
        rows = check(abstract, DEFAULT_RULES, mesh)
    except ShardingError as e:
        assert "'embed'" in str(e)
    else:
        raise AssertionError(f"check() passed {rows}")


def test_refuses_rule_with_non_string_mesh_axes():
    with pytest.raises(ShardingError, match="'mlp'"):
        validate_rules((("mlp", 3),))


def test_refuses_rule_naming_a_mesh_axis_twice(mesh):
    try:
        table = validate_rules((("mlp", ("tensor", "tensor")),), mesh)
    except ShardingError as e:
        assert "'mlp'" in str(e) and "'tensor'" in str(e)
    else:
        raise AssertionError(f"accepted {table}")
