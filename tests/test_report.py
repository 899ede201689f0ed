"""experiments/report.py on real (tiny) runs, and experiments/bench_gpu.py at its tiny CPU size.

The figures themselves are the scripts' business (BUILD_NOTES.md records them); this checks that
the scripts run, write valid non-empty PNGs and a JSON with positive figures, skip plots whose data
are absent, keep the last record of a repeated step, and refuse bad input with one line and exit 2.
The trainings run in-process on conftest's 8 simulated CPU devices: a tiny model, 3 steps each.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.model.transformer import count_params

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.py"
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
        "train.seq_len=16", "train.global_batch=8", "train.steps=3", "train.eval_every=2", "train.eval_batches=1"]
LAYOUTS = {
    "data4_tensor2": ["mesh.data=4", "mesh.tensor=2"],
    "data2_tensor2_pipe2": ["mesh.data=2", "mesh.tensor=2", "mesh.pipe=2", "parallel.microbatches=2"],
}


def _load(name: str):
    """An experiments/ script as a module (registered first: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load("report")


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 3-step runs (one pipelined) and the audit of the first: {name: workdir}, audit path."""
    from parallax.cli import main

    root = tmp_path_factory.mktemp("runs")
    workdirs = {}
    for name, layout in LAYOUTS.items():
        wd = root / name
        assert main(["train", str(QUICKSTART), *_sets(TINY + layout), "--workdir", str(wd)]) == 0
        workdirs[name] = wd
    audit = root / "audit_data4_tensor2.json"
    proc = subprocess.run([sys.executable, "-m", "parallax", "audit", str(QUICKSTART), "--json",
                           *_sets(TINY + LAYOUTS["data4_tensor2"])], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    audit.write_text(proc.stdout)
    return workdirs, audit


def _assert_png(path: Path):
    import matplotlib.image

    assert path.is_file(), path
    assert 1000 < path.stat().st_size < 100_000, (path, path.stat().st_size)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0.01  # something drawn, not a blank canvas


def test_report_writes_every_plot(runs, tmp_path, capsys):
    workdirs, audit = runs
    out = tmp_path / "out"
    assert report.main([*map(str, workdirs.values()), "--audit", str(audit), "--out", str(out), "--name", "t"]) == 0
    printed = capsys.readouterr().out
    for kind in ("loss", "throughput", "bubble", "collectives", "memory"):
        _assert_png(out / f"t_{kind}.png")
    # The per-run summary names both runs; CPU runs have no MFU, which is said, not drawn empty.
    assert "data4_tensor2" in printed and "data2_tensor2_pipe2" in printed
    assert "MFU panel left out" in printed


def test_report_skips_plots_without_data(runs, tmp_path, capsys):
    workdirs, _ = runs
    out = tmp_path / "out"
    assert report.main([str(workdirs["data4_tensor2"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["report_loss.png", "report_throughput.png"]
    for kind in ("bubble", "collectives", "memory"):
        assert f"report: {kind} plot skipped: " in printed


def test_pipelined_run_reads_its_schedule(runs):
    workdirs, _ = runs
    wd = workdirs["data2_tensor2_pipe2"]
    label = wd.name
    groups = report.bubble_points({label: report.read_metrics(wd)}, {label: report.read_saved_config(wd)})
    (key, [pt]), = groups.items()
    assert key == ("gpipe", 2, 1) and pt["m"] == 2
    assert pt["table"] == pytest.approx(1 / 3)  # (P-1)/(M+P-1) with P=2, M=2


def test_measured_bubble_fit():
    # step time = 0.1 m + 0.3 exactly: the fit's constant over the step is the bubble.
    pts = [{"label": f"m{m}", "m": m, "rows": 2, "step_s": 0.1 * m + 0.3} for m in (2, 4, 8)]
    got = report.measured_bubble(pts)
    assert got == pytest.approx({f"m{m}": 0.3 / (0.1 * m + 0.3) for m in (2, 4, 8)})
    assert report.measured_bubble(pts[:1]) == {}  # one M: nothing to fit


def test_resumed_run_keeps_last_record_per_step(tmp_path):
    wd = tmp_path / "resumed"
    wd.mkdir()
    lines = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 3, "loss": 3.9},
             {"step": 3, "loss": 3.5}, {"step": 4, "loss": 3.0}]  # crash after 3, resumed from 2
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n")
    records = report.read_metrics(wd)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.0)]


def _run_report(*args):
    return subprocess.run([sys.executable, "experiments/report.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty_workdir"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": \n')
    cases = [
        ([str(empty)], str(empty / "metrics.jsonl")),
        ([str(tmp_path / "missing")], str(tmp_path / "missing")),
        ([str(broken)], f"{broken / 'metrics.jsonl'}:2: malformed JSON"),
    ]
    for argv, needle in cases:
        proc = _run_report(*argv, "--out", str(tmp_path / "out"))
        assert proc.returncode == 2, proc
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("report: error: ") and needle in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()


def test_bench_gpu_tiny(tmp_path):
    out = tmp_path / "bench_gpu.json"
    # moe_bf16 is left out to save a child process (~15 s): moe_fp8 runs the same MoE code and more.
    cases = ["dense_bf16", "dense_fp8", "moe_fp8"]
    proc = subprocess.run([sys.executable, "experiments/bench_gpu.py", "--tiny", "--json", str(out), "--cases", *cases],
                          cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["cases"]) == set(cases)
    bench = _load("bench_gpu")
    for name, r in figures["cases"].items():
        assert "error" not in r, r
        cfg = bench.make_config(next(c for c in bench.CASES if c.name == name), tiny=True)
        assert r["params"] == count_params(cfg.model)["total"]
        assert (r["active_params"] < r["params"]) == name.startswith("moe")  # MoE: unchosen experts idle
        for key in ("step_s", "tokens_per_s", "tflops_per_device", "compile_s", "xla_memory_bytes",
                    "predicted_memory_bytes", "model_flops_per_step"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (name, key, r[key])
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s"])
        assert r["device"].startswith("cpu") and r["mfu"] is None  # no CPU peak: MFU unknown, not invented
        assert r["finite"]
        # XLA:CPU upcasts FP8 operands before each dot: the check must say so, not claim FP8 GEMMs.
        assert r["fp8_gemm_present"] is False
    assert figures["summary"]["speedup_fp8_over_bf16"] > 0
    assert figures["pending"] == {}
    assert all(c["verdict"] == "n/a" for c in figures["summary"]["checks"].values())  # tiny CPU: no verdicts
    assert "fp8 gemm" in proc.stdout and "not present" in proc.stdout


def test_gpu_checks_tiny(tmp_path):
    """experiments/gpu_checks.py on CPU: the script's own check (XLA attention in bfloat16 against
    float32, the FP8 matmul against the CPU emulation, which it is); the cuDNN rows and the FP8 GEMM
    verdict exist only on a GPU, and the CPU run must not invent them."""
    out = tmp_path / "checks.json"
    proc = subprocess.run([sys.executable, "experiments/gpu_checks.py", "--tiny", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["device"].startswith("cpu")
    for rows in ("unpacked", "packed"):
        row = figures["attention_numerics"][rows]
        assert len(row["xla_bf16"]) == 4 and all(0 < e < 0.01 for e in row["xla_bf16"]), row  # out, dq, dk, dv
        assert "cudnn_bf16" not in row
    assert set(figures["attention_cost"]) == {"shape", "xla", "wall_s"} and figures["attention_cost"]["xla"]["cudnn_calls"] == 0
    fp8 = figures["fp8_gemm"]
    assert fp8["fp8_gemms"] == 0 and fp8["rel_vs_cpu_emulation"] == 0  # XLA:CPU: the emulation itself
    assert 0.01 < fp8["rel_vs_float64"] < 0.08  # E4M3's rounding of both operands
