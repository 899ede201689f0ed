"""`--profile-steps A:B` (parallax/train/profiler.py): a tiny quickstart run writes a trace of exactly
those steps in the profile plugin's layout, the trace parses back with jax's own parser, and each
traced step gets its one-line breakdown; a bad window is one line, exit 2, before JAX starts."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from parallax.cli import main
from parallax.train.profiler import KINDS, _kind, summarize

from test_cli import QUICKSTART, REPO, TINY as CLI_TINY

TINY = [*CLI_TINY, "train.steps=4", "train.log_every=1", "train.eval_every=0", "checkpoint.every=2"]


def _argv(wd: Path, *extra: str) -> list[str]:
    return ["train", str(QUICKSTART), *[a for o in TINY for a in ("--set", o)], "--workdir", str(wd), *extra]


def test_a_profiled_run_writes_a_trace_of_its_window_and_one_line_per_step(tmp_path, capsys):
    wd = tmp_path / "run"
    assert main(_argv(wd, "--profile-steps", "2:3")) == 0
    out = capsys.readouterr().out
    runs = list((wd / "profile" / "plugins" / "profile").iterdir())
    assert len(runs) == 1, runs  # TensorBoard's profile plugin layout: plugins/profile/<run>/<host>.xplane.pb
    (xplane,) = runs[0].glob("*.xplane.pb")
    assert list(runs[0].glob("*.trace.json.gz"))
    data = jax.profiler.ProfileData.from_file(str(xplane))
    assert data.find_plane_with_name("/host:CPU") is not None
    steps, cpu = summarize(data)
    assert cpu and [s.step for s in steps] == [2, 3]  # exactly the window
    for s in steps:
        assert s.devices == 8 and s.wall_s > 0 and s.per_device["compute"] > 0
        assert s.per_device["all-reduce"] > 0  # data-parallel gradients and tensor-parallel blocks
        assert 0 <= s.host_s <= s.wall_s
    lines = [line for line in out.splitlines() if line.startswith("profile step ")]
    assert [line.split(":")[0] for line in lines] == ["profile step 2", "profile step 3"], out
    for line in lines:
        assert all(k in line for k in ("compute", *KINDS, "host", "XLA:CPU")), line
    assert f"profile: steps 2..3 traced to {runs[0]}" in out


@pytest.mark.parametrize("window, extra, needle", [
    ("2-3", [], "expected A:B"),
    ("x:1", [], "expected A:B"),
    ("3:2", [], "the first step is after the last"),
    ("0:2", [], "must lie in 1..4 (train.steps=4)"),
    ("3:5", [], "must lie in 1..4 (train.steps=4)"),
    ("2:3", ["--stop-at", "2"], "must lie in 1..2 (--stop-at 2)"),
])
def test_a_bad_window_is_one_line_exit_2_before_anything(tmp_path, capsys, window, extra, needle):
    wd = tmp_path / "run"
    assert main(_argv(wd, "--profile-steps", window, *extra)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--profile-steps" in lines[0] and needle in lines[0], captured.err
    assert "mesh:" not in captured.out  # refused before the run was built
    assert not wd.exists()


def test_a_bad_window_is_refused_before_jax_starts(tmp_path):
    wd = tmp_path / "run"
    code = ("import sys; from parallax.cli import main; rc = main(sys.argv[1:]); "
            "print('jax imported:', 'jax' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *_argv(wd, "--profile-steps", "4:9")], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "--profile-steps 4:9" in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "jax imported: False", proc.stdout
    assert not wd.exists()


def test_a_window_before_the_resume_point_is_refused(tmp_path, capsys):
    wd = tmp_path / "run"
    assert main(_argv(wd, "--stop-at", "2")) == 0
    capsys.readouterr()
    files = sorted(p.relative_to(wd) for p in wd.rglob("*"))
    assert main(_argv(wd, "--profile-steps", "2:3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile-steps 2:3: this run executes steps 3..4" in err[0], err
    assert sorted(p.relative_to(wd) for p in wd.rglob("*")) == files  # nothing written


@pytest.mark.parametrize("name, kind", [
    ("all-reduce.1", "all-reduce"), ("all-reduce-start.3", "all-reduce"), ("all-gather-done", "all-gather"),
    ("reduce-scatter.2", "reduce-scatter"), ("all-reduce-scatter fusion.4", "reduce-scatter"),
    ("all-to-all.7", "all-to-all"), ("collective-permute-start", "collective-permute"),
    ("ynn_fusion", "compute"), ("fusion.12", "compute"), ("wrapped_reduce", "compute"), ("dot.3", "compute"),
])
def test_ops_are_classified_by_their_hlo_name(name, kind):
    assert _kind(name) == kind
