"""The overhead benchmark script runs end to end at tiny size (its figures are not checked here:
timing is the script's business, recorded in BUILD_NOTES.md, never a test assertion)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_overhead_tiny(tmp_path):
    out_json = tmp_path / "bench.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "experiments/bench_overhead.py", "--tiny", "--json", str(out_json)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("step_ratio", "compile_ratio"):
        assert re.search(rf"^RESULT {name}\s+\d+\.\d+\s+target <= [\d.]+\s+(PASS|FAIL)", proc.stdout, re.M), proc.stdout
    # Both steps start from the same parameters and batch, so the first losses agree.
    figures = json.loads(out_json.read_text())
    assert abs(figures["loss_parallax"] - figures["loss_plain"]) < 1e-5
    assert figures["step_ratio"] > 0 and figures["compile_ratio"] > 0
