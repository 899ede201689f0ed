"""Learning-rate schedules (optim.schedule), the logged lr after skipped steps, and AdamW's
bfloat16 first moment (optim.mu_dtype): the formulas, the field checks, the state's dtypes, the
cost model's optimizer bytes, short CLI runs, and a resume across a mu_dtype change."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.analysis.cost import Grid, Workload, memory_parts
from parallax.cli import main
from parallax.config import Config, ConfigError, OptimConfig, TrainConfig, apply_overrides, check_fields, check_optim, \
    load_experiment
from parallax.parallel.mesh import make_mesh
from parallax.train.checkpoint import Checkpoints
from parallax.train.optim import applied_count, make_lr_schedule, make_optimizer
from parallax.train.train_state import make_layout
from parallax.train.train_step import batch_sharding, make_train_step

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.py"  # data=4 x tensor=2, ZeRO-1 (the moments are sharded)
TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "train.seq_len=16", "train.global_batch=8", "train.log_every=1", "train.eval_every=0",
]
LR = 1e-3


def _cfg(steps: int = 100, **optim) -> Config:
    return Config(optim=OptimConfig(**optim), train=TrainConfig(steps=steps, lr=LR))


def _lr(cfg: Config, count: int) -> float:
    return float(make_lr_schedule(cfg)(jnp.asarray(count, jnp.int32)))


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _records(wd: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (wd / "metrics.jsonl").read_text().splitlines())}


# ----------------------------------------------------------------------------------------------
# The schedules against their formulas


def test_cosine_is_unchanged():
    """The default: linear warmup over W counts, then cosine from lr to lr * min_lr_ratio over the
    remaining steps - W counts (the formula of optax.warmup_cosine_decay_schedule before optim.schedule)."""
    cfg = _cfg(steps=100, warmup_steps=20, min_lr_ratio=0.1)
    assert cfg.optim.schedule == "cosine"
    end = LR * 0.1
    for c in (0, 7, 20, 21, 50, 77, 99, 100, 130):
        want = LR * c / 20 if c < 20 else end + (LR - end) * 0.5 * (1 + math.cos(math.pi * min(c - 20, 80) / 80))
        assert _lr(cfg, c) == pytest.approx(want, rel=1e-6, abs=1e-12), c


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_values(shape):
    """100 steps, warmup 10, decay_fraction 0.2: warmup to lr at count 10, flat until the decay
    starts at count 80, lr * min_lr_ratio reached at count 100 and held after."""
    cfg = _cfg(steps=100, schedule="wsd", warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2, decay_shape=shape)
    end = LR * 0.1
    assert _lr(cfg, 0) == 0.0
    assert _lr(cfg, 5) == pytest.approx(LR / 2, rel=1e-6)
    for c in (10, 11, 40, 79, 80):  # warmup end, the stable plateau, the decay's first count
        assert _lr(cfg, c) == pytest.approx(LR, rel=1e-6), c
    assert _lr(cfg, 100) == pytest.approx(end, rel=1e-6) and _lr(cfg, 150) == pytest.approx(end, rel=1e-6)
    progress = {85: 0.25, 90: 0.5, 99: 0.95}
    for c, x in progress.items():
        frac = 1 - x if shape == "linear" else 1 - math.sqrt(x)
        assert _lr(cfg, c) == pytest.approx(end + (LR - end) * frac, rel=1e-5), c
    if shape == "1-sqrt":  # the midpoint: 1 - sqrt(1/2) of the way from the floor
        assert _lr(cfg, 90) == pytest.approx(end + (LR - end) * (1 - 0.5 ** 0.5), rel=1e-5)


def test_wsd_decay_rounding_and_short_runs():
    """decay_fraction 1 decays from the warmup's end; a warmup past the stable phase shortens the
    decay instead of overlapping it."""
    whole = _cfg(steps=50, schedule="wsd", warmup_steps=0, decay_fraction=1.0, decay_shape="linear")
    assert _lr(whole, 0) == pytest.approx(LR) and _lr(whole, 25) == pytest.approx(LR * (0.1 + 0.9 * 0.5), rel=1e-6)
    late = _cfg(steps=20, schedule="wsd", warmup_steps=18, decay_fraction=0.5, decay_shape="linear")
    assert _lr(late, 18) == pytest.approx(LR, rel=1e-6) and _lr(late, 19) == pytest.approx(LR * 0.55, rel=1e-6)
    assert _lr(late, 20) == pytest.approx(LR * 0.1, rel=1e-6)


def test_constant():
    cfg = _cfg(steps=100, schedule="constant", warmup_steps=4, min_lr_ratio=0.1)
    assert [_lr(cfg, c) for c in (0, 2)] == pytest.approx([0.0, LR / 2])
    assert all(_lr(cfg, c) == pytest.approx(LR, rel=1e-6) for c in (4, 50, 99, 100, 1000))
    flat = _cfg(steps=10, schedule="constant", warmup_steps=0)
    assert _lr(flat, 0) == pytest.approx(LR, rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Bad input: one line naming the field, exit 2, before JAX starts


@pytest.mark.parametrize("override, needle", [
    ("optim.schedule=linear", "optim.schedule: must be one of 'cosine', 'wsd', 'constant', got 'linear'"),
    ("optim.decay_shape=cosine", "optim.decay_shape: must be one of 'linear', '1-sqrt', got 'cosine'"),
    ("optim.mu_dtype=float16", "optim.mu_dtype: must be one of 'float32', 'bfloat16', got 'float16'"),
    ("optim.decay_fraction=0.0", "optim.decay_fraction: must be in (0, 1], got 0.0"),
    ("optim.decay_fraction=1.5", "optim.decay_fraction: must be in (0, 1], got 1.5"),
])
def test_bad_optim_fields_are_refused(tmp_path, capsys, override, needle):
    wd = tmp_path / "run"
    assert main(["train", str(QUICKSTART), *_sets(*TINY, override), "--workdir", str(wd)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("parallax: error: ") and needle in err, err
    assert not wd.exists()
    cfg = apply_overrides(Config(), [override])
    checks = [check_fields] if "decay_fraction" in override else [check_optim, make_optimizer]  # a range; a name
    for fn in checks:  # make_optimizer: an optimizer built outside the CLI is checked too
        with pytest.raises(ConfigError, match=needle.split(":")[0]):
            fn(cfg)


# ----------------------------------------------------------------------------------------------
# mu_dtype: the state and the cost model


def test_bfloat16_mu_in_the_state_and_the_cost_model():
    """mu is bfloat16 in the (ZeRO-1 sharded) state, nu and the parameters stay float32; the cost
    model's optimizer bytes fall from 8 to 6 per parameter, the state's bytes by the same, and the
    compiled step's per-device argument bytes by what the cost model says."""
    base = apply_overrides(load_experiment(QUICKSTART), TINY)
    half = apply_overrides(base, ["optim.mu_dtype=bfloat16"])
    mesh = make_mesh(base.mesh)
    states = {c.optim.mu_dtype: make_layout(c, mesh).abstract_state for c in (base, half)}
    adam = {k: s.opt_state[1][0] for k, s in states.items()}  # (clip, (adam, decay, schedule))
    assert {x.dtype for x in jax.tree.leaves(adam["bfloat16"].mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam["bfloat16"].nu)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(adam["float32"].mu)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(states["bfloat16"].params)} == {jnp.dtype(jnp.float32)}

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    assert nbytes(states["bfloat16"].opt_state) / nbytes(states["float32"].opt_state) == pytest.approx(0.75, rel=1e-3)
    sizes = dict(mesh.shape)
    opt = {c.optim.mu_dtype: float(memory_parts(Workload.of(c), Grid.of(c, sizes))["optimizer"]) for c in (base, half)}
    assert opt["bfloat16"] == pytest.approx(0.75 * opt["float32"], rel=1e-12)
    both = {c.optim.mu_dtype: memory_parts(Workload.of(c), Grid.of(c, sizes)) for c in (base, half)}
    assert float(both["float32"]["params"]) == float(both["bfloat16"]["params"])  # nothing else moves

    def compiled_argument_bytes(c: Config) -> int:  # the compiled step's inputs: state and batch
        layout = make_layout(c, mesh)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             layout.abstract_state, layout.state_shardings)
        tokens = jax.ShapeDtypeStruct((c.train.global_batch, c.train.seq_len), jnp.int32, sharding=batch_sharding(mesh))
        lowered = make_train_step(c, layout).lower(state, {"inputs": tokens, "targets": tokens})
        return lowered.compile().memory_analysis().argument_size_in_bytes

    saved = compiled_argument_bytes(base) - compiled_argument_bytes(half)
    assert saved == pytest.approx(opt["float32"] - opt["bfloat16"], rel=0.02), (saved, opt)


# ----------------------------------------------------------------------------------------------
# The logged lr is the one the optimizer applied, also after skipped steps


def test_logged_lr_follows_the_optimizer_count_after_skipped_steps(tmp_path, capsys):
    """The suite's forced non-finite steps (test_checkpoint): lr 1e30 from step 2 on leaves huge
    weights whose gradients overflow from step 3, so steps 3-5 are skipped. The optimizer applied
    2 updates, so steps 3-5 log the rate at count 2 (the one the next update would use), not at
    the step counter's 3, 4 (what was logged before)."""
    wd = tmp_path / "run"
    extra = ["train.steps=40", "train.lr=1e30", "optim.warmup_steps=1", "train.max_bad_steps=3", "checkpoint.every=1"]
    assert main(["train", str(QUICKSTART), *_sets(*TINY, *extra), "--workdir", str(wd)]) == 3
    capsys.readouterr()
    cfg = apply_overrides(load_experiment(QUICKSTART), [*TINY, *extra])
    records = _records(wd)
    assert [records[s]["skipped_steps"] for s in (1, 2, 3, 4, 5)] == [0, 0, 1, 2, 3]
    assert [records[s]["lr"] for s in (1, 2)] == pytest.approx([_lr(cfg, 0), _lr(cfg, 1)], rel=1e-6)
    for s in (3, 4, 5):
        assert records[s]["lr"] == pytest.approx(_lr(cfg, 2), rel=1e-6), s
    assert _lr(cfg, 2) != pytest.approx(_lr(cfg, 4), rel=1e-6)  # the schedule moves: the test can tell
    state = Checkpoints(wd, cfg.checkpoint).restore(cfg, make_layout(cfg, make_mesh(cfg.mesh))).state
    assert int(applied_count(state.opt_state)) == int(state.step) == 2  # the last good checkpoint


# ----------------------------------------------------------------------------------------------
# Short CLI runs: wsd with a bfloat16 mu, resumed with a float32 one (the restore casts)


def test_wsd_bfloat16_mu_trains_and_resumes_across_mu_dtypes(tmp_path, capsys):
    """6 steps of wsd (1-sqrt) with a bfloat16 mu, stopped at 3; resumed with a float32 mu. The
    checkpoint's arrays are restored into the config's dtypes (mu_dtype does not fix a shape):
    3 more steps train, and each logged lr is the schedule's at that step's count."""
    wd = tmp_path / "run"
    common = [*TINY, "train.steps=6", "optim.schedule=wsd", "optim.decay_shape=1-sqrt", "optim.decay_fraction=0.5",
              "optim.warmup_steps=1", "checkpoint.every=3"]
    argv = ["train", str(QUICKSTART), "--workdir", str(wd)]
    assert main([*argv, *_sets(*common, "optim.mu_dtype=bfloat16"), "--stop-at", "3"]) == 0
    cfg16 = apply_overrides(load_experiment(QUICKSTART), [*common, "optim.mu_dtype=bfloat16"])
    cfg32 = apply_overrides(load_experiment(QUICKSTART), common)
    mesh = make_mesh(cfg16.mesh)
    saved = Checkpoints(wd, cfg16.checkpoint).restore(cfg16, make_layout(cfg16, mesh)).state
    mu16 = [np.asarray(x) for x in jax.tree.leaves(saved.opt_state[1][0].mu)]
    assert all(x.dtype == jnp.bfloat16 for x in mu16) and any(np.any(x != 0) for x in mu16)
    as32 = Checkpoints(wd, cfg32.checkpoint).restore(cfg32, make_layout(cfg32, mesh)).state
    mu32 = [np.asarray(x) for x in jax.tree.leaves(as32.opt_state[1][0].mu)]
    assert all(x.dtype == np.float32 for x in mu32)
    for a, b in zip(mu16, mu32):  # bfloat16 -> float32 is exact
        np.testing.assert_array_equal(a.astype(np.float32), b)

    assert main([*argv, *_sets(*common, "optim.mu_dtype=float32")]) == 0
    assert "resuming from checkpoint step 3" in capsys.readouterr().out
    records = _records(wd)
    assert sorted(records) == [1, 2, 3, 4, 5, 6] and all(np.isfinite(r["loss"]) for r in records.values())
    for s, r in records.items():  # no skipped steps: count s - 1 at step s
        assert r["skipped_steps"] == 0 and r["lr"] == pytest.approx(_lr(cfg32, s - 1), rel=1e-6), s
    assert records[3]["lr"] == pytest.approx(cfg32.train.lr, rel=1e-6) and records[6]["lr"] < records[3]["lr"]
    # and the other way: the float32 mu of step 6 restored into a bfloat16 one is its rounding
    final = Checkpoints(wd, cfg32.checkpoint).restore(cfg32, make_layout(cfg32, mesh))
    rounded = Checkpoints(wd, cfg16.checkpoint).restore(cfg16, make_layout(cfg16, mesh))
    assert final.step == rounded.step == 6
    for a, b in zip(jax.tree.leaves(final.state.opt_state[1][0].mu), jax.tree.leaves(rounded.state.opt_state[1][0].mu)):
        assert a.dtype == np.float32 and b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).astype(jnp.bfloat16), np.asarray(b))
