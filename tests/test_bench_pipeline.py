"""The pipeline benchmark script runs end to end at tiny size (its figures are not checked here:
memory and timing are the script's business, recorded in BUILD_NOTES.md, never a test assertion;
only that it ran, printed the memory ratio line, and wrote its plot and JSON)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_pipeline_tiny(tmp_path):
    out_json = tmp_path / "bench.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "experiments/bench_pipeline.py", "--tiny", "--out", str(tmp_path), "--json", str(out_json)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The memory ratio line: a figure and a verdict, or n/a where the backend has no memory analysis.
    assert re.search(
        r"^RESULT mem_ratio_1f1b_over_gpipe\s+(\d+\.\d+\s+target <= 0\.5\s+(PASS|FAIL)|n/a)", proc.stdout, re.M
    ), proc.stdout
    # ... and the table schedules' lines: interleaved and ZB-H1 against GPipe, ZB-H1 against 1F1B
    for a, b, target in (("interleaved_r2", "gpipe", "0.5"), ("zb_h1", "gpipe", "0.5"), ("zb_h1", "1f1b", "1.1")):
        assert re.search(rf"^RESULT mem_ratio_{a}_over_{b}\s+(\d+\.\d+\s+target <= {re.escape(target)}\s+(PASS|FAIL)|n/a)",
                         proc.stdout, re.M), proc.stdout
    assert re.search(r"^RESULT zb_h1_work_over_1f1b\s+\d+\.\d+", proc.stdout, re.M), proc.stdout
    png = tmp_path / "pipeline_bubble.png"
    assert png.is_file() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = json.loads(out_json.read_text())
    assert set(figures["bubble"]) == {"gpipe", "circular_r2", "1f1b", "zb_h1"}
    assert re.search(r"^RESULT step_ratio_zb_h1_over_1f1b_m4\s+\d+\.\d+", proc.stdout, re.M), proc.stdout
    for res in figures["bubble"].values():
        assert [p["m"] for p in res["points"]] == [4, 8]
    # Every schedule's first step starts from the same parameters and batch: same loss.
    first = [res["first_step_loss"] for res in figures["bubble"].values()]
    assert max(first) - min(first) < 1e-4, first
