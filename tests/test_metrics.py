import io
import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from parallax.train import metrics


@pytest.mark.parametrize("kind, bf16, fp8", [
    ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),
    ("NVIDIA H100 PCIe", 989e12, 1979e12),
    ("NVIDIA H200", 989e12, 1979e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, None),
    ("NVIDIA A100-SXM4-40GB", 312e12, None),
    ("NVIDIA B200", 2250e12, 4500e12),
    ("TPU v4", 275e12, None),
    ("TPU v5 lite", 197e12, 394e12),
    ("TPU v5e", 197e12, 394e12),
    ("TPU v5", 459e12, None),
    ("TPU v5p", 459e12, None),
    ("TPU v6 lite", 918e12, None),
    ("TPU v6e", 918e12, None),
])
def test_peak_flops_known_devices(kind, bf16, fp8):
    assert metrics.peak_flops(kind) == bf16
    assert metrics.peak_flops(kind, fp8=True) == fp8


@pytest.mark.parametrize("kind", ["cpu", "TFRT_CPU_0", "NVIDIA GB200", "TPU v4 lite", "Some NPU", ""])
def test_peak_flops_unknown_is_none(kind):
    assert metrics.peak_flops(kind) is None
    assert metrics.peak_flops(kind, fp8=True) is None


def test_peak_flops_of_this_host_cpu():
    import jax
    assert metrics.peak_flops(jax.devices()[0].device_kind) is None


def test_mfu_arithmetic():
    # 8 devices at 1e12 FLOP/s achieved each (8e12 FLOPs in 1 s), peak 4e12 -> 25%.
    assert metrics.tflops_per_device(8e12, 1.0, 8) == pytest.approx(1.0)
    assert metrics.mfu(8e12, 1.0, 8, 4e12) == pytest.approx(0.25)
    # Halving the step time doubles utilisation.
    assert metrics.mfu(8e12, 0.5, 8, 4e12) == pytest.approx(0.5)
    # Megatron's 1T anchor: 163 TFLOP/s per A100 is 52% of 312.
    peak = metrics.peak_flops("NVIDIA A100-SXM4-80GB")
    assert metrics.mfu(163e12 * 64 * 2.0, 2.0, 64, peak) == pytest.approx(163 / 312)
    assert metrics.mfu(8e12, 1.0, 8, None) is None
    assert metrics.mfu(8e12, 0.0, 8, 4e12) is None
    assert metrics.tflops_per_device(8e12, 0.0, 8) is None


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    records = [
        {"step": 1, "loss": np.float32(3.5), "tokens_per_s": 1000, "mfu": None, "layout": "d2t2"},
        {"step": np.int64(2), "loss": jnp.asarray(3.25), "tokens_per_s": 1100.5, "mfu": 0.4,
         "finite": jnp.asarray(True), "grad_norm": float("nan")},
    ]
    with metrics.MetricsWriter(tmp_path / "run") as w:
        for r in records:
            w.write(r)
        # Each line is flushed as written: readable before close.
        assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert parsed[0] == {"step": 1, "loss": 3.5, "tokens_per_s": 1000, "mfu": None, "layout": "d2t2"}
    assert parsed[1]["step"] == 2 and isinstance(parsed[1]["step"], int)
    assert parsed[1]["loss"] == pytest.approx(3.25)
    assert parsed[1]["finite"] is True
    assert parsed[1]["grad_norm"] is None  # NaN is not valid JSON
    assert "NaN" not in lines[1]
    events = list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def _read_tb_scalars(tb_dir):
    """{tag: [(step, value)]} from tensorboardX event files (TFRecord framing, no tensorboard)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + n])  # skip length crc
            pos += 12 + n + 4  # payload crc
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


def test_metrics_writer_tensorboard_scalars(tmp_path):
    with metrics.MetricsWriter(tmp_path) as w:
        w.write({"step": 1, "loss": 2.0, "mfu": None, "layout": "x", "ok": True})
        w.write({"step": 2, "loss": 1.5, "mfu": 0.3})
    scalars = _read_tb_scalars(tmp_path / "tb")
    assert set(scalars) == {"loss", "mfu"}  # no 'step', no strings or bools, None skipped
    assert scalars["loss"] == [(1, 2.0), (2, 1.5)]
    assert scalars["mfu"] == [(2, pytest.approx(0.3))]


def test_metrics_writer_modes(tmp_path):
    with metrics.MetricsWriter(tmp_path) as w:
        w.write({"step": 1, "loss": 1.0})
    with metrics.MetricsWriter(tmp_path, mode="a") as w:
        w.write({"step": 2, "loss": 0.5})
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    with pytest.raises(FileExistsError):
        metrics.MetricsWriter(tmp_path, mode="x")
    with metrics.MetricsWriter(tmp_path, mode="w") as w:
        w.write({"step": 3})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3}\n'
    with pytest.raises(ValueError, match="mode"):
        metrics.MetricsWriter(tmp_path, mode="r")


def test_metrics_writer_x_mode_refusal_creates_no_tb(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("keep\n")
    with pytest.raises(FileExistsError):
        metrics.MetricsWriter(tmp_path, mode="x")
    assert not (tmp_path / "tb").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == "keep\n"


def test_metrics_writer_rejects_bad_records(tmp_path):
    with metrics.MetricsWriter(tmp_path) as w:
        with pytest.raises(ValueError, match="step"):
            w.write({"loss": 1.0})
        with pytest.raises(TypeError, match="'logits'"):
            w.write({"step": 1, "logits": np.zeros(3)})
    with pytest.raises(ValueError, match="closed"):
        w.write({"step": 2})


def test_metrics_writer_disabled_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    with metrics.MetricsWriter(workdir, enabled=False) as w:
        w.write({"step": 1, "loss": 1.0})
    assert not workdir.exists()
    assert list(tmp_path.iterdir()) == []


def _loop(progress, total):
    with progress:
        for step in range(1, total + 1):
            progress.update(step, {"loss": 4.0 - step * 0.01, "tokens_per_s": 4100.0,
                                   "step_time_s": 0.31, "mfu": None})


def test_progress_plain_output_without_tty():
    buf = io.StringIO()
    console = Console(file=buf)
    assert not console.is_interactive
    _loop(metrics.Progress(100, enabled=True, console=console), 100)
    lines = buf.getvalue().splitlines()
    # First update, then every total // 10 = 10 steps: 1, 11, 21, ..., 91, and the final step.
    assert [int(x.split()[1].split("/")[0]) for x in lines] == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
    last = lines[-1]
    assert last.startswith("step 100/100 loss 3 tok/s 4,100 step 0.31s mfu - eta 0s"), last
    assert "\x1b[" not in buf.getvalue()  # no escape codes in logs


def test_progress_default_console_with_capsys(capsys):
    _loop(metrics.Progress(7, enabled=True, log_every=3), 7)
    out = capsys.readouterr().out.splitlines()
    assert [x.split()[1] for x in out] == ["1/7", "4/7", "7/7"]


def test_progress_prints_last_step_on_early_exit():
    buf = io.StringIO()
    progress = metrics.Progress(100, enabled=True, console=Console(file=buf), log_every=50)
    with progress:
        for step in range(1, 8):  # preempted at step 7
            progress.update(step, {"loss": 1.0, "mfu": 0.412})
    lines = buf.getvalue().splitlines()
    assert [x.split()[1] for x in lines] == ["1/100", "7/100"]
    assert "mfu 41.2%" in lines[-1] and "tok/s -" in lines[-1]


def test_progress_time_based_lines(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    buf = io.StringIO()
    progress = metrics.Progress(1000, enabled=True, console=Console(file=buf))
    with progress:
        for step in range(1, 31):
            now[0] = step * 2.0  # 2 s per step: a line every 10 s, long before 100 steps
            progress.update(step, {"loss": 1.0})
    lines = buf.getvalue().splitlines()
    assert [x.split()[1] for x in lines] == ["1/1000", "6/1000", "11/1000", "16/1000", "21/1000",
                                             "26/1000", "30/1000"]
    # ETA from wall time since the first update: 2 s/step * 970 steps left.
    assert lines[-1].endswith("eta 32m20s")


def test_progress_disabled_prints_nothing():
    buf = io.StringIO()
    _loop(metrics.Progress(10, enabled=False, console=Console(file=buf)), 10)
    assert buf.getvalue() == ""


def test_progress_live_terminal_runs():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    progress = metrics.Progress(5, enabled=True, console=console)
    assert progress.live
    _loop(progress, 5)
    out = buf.getvalue()
    assert "5/5" in out and "tok/s 4,100" in out
