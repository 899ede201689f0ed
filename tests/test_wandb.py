"""`metrics.wandb` (parallax/train/tracker.py): an offline W&B run writes its files under WORKDIR/wandb
with no network and records the config; with wandb not importable the default config trains and
`metrics.wandb=true` is one line, exit 2, before JAX starts. W&B never reaches the network here:
offline mode, its config and cache directories are the test's own, and where the test may make a
network namespace (root) the offline run's processes have no network at all (`unshare -n`)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.cli import main

from test_cli import QUICKSTART, REPO, TINY as CLI_TINY

TINY = [*CLI_TINY, "train.steps=3", "train.log_every=1", "train.eval_every=0", "checkpoint.every=2"]
# Run in the child: the import blocked (as if wandb were not installed) when BLOCK_WANDB is set,
# and whether JAX was imported by the time main returned.
CHILD = """
import os, sys
if os.environ.get("BLOCK_WANDB"):
    sys.modules["wandb"] = None
from parallax.cli import main
rc = main(sys.argv[1:])
print("jax imported:", "jax" in sys.modules)
sys.exit(rc)
"""


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _env(tmp_path: Path, **extra: str) -> dict:
    home = tmp_path / "wandb_home"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline",
            "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"), "WANDB_API_KEY": "",
            **extra}


def _no_network() -> list[str]:
    """`unshare -n` where this process may make a network namespace (root): the child then has no
    network at all, not even loopback; elsewhere offline mode alone keeps W&B off the network."""
    try:
        ok = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except OSError:
        ok = False
    return ["unshare", "-n"] if ok else []


def _train(tmp_path: Path, wd: Path, *extra: str, isolated: bool = False, **env: str) -> subprocess.CompletedProcess:
    argv = [*(_no_network() if isolated else []), sys.executable, "-c", CHILD, "train", str(QUICKSTART),
            *_sets(*TINY), "--workdir", str(wd), *extra]
    return subprocess.run(argv, cwd=REPO, env=_env(tmp_path, **env), capture_output=True, text=True, timeout=600)


def test_an_offline_run_writes_its_files_and_records_the_config(tmp_path):
    pytest.importorskip("wandb")
    wd = tmp_path / "run"
    on = _sets("metrics.wandb=true", "metrics.wandb_project=parallax-test")
    first = _train(tmp_path, wd, *on, "--stop-at", "2", isolated=True)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(tmp_path, wd, *on, isolated=True)  # the resume continues the same W&B run (its id is kept)
    assert second.returncode == 0, second.stderr[-3000:]
    run_id = (wd / "wandb" / "parallax_run_id").read_text().strip()
    runs = sorted((wd / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, list((wd / "wandb").iterdir())
    for run in runs:
        (log,) = run.glob(f"run-{run_id}.wandb")
        data = log.read_bytes()
        # The flattened config (protobuf strings are stored as they are) and the records' keys.
        for needle in (b"model.d_model", b"train.steps", b"metrics.wandb_project", b"loss", b"goodput"):
            assert needle in data, (run.name, needle)
    assert b"parallax-test" in data
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # metrics.jsonl as without W&B
    assert not list(wd.glob("wandb/offline-run-*/files/output.log"))  # console capture stays off


def test_without_the_package_the_default_trains_and_wandb_true_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as if not installed
    wd = tmp_path / "run"
    assert main(["train", str(QUICKSTART), *_sets(*TINY), "--workdir", str(wd)]) == 0
    assert sys.modules["wandb"] is None and not (wd / "wandb").exists()
    capsys.readouterr()
    wd2 = tmp_path / "run2"
    assert main(["train", str(QUICKSTART), *_sets(*TINY, "metrics.wandb=true"), "--workdir", str(wd2)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.wandb=true needs the package 'wandb'" in err[0] and "pip install wandb" in err[0]
    assert not wd2.exists()


def test_wandb_true_without_the_package_is_refused_before_jax_starts(tmp_path):
    wd = tmp_path / "run"
    proc = _train(tmp_path, wd, *_sets("metrics.wandb=true"), BLOCK_WANDB="1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install wandb" in lines[0], proc.stderr
    assert proc.stdout.strip() == "jax imported: False", proc.stdout
    assert not wd.exists()


def test_an_unknown_wandb_mode_is_one_line(tmp_path, capsys):
    wd = tmp_path / "run"
    assert main(["train", str(QUICKSTART), *_sets(*TINY, "metrics.wandb_mode=cloud"), "--workdir", str(wd)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.wandb_mode: must be one of 'offline', 'online', 'disabled'" in err[0], err
    assert not wd.exists()
