"""The `parallax train` CLI: user errors, the workdir guard, `--set` parsing, an end-to-end smoke run.

Every bad input must end with exactly one `parallax: error: ...` line on stderr that names the
field or file and the constraint, exit status 2, no traceback (unless `--debug`), and must leave an
existing workdir exactly as it was. The error cases run `parallax.cli.main` in-process on the 8
simulated CPU devices set up by conftest; all of them fail before anything is compiled.
"""

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parallax.config import Config, ConfigError, apply_overrides
from parallax.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.py"

# A tiny model so that an accidental compile stays cheap. Quickstart's mesh is data=-1 x tensor=2,
# i.e. data=4 x tensor=2 on 8 devices; these sizes are valid on it.
TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "train.seq_len=16", "train.global_batch=8", "train.steps=2",
]

SENTINEL_METRICS = b'{"step": 7, "loss": 1.25}\n{"step": 8, "loss": 1.125}\n'
SENTINEL_NOTE = b"an earlier run's notes; must survive a failed invocation\n"


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _make_workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "workdir"
    (wd / "tb").mkdir(parents=True)
    (wd / "metrics.jsonl").write_bytes(SENTINEL_METRICS)
    (wd / "notes.txt").write_bytes(SENTINEL_NOTE)
    (wd / "tb" / "events.out.tfevents.sentinel").write_bytes(b"\x00old events\x00")
    return wd


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root -> its bytes (None for directories)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _assert_one_error_line(err: str, *needles: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}:\n{err}"
    line = lines[0]
    assert line.startswith("parallax: error: "), line
    assert "Traceback" not in err
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def _experiment(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / "experiments" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


def _token_file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / "data" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------------------------
# Bad configs: (id, overrides after TINY, substrings the error line must hold)

MESH_CASES = [
    ("mesh-product-too-small", ["mesh.data=3", "mesh.tensor=1"],
     ["mesh", "data=3", "tensor=1", "needs 3 devices", "8 are available"]),
    ("mesh-product-too-large", ["mesh.data=4", "mesh.tensor=4"],
     ["mesh", "data=4", "tensor=4", "needs 16 devices", "8 are available"]),
    ("mesh-minus-one-not-dividing", ["mesh.data=-1", "mesh.tensor=3"],
     ["mesh.data=-1", "8 devices", "not divisible", "3"]),
    ("mesh-two-minus-ones", ["mesh.data=-1", "mesh.tensor=-1"],
     ["only one axis may be -1", "mesh.data", "mesh.tensor"]),
    ("mesh-two-minus-ones-pipe-expert", ["mesh.data=8", "mesh.tensor=1", "mesh.pipe=-1", "mesh.expert=-1"],
     ["only one axis may be -1", "mesh.pipe", "mesh.expert"]),
    ("mesh-size-zero", ["mesh.tensor=0"], ["mesh.tensor", "positive", "0"]),
    ("mesh-size-negative", ["mesh.data=-2", "mesh.tensor=1"], ["mesh.data", "positive", "-2"]),
    ("mesh-pipe-zero", ["mesh.pipe=0"], ["mesh.pipe", "positive", "0"]),
]

MODEL_CASES = [
    # data=2 x tensor=4 = 8 devices; d_model 32 / 4 heads = head dim 8 (even), so only the
    # divisibility by mesh.tensor is wrong.
    ("heads-not-divisible-by-tensor", ["mesh.data=2", "mesh.tensor=4", "model.n_heads=2", "model.n_kv_heads=2"],
     ["model.n_heads=2", "mesh.tensor=4", "divisible"]),
    ("kv-heads-not-divisible-by-tensor", ["mesh.data=2", "mesh.tensor=4", "model.n_heads=4", "model.n_kv_heads=2"],
     ["model.n_kv_heads=2", "mesh.tensor=4", "divisible"]),
    ("d-ff-not-divisible-by-tensor", ["mesh.data=2", "mesh.tensor=4", "model.n_heads=4", "model.n_kv_heads=4",
                                      "model.d_ff=66"],
     ["model.d_ff=66", "mesh.tensor=4", "divisible"]),
    ("vocab-not-divisible-by-tensor", ["mesh.data=2", "mesh.tensor=4", "model.n_heads=4", "model.n_kv_heads=4",
                                       "model.vocab_size=258"],
     ["model.vocab_size=258", "mesh.tensor=4", "divisible"]),
    ("model-size-zero", ["model.d_ff=0"], ["model.d_ff", "positive", "0"]),
    ("batch-not-divisible-by-data", ["mesh.data=-1", "mesh.tensor=1", "train.global_batch=12"],
     ["train.global_batch=12", "mesh.data x mesh.expert = 8", "divisible"]),
    ("batch-not-divisible-by-data-4", ["mesh.data=4", "mesh.tensor=2", "train.global_batch=6"],
     ["train.global_batch=6", "mesh.data x mesh.expert = 4"]),
    ("batch-zero", ["train.global_batch=0"], ["train.global_batch", "positive", "0"]),
    # MoE (model.moe.*)
    ("expert-axis-without-experts", ["mesh.data=2", "mesh.expert=2"], ["mesh.expert=2", "model.moe.num_experts"]),
    ("top-k-above-experts", ["model.moe.num_experts=4", "model.moe.top_k=5"],
     ["model.moe.top_k=5", "model.moe.num_experts=4"]),
    ("experts-not-divisible-by-expert-axis", ["mesh.data=1", "mesh.expert=4", "model.moe.num_experts=6"],
     ["model.moe.num_experts=6", "mesh.expert=4", "divisible"]),
    ("moe-every-not-dividing-layers", ["model.moe.num_experts=4", "model.moe.every=2"],
     ["model.moe.every=2", "model.n_layers=1"]),
    ("1f1b-with-repeats", ["mesh.data=2", "mesh.pipe=2", "parallel.microbatches=4", "parallel.schedule=1f1b",
                           "parallel.repeats=2"], ["parallel.repeats=2", "circular", "interleaved_1f1b"]),
    ("zb-h1-with-repeats", ["mesh.data=2", "mesh.pipe=2", "parallel.microbatches=4", "parallel.schedule=zb_h1",
                            "parallel.repeats=2"], ["parallel.repeats=2", "'zb_h1'"]),
    ("interleaved-microbatches-not-multiple-of-pipe", ["mesh.data=2", "mesh.tensor=1", "mesh.pipe=4", "model.n_layers=8",
                                                       "parallel.microbatches=6", "parallel.schedule=interleaved_1f1b",
                                                       "parallel.repeats=2", "train.global_batch=12"],
     ["parallel.microbatches=6", "multiple of mesh.pipe=4", "interleaved_1f1b"]),
    ("moe-bad-dispatch", ["model.moe.num_experts=4", "model.moe.dispatch=sorted"], ["model.moe.dispatch", "sorted"]),
    ("moe-negative-aux-weight", ["model.moe.num_experts=4", "model.moe.aux_loss_weight=-1.0"],
     ["model.moe.aux_loss_weight", ">= 0"]),
]

SET_CASES = [
    ("unknown-field", ["model.n_experts=4"], ["unknown config key", "model.n_experts"]),
    ("unknown-section", ["trainer.steps=4"], ["unknown config key", "trainer.steps"]),
    ("missing-equals", ["train.steps"], ["train.steps", "key=value"]),
    ("int-given-float", ["train.steps=1.5"], ["train.steps", "expected int", "1.5"]),
    ("int-given-word", ["train.steps=abc"], ["train.steps", "expected int", "abc"]),
    ("int-given-bool", ["mesh.data=True"], ["mesh.data", "expected int", "True"]),
    ("float-given-word", ["train.lr=fast"], ["train.lr", "expected float", "fast"]),
    ("bool-given-word", ["model.tie_embeddings=maybe"], ["model.tie_embeddings", "expected bool", "maybe"]),
    ("bool-given-int", ["model.tie_embeddings=1"], ["model.tie_embeddings", "expected bool"]),
    ("nested-unknown-field", ["model.moe.experts=4"], ["unknown config key", "model.moe.experts", "num_experts"]),
    ("nested-section-given-value", ["model.moe=4"], ["unknown config key", "model.moe", "a section"]),
    ("nested-wrong-type", ["model.moe.top_k=two"], ["model.moe.top_k", "expected int", "two"]),
    ("nice-out-of-range", ["checkpoint.background_nice=20"], ["checkpoint.background_nice", "0..19", "20"]),
]

# Values that pass the type check but would poison a run (issue 18): every numeric field has a
# range (config.FIELD_RANGES), floats must be finite, also in float32; the error says the range.
RANGE_CASES = [
    ("lr-inf", ["train.lr=1e999"], ["train.lr", "finite", "> 0", "inf"]),
    ("lr-inf-in-float32", ["train.lr=1e39"], ["train.lr", "float32", "1e+39"]),
    ("lr-negative", ["train.lr=-0.001"], ["train.lr", "> 0", "-0.001"]),
    ("b1-one", ["optim.b1=1.0"], ["optim.b1", "[0, 1)", "1.0"]),
    ("b2-two", ["optim.b2=2.0"], ["optim.b2", "[0, 1)", "2.0"]),
    ("eps-negative", ["optim.eps=-1.0"], ["optim.eps", "> 0", "-1.0"]),
    ("eps-zero", ["optim.eps=0.0"], ["optim.eps", "> 0"]),
    ("warmup-negative", ["optim.warmup_steps=-1"], ["optim.warmup_steps", "0..2147483647", "-1"]),
    ("min-lr-ratio-above-1", ["optim.min_lr_ratio=1.5"], ["optim.min_lr_ratio", "[0, 1]", "1.5"]),
    ("weight-decay-negative", ["optim.weight_decay=-0.1"], ["optim.weight_decay", ">= 0"]),
    ("clip-norm-inf", ["optim.clip_norm=1e999"], ["optim.clip_norm", "finite"]),
    ("rope-theta-negative", ["model.rope_theta=-10000.0"], ["model.rope_theta", "> 0", "-10000.0"]),
    ("rope-theta-zero", ["model.rope_theta=0.0"], ["model.rope_theta", "> 0"]),
    ("norm-eps-zero", ["model.norm_eps=0.0"], ["model.norm_eps", "> 0"]),
    ("init-std-negative", ["model.init_std=-0.02"], ["model.init_std", "> 0"]),
    ("seed-negative", ["train.seed=-1"], ["train.seed", "0..2**63-1", "-1"]),
    ("seed-beyond-64-bits", ["train.seed=18446744073709551616"], ["train.seed", "0..2**63-1", "18446744073709551616"]),
    ("seed-huge", ["train.seed=" + "9" * 40], ["train.seed", "an integer of 133 bits"]),
    ("steps-beyond-int32", ["train.steps=2147483648"], ["train.steps", "1..2147483647"]),
    ("val-fraction-one", ["data.val_fraction=1.0"], ["data.val_fraction", "(0, 1)"]),
    ("fp8-margin-negative", ["fp8.margin=-1.0"], ["fp8.margin", ">= 0"]),
    ("capacity-factor-nan-ish", ["model.moe.num_experts=4", "model.moe.capacity_factor=-1e999"],
     ["model.moe.capacity_factor", "finite"]),
    ("microbatches-zero", ["parallel.microbatches=0"], ["parallel.microbatches", "positive"]),
    ("every-beyond-int64", ["checkpoint.every=" + "1" + "0" * 30], ["checkpoint.every", "-2**63..2**63-1"]),
]


@pytest.mark.parametrize(
    "overrides, needles",
    [pytest.param(o, n, id=i) for i, o, n in MESH_CASES + MODEL_CASES + SET_CASES + RANGE_CASES],
)
def test_bad_config_is_one_line_exit_2_and_leaves_workdir(tmp_path, capsys, overrides, needles):
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, *overrides), "--workdir", str(wd)])
    err = capsys.readouterr().err
    assert rc == 2
    _assert_one_error_line(err, *needles)
    assert _snapshot(tmp_path) == before  # byte-identical, nothing added or removed
    assert (wd / "metrics.jsonl").read_bytes() == SENTINEL_METRICS


# ----------------------------------------------------------------------------------------------
# Bad experiment files


def test_missing_experiment_file(tmp_path, capsys):
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    missing = tmp_path / "experiments" / "no_such_experiment.py"
    rc = main(["train", str(missing), *_sets(*TINY), "--workdir", str(wd)])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, str(missing), "does not exist")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("body, needles", [
    pytest.param("X = 1\n", ["does not define get_config()"], id="no-get-config"),
    pytest.param("get_config = 42\n", ["does not define get_config()"], id="get-config-not-callable"),
    pytest.param("def get_config():\n    return {'name': 'x'}\n",
                 ["get_config() must return parallax.config.Config", "dict"], id="returns-wrong-type"),
    pytest.param("import no_such_module_for_parallax_tests\n",
                 ["failed to import", "ModuleNotFoundError", "no_such_module_for_parallax_tests"],
                 id="import-fails"),
    pytest.param("def get_config(:\n", ["failed to import", "SyntaxError"], id="syntax-error"),
])
def test_bad_experiment_file(tmp_path, capsys, body, needles):
    path = _experiment(tmp_path, "bad_experiment.py", body)
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    rc = main(["train", str(path), *_sets(*TINY), "--workdir", str(wd)])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, str(path), *needles)
    assert _snapshot(tmp_path) == before


# ----------------------------------------------------------------------------------------------
# Bad data files (the config is otherwise valid: vocab 256 on data=4 x tensor=2)


def _u16(values) -> bytes:
    return np.asarray(values, dtype=np.uint16).tobytes()


@pytest.mark.parametrize("name, data, extra, needles", [
    pytest.param("missing.bin", None, [], ["does not exist"], id="missing"),
    pytest.param("odd.bin", b"\x01\x02\x03\x04\x05", ["data.token_dtype=uint16"],
                 ["size 5 bytes", "not a multiple of uint16", "2 bytes"], id="size-not-multiple-uint16"),
    pytest.param("odd32.bin", _u16(range(3)), ["data.token_dtype=uint32"],
                 ["size 6 bytes", "not a multiple of uint32", "4 bytes"], id="size-not-multiple-uint32"),
    pytest.param("big_ids.bin", _u16([i % 256 for i in range(1000)][:500] + [300] + [7] * 499), [],
                 ["token id 300", "model.vocab_size=256", "at token 500"], id="id-ge-vocab"),
    pytest.param("vocab_edge.bin", _u16([255] * 999 + [256]), [],
                 ["token id 256", "model.vocab_size=256", "at token 999"], id="id-eq-vocab"),
    pytest.param("empty.bin", b"", [], ["is empty"], id="empty"),
    pytest.param("short.bin", _u16(range(10)), [], ["too short", "train.seq_len+1=17"], id="too-short"),
])
def test_bad_data_file(tmp_path, capsys, name, data, extra, needles):
    path = tmp_path / "data" / name
    if data is not None:
        _token_file(tmp_path, name, data)
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, f"data.source={path}", *extra), "--workdir", str(wd)])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, f"data file {str(path)!r}", *needles)
    assert _snapshot(tmp_path) == before


def test_bad_input_does_not_create_the_workdir(tmp_path, capsys):
    wd = tmp_path / "not" / "yet"
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, "mesh.data=3", "mesh.tensor=1"), "--workdir", str(wd)])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, "needs 3 devices")
    assert not (tmp_path / "not").exists()


# ----------------------------------------------------------------------------------------------
# --debug and the workdir guard


def test_debug_shows_the_traceback(tmp_path, capsys):
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    rc = main(["--debug", "train", str(QUICKSTART), *_sets(*TINY, "mesh.data=3", "mesh.tensor=1"),
               "--workdir", str(wd)])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.splitlines()
    assert lines[0].startswith("Traceback (most recent call last):")
    assert any("ConfigError" in line for line in lines)
    assert lines[-1].startswith("parallax: error: mesh: data=3")  # the one-line summary still ends it
    assert sum(line.startswith("parallax: error:") for line in lines) == 1
    assert _snapshot(tmp_path) == before


def test_same_error_without_debug_has_no_traceback(tmp_path, capsys):
    wd = _make_workdir(tmp_path)
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, "mesh.data=3", "mesh.tensor=1"), "--workdir", str(wd)])
    assert rc == 2
    line = _assert_one_error_line(capsys.readouterr().err)
    assert "ConfigError" not in line


def test_workdir_guard_refuses_an_existing_run(tmp_path, capsys):
    """A valid config is checked in full (mesh, model, data) and then refused by the workdir guard."""
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    rc = main(["train", str(QUICKSTART), *_sets(*TINY), "--workdir", str(wd)])
    out, err = capsys.readouterr()
    assert rc == 2
    _assert_one_error_line(err, f"workdir {str(wd)!r}", "already holds a run", "metrics.jsonl", "--overwrite")
    assert "mesh:" not in out and "compiled" not in out  # refused before any layout or compile
    assert _snapshot(tmp_path) == before
    assert (wd / "metrics.jsonl").read_bytes() == SENTINEL_METRICS


def test_workdir_guard_only_looks_at_metrics(tmp_path, capsys):
    """A bad config in a guarded workdir reports the config error, not the workdir: inputs first."""
    wd = _make_workdir(tmp_path)
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, "train.steps=abc"), "--workdir", str(wd)])
    assert rc == 2
    line = _assert_one_error_line(capsys.readouterr().err, "train.steps")
    assert "workdir" not in line


# ----------------------------------------------------------------------------------------------
# apply_overrides directly


@pytest.mark.parametrize("override, section, field, expected", [
    ("train.steps=10", "train", "steps", 10),
    ("train.steps= 10 ", "train", "steps", 10),
    ("train.seed=-3", "train", "seed", -3),
    ("mesh.data=-1", "mesh", "data", -1),
    ("train.lr=3", "train", "lr", 3.0),  # an int literal for a float field becomes a float
    ("train.lr=1e-3", "train", "lr", 1e-3),
    ("model.tie_embeddings=true", "model", "tie_embeddings", True),
    ("model.tie_embeddings=True", "model", "tie_embeddings", True),
    ("model.tie_embeddings=FALSE", "model", "tie_embeddings", False),
    ("model.tie_embeddings=False", "model", "tie_embeddings", False),
    ("data.source=stdlib", "data", "source", "stdlib"),
    ("data.source=/data/tokens.bin", "data", "source", "/data/tokens.bin"),
    ("data.source='/data/tokens.bin'", "data", "source", "/data/tokens.bin"),
    ('model.dtype="bfloat16"', "model", "dtype", "bfloat16"),
    ("model.dtype=bfloat16", "model", "dtype", "bfloat16"),
])
def test_apply_overrides_parses_values(override, section, field, expected):
    cfg = apply_overrides(Config(), [override])
    value = getattr(getattr(cfg, section), field)
    assert value == expected
    assert type(value) is type(expected)
    # Nothing else changed.
    default = Config()
    for f in ("mesh", "model", "parallel", "optim", "data", "train"):
        if f != section:
            assert getattr(cfg, f) == getattr(default, f)


def test_apply_overrides_later_wins_and_input_is_not_mutated():
    base = Config()
    cfg = apply_overrides(base, ["train.steps=5", "train.steps=7", "mesh.tensor=2"])
    assert cfg.train.steps == 7 and cfg.mesh.tensor == 2
    assert base.train.steps == Config().train.steps and base.mesh.tensor == 1


@pytest.mark.parametrize("override, needles", [
    ("trainer.steps=1", ["unknown config key 'trainer.steps'", "sections:"]),
    ("train.stepz=1", ["unknown config key 'train.stepz'", "fields of train:", "steps"]),
    ("name.x=1", ["unknown config key 'name.x'"]),
    ("train=1", ["unknown config key 'train'"]),
    ("train.steps=1.5", ["train.steps: expected int, got '1.5'"]),
    ("train.steps=abc", ["train.steps: expected int, got 'abc'"]),
    ("train.steps=True", ["train.steps: expected int"]),
    ("train.steps=", ["train.steps: expected int"]),
    ("train.lr=abc", ["train.lr: expected float, got 'abc'"]),
    ("train.lr=True", ["train.lr: expected float"]),
    ("model.tie_embeddings=yes", ["model.tie_embeddings: expected bool, got 'yes'"]),
    ("model.tie_embeddings=0", ["model.tie_embeddings: expected bool"]),
    ("train.steps", ["--set 'train.steps'", "expected key=value"]),
])
def test_apply_overrides_rejects(override, needles):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), [override])
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


@pytest.mark.parametrize("override", ["name=my_run", "name='my_run'"])
def test_apply_overrides_sets_the_run_name(override):
    assert apply_overrides(Config(), [override]).name == "my_run"


# ----------------------------------------------------------------------------------------------
# User mistakes inside an experiment file are user errors too


def test_get_config_raising_is_a_user_error(tmp_path, capsys):
    path = _experiment(tmp_path, "raises.py", "def get_config():\n    raise RuntimeError('boom')\n")
    rc = main(["train", str(path), "--workdir", str(tmp_path / "wd")])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, str(path), "boom")


def test_wrongly_typed_field_in_experiment_file_is_a_user_error(tmp_path, capsys):
    path = _experiment(tmp_path, "badtype.py", (
        "from parallax.config import Config, TrainConfig\n"
        "def get_config():\n    return Config(train=TrainConfig(steps='10'))\n"))
    rc = main(["train", str(path), "--workdir", str(tmp_path / "wd")])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, "train.steps")


# ----------------------------------------------------------------------------------------------
# End to end, in a subprocess: the CLI itself must choose the simulated device count


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # conftest set it for this process; the CLI must set its own
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_quickstart_smoke_subprocess(tmp_path):
    wd = tmp_path / "run"
    # As a user runs it: no JAX_PLATFORMS. The test extra installs libtpu (compile-only targets),
    # which probes for a TPU when JAX starts and prints its failure unless told there is none.
    env = _cli_env()
    env.pop("JAX_PLATFORMS")
    proc = subprocess.run(
        [sys.executable, "-m", "parallax", "train", "experiments/quickstart.py",
         "--set", "train.steps=4", "--set", "train.eval_every=2", "--workdir", str(wd)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    first = proc.stdout.splitlines()[0]
    assert "simulating 8 CPU devices" in first, first
    assert proc.stderr == "", proc.stderr  # no plugin, libtpu or library lines on the user's screen

    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    keys = {"step", "loss", "tokens_per_s", "step_time_s", "tflops_per_device", "mfu", "lr", "grad_norm"}
    assert records, "metrics.jsonl is empty"
    for r in records:
        assert keys <= set(r), sorted(r)
        assert r["mfu"] is None  # CPU: no known peak
        for k in ("loss", "tokens_per_s", "step_time_s", "tflops_per_device", "lr", "grad_norm"):
            assert isinstance(r[k], float) and math.isfinite(r[k]), (k, r[k])
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["loss"] > 0
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == [r["step"] for r in records]  # increasing, no duplicates
    assert max(by_step) == 4
    for step in (2, 4):
        assert step in by_step, sorted(by_step)
        ev = by_step[step].get("eval_loss")
        assert isinstance(ev, float) and math.isfinite(ev) and ev > 0
    assert all("eval_loss" not in r for s, r in by_step.items() if s not in (2, 4))

    events = list((wd / "tb").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)


def test_no_arguments_exits_2():
    proc = subprocess.run([sys.executable, "-m", "parallax"], cwd=REPO, env=_cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "usage: parallax" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# Issue 18: values that poison a run, checks before JAX starts, workdirs that cannot be one,
# experiment files that misbehave. All in-process and before any compile unless said.


def test_nan_from_an_experiment_file_is_refused(tmp_path, capsys):
    path = _experiment(tmp_path, "nan_lr.py", (
        "from parallax.config import Config, TrainConfig\n"
        "def get_config():\n    return Config(train=TrainConfig(lr=float('nan')))\n"))
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    assert main(["train", str(path), "--workdir", str(wd)]) == 2
    _assert_one_error_line(capsys.readouterr().err, "train.lr", "finite", "nan")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("overrides, needles", [
    pytest.param(["mesh.data=100000", "mesh.tensor=1"], ["mesh.data=100000", "divisible"],
                 id="mesh-far-larger-than-the-batch"),
    pytest.param(["train.seed=" + "7" * 30], ["train.seed"], id="seed-beyond-64-bits"),
])
def test_config_errors_are_found_before_jax_starts(tmp_path, overrides, needles):
    """In a fresh process: the error comes before JAX is imported (100,000 simulated devices
    never answered) and before the workdir is created (~1 s, no compile)."""
    wd = tmp_path / "wd"
    code = ("import sys; from parallax.cli import main; rc = main(sys.argv[1:]); "
            "print('jax imported:', 'jax' in sys.modules); sys.exit(rc)")
    env = {k: v for k, v in _cli_env().items()}
    proc = subprocess.run([sys.executable, "-c", code, "train", str(QUICKSTART), *_sets(*TINY, *overrides),
                           "--workdir", str(wd)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _assert_one_error_line(proc.stderr, *needles)
    assert proc.stdout.strip() == "jax imported: False", proc.stdout
    assert not wd.exists()


@contextlib.contextmanager
def _read_only(path: Path):
    """`path` read-only even for root: a read-only bind mount (root), else its mode bits."""
    if os.geteuid() == 0:
        if not shutil.which("mount") or subprocess.run(["mount", "--bind", str(path), str(path)]).returncode:
            pytest.skip("root without mount: cannot make a path read-only")
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(path), str(path)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(mode & ~0o222)
        try:
            yield
        finally:
            path.chmod(mode)


@pytest.mark.parametrize("case", ["file", "dangling-symlink", "unwritable-parent", "read-only-metrics",
                                  "read-only-checkpoints"])
def test_a_workdir_that_cannot_be_one_is_one_line_before_jax(tmp_path, capsys, case):
    wd, needles = tmp_path / "wd", []
    ro = None
    if case == "file":
        wd.write_text("not a directory\n")
        needles = [f"workdir {str(wd)!r} is a file"]
    elif case == "dangling-symlink":
        wd.symlink_to(tmp_path / "gone")
        needles = ["is a dangling symlink", "gone"]
    elif case == "unwritable-parent":
        (tmp_path / "parent").mkdir()
        wd, ro = tmp_path / "parent" / "wd", tmp_path / "parent"
        needles = ["cannot be created", "is not writable"]
    else:
        wd = _make_workdir(tmp_path)
        name = "metrics.jsonl" if case == "read-only-metrics" else "checkpoints"
        (wd / "checkpoints").mkdir()
        ro, needles = wd / name, [f"{name} is not writable"]
    before = _snapshot(tmp_path)
    with _read_only(ro) if ro is not None else contextlib.nullcontext():
        rc = main(["train", str(QUICKSTART), *_sets(*TINY), "--workdir", str(wd)])
    out, err = capsys.readouterr()
    assert rc == 2
    _assert_one_error_line(err, f"workdir {str(wd)!r}", *needles)
    assert "no accelerator" not in out and "mesh:" not in out  # refused before the device set-up
    assert _snapshot(tmp_path) == before


def test_an_unreadable_data_file_is_one_line(tmp_path, capsys, monkeypatch):
    """Permissions cannot stop root from reading: the read itself is made to fail."""
    path = _token_file(tmp_path, "tokens.bin", _u16([i % 256 for i in range(4000)]))
    real = np.memmap

    def memmap(filename, *args, **kwargs):
        if str(filename) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", memmap)
    wd = _make_workdir(tmp_path)
    before = _snapshot(tmp_path)
    assert main(["train", str(QUICKSTART), *_sets(*TINY, f"data.source={path}"), "--workdir", str(wd)]) == 2
    _assert_one_error_line(capsys.readouterr().err, f"data file {str(path)!r}", "cannot be read", "Permission denied")
    assert _snapshot(tmp_path) == before


def test_an_empty_metrics_file_is_not_a_run(tmp_path, capsys):
    """What a start that failed before its first step leaves (an out-of-memory compile, a signal):
    the same command trains instead of refusing. One compile (~4 s)."""
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "metrics.jsonl").write_bytes(b"")
    assert main(["train", str(QUICKSTART), *_sets(*TINY), "--workdir", str(wd), "--stop-at", "1"]) == 0
    assert [json.loads(x)["step"] for x in (wd / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("body, needles", [
    pytest.param("import sys\nsys.exit(0)\n", ["called sys.exit(0) while being imported"], id="sys-exit-0-at-import"),
    pytest.param("def get_config():\n    raise SystemExit(3)\n", ["get_config() called sys.exit(3)"], id="sys-exit-in-get-config"),
])
def test_an_experiment_that_exits_is_a_user_error(tmp_path, capsys, body, needles):
    path = _experiment(tmp_path, "exits.py", body)
    assert main(["train", str(path), "--workdir", str(tmp_path / "wd")]) == 2
    _assert_one_error_line(capsys.readouterr().err, str(path), *needles)
    assert not (tmp_path / "wd").exists()


def test_an_experiment_path_that_is_a_directory(tmp_path, capsys):
    (tmp_path / "experiments").mkdir()
    assert main(["train", str(tmp_path / "experiments"), "--workdir", str(tmp_path / "wd")]) == 2
    _assert_one_error_line(capsys.readouterr().err, str(tmp_path / "experiments"), "is a directory")


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", "/tmp/abs", "."])
def test_a_name_that_would_leave_runs_is_refused(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(QUICKSTART), *_sets(*TINY, f"name={name}")]) == 2
    _assert_one_error_line(capsys.readouterr().err, "name:", repr(name), "--workdir")
    assert list(tmp_path.iterdir()) == []  # no runs/ directory, nothing anywhere
