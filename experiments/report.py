"""Plots from parallax runs: loss curves, throughput/MFU, pipeline bubble, collective bytes, memory.

    python experiments/report.py WORKDIR [WORKDIR ...] [--out DIR] [--name PREFIX] [--audit AUDIT.json ...]

    # e.g. one device against data=4 x tensor=2, and what the compiler does for the second:
    parallax train experiments/quickstart.py --set mesh.data=1 --set mesh.tensor=1 --workdir runs/1dev
    parallax train experiments/quickstart.py --workdir runs/d4t2
    parallax audit experiments/quickstart.py --json > runs/d4t2_audit.json
    python experiments/report.py runs/1dev runs/d4t2 --audit runs/d4t2_audit.json --out runs/report

Each WORKDIR is a `parallax train` workdir; its name labels the run, and every plot overlays all
runs, so any set compares (BF16 vs FP8, dense vs MoE, 1 device vs 3D/4D layouts). Written under
--out (default runs/report), as PREFIX_*.png (default PREFIX `report`), each only when its data exist
(otherwise one line says why it was skipped):
- loss:       train loss against step, and validation loss where the runs logged it.
- throughput: tokens/s against step, and MFU (BF16 peak; FP8 peak dashed) where it is known (not CPU).
- bubble:     pipelined runs: bubble against microbatches M. The formula (P-1)/(R M + P-1) as lines,
              the schedule-table count each run logged (`bubble_fraction`) as circles, and where runs of
              one schedule differ only in M (same rows per microbatch), the measured bubble c/(a M + c)
              from fitting median step time = a M + c, as crosses (as experiments/bench_pipeline.py
              does). P, M, R and the schedule come from the config saved with the run's newest
              checkpoint (metrics.jsonl does not carry them).
- collectives: from `parallax audit --json` files: bytes per step per device on each mesh axis,
              compiled HLO against the cost model.
- memory:     from the same files: XLA's memory analysis per device against the cost model's parts
              (the planner's prediction).
A resume drops the records of the steps it repeats (a crash after the last checkpoint), so each
step appears once; in files written before parallax did that, a duplicated step keeps its last record.
A per-run summary (final losses, median tokens/s) is printed. Bad input (missing workdir or
metrics.jsonl, a malformed line) prints one line naming the file and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

EXIT_USAGE = 2
DPI = 100  # the PNGs are committed: small figures, default line widths
# Layouts do not change the math, so their loss curves coincide: dashes keep each one visible.
STYLES = ("-", "--", ":", "-.")


class ReportError(ValueError):
    """Bad input the user can fix: one line, exit status 2, no traceback."""


# ----------------------------------------------------------------------------------------------
# Input


def read_metrics(workdir: Path) -> list[dict]:
    """Records of WORKDIR/metrics.jsonl sorted by step; for a repeated step the last record wins."""
    if not workdir.is_dir():
        raise ReportError(f"{workdir}: no such workdir")
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path}: not found (is {workdir} a `parallax train` workdir?)")
    by_step = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{n}: malformed JSON line ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ReportError(f"{path}:{n}: expected an object with an integer 'step'")
        by_step[rec["step"]] = rec
    if not by_step:
        raise ReportError(f"{path}: no records")
    return [by_step[s] for s in sorted(by_step)]


def read_saved_config(workdir: Path) -> dict | None:
    """The flat config saved with the newest checkpoint (parallax.train.checkpoint.make_meta), if any."""
    steps = sorted((p for p in (workdir / "checkpoints").glob("*/meta/metadata") if p.parts[-3].isdigit()),
                   key=lambda p: int(p.parts[-3]))
    for path in reversed(steps):
        try:
            return json.loads(path.read_text())["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def read_audit(path: Path) -> dict:
    try:
        a = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: malformed JSON ({e.msg} at line {e.lineno}); expected `parallax audit --json` output") from None
    if not isinstance(a, dict) or not {"axes", "memory", "mesh"} <= set(a):
        raise ReportError(f"{path}: not `parallax audit --json` output (needs 'mesh', 'axes', 'memory')")
    return a


def labels_for(paths: list[Path]) -> list[str]:
    """The workdir's name; parent/name where two runs share a name."""
    names = [p.resolve().name for p in paths]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [s for s, _ in pts], [v for _, v in pts]


# ----------------------------------------------------------------------------------------------
# Plots (each returns the path written, or None with the reason printed)


def _smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average (a window of 1 returns the data)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot_loss(runs: dict, plt, path: Path) -> Path | None:
    train = {k: series(r, "loss") for k, r in runs.items()}
    evals = {k: series(r, "eval_loss") for k, r in runs.items()}
    if not any(xs for xs, _ in train.values()):
        return _skip("loss", "no run logged a loss")
    with_eval = any(xs for xs, _ in evals.values())
    fig, axes = plt.subplots(1, 2 if with_eval else 1, figsize=(10 if with_eval else 6, 4), squeeze=False)
    ax = axes[0][0]
    for i, (label, (xs, ys)) in enumerate(train.items()):
        color = f"C{i % 10}"
        window = max(1, len(ys) // 25)  # noisy per-step losses: show the trend solid, the raw faint
        if window > 1:
            ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
        ax.plot(xs, _smooth(ys, window), STYLES[i % len(STYLES)], color=color, lw=1.5,
                label=label + (f" (mean of {window})" if window > 1 else ""))
    ax.set(title="Training loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if with_eval:
        ax = axes[0][1]
        for i, (label, (xs, ys)) in enumerate(evals.items()):
            if xs:
                ax.plot(xs, ys, "o" + STYLES[i % len(STYLES)], color=f"C{i % 10}", ms=4, mfc="none", label=label)
        ax.set(title="Validation loss", xlabel="step", ylabel="cross-entropy (nats/token)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def plot_throughput(runs: dict, plt, path: Path) -> Path | None:
    tps = {k: series(r, "tokens_per_s") for k, r in runs.items()}
    mfu = {k: series(r, "mfu") for k, r in runs.items()}
    mfu8 = {k: series(r, "mfu_fp8") for k, r in runs.items()}
    if not any(xs for xs, _ in tps.values()):
        return _skip("throughput", "no run logged tokens_per_s")
    with_mfu = any(xs for xs, _ in mfu.values())
    if not with_mfu:
        print("report: MFU panel left out: no run has a known MFU (null on CPU: no peak FLOP/s)")
    fig, axes = plt.subplots(1, 2 if with_mfu else 1, figsize=(10 if with_mfu else 6, 4), squeeze=False)
    ax = axes[0][0]
    for i, (label, (xs, ys)) in enumerate(tps.items()):
        if xs:
            med = statistics.median(ys)
            ax.plot(xs, ys, color=f"C{i % 10}", lw=1, label=f"{label} (median {med:,.0f})")
    ax.set(title="Throughput", xlabel="step", ylabel="tokens/s (all devices)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if with_mfu:
        ax = axes[0][1]
        for i, label in enumerate(runs):
            xs, ys = mfu[label]
            if xs:
                ax.plot(xs, [100 * y for y in ys], color=f"C{i % 10}", lw=1, label=f"{label} (BF16 peak)")
            xs, ys = mfu8[label]
            if xs:
                ax.plot(xs, [100 * y for y in ys], "--", color=f"C{i % 10}", lw=1, label=f"{label} (FP8 peak)")
        ax.set(title="Model FLOPs utilisation", xlabel="step", ylabel="MFU (% of peak)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def bubble_points(runs: dict, configs: dict) -> dict:
    """{(schedule, P, R): [{label, m, rows, table, step_s}]} for pipelined runs with a saved config."""
    groups = {}
    for label, records in runs.items():
        _, table = series(records, "bubble_fraction")
        if not table:
            continue
        cfg = configs.get(label)
        if cfg is None:
            print(f"report: bubble: {label} left out: no checkpoint config to read P and M from")
            continue
        p, m, r = cfg["mesh.pipe"], cfg["parallel.microbatches"], cfg.get("parallel.repeats", 1)
        sched = cfg.get("parallel.schedule", "gpipe")
        r = r if sched == "circular" else 1
        _, times = series(records[1:] or records, "step_time_s")  # the first step after compile runs slower
        groups.setdefault((sched, p, r), []).append({
            "label": label, "m": m, "rows": cfg["train.global_batch"] // m, "table": table[-1],
            "step_s": statistics.median(times) if times else None})
    return groups


def measured_bubble(points: list[dict]) -> dict[str, float]:
    """label -> c / (a m + c) from a least-squares fit of step time = a m + c over runs that differ
    only in m (same rows per microbatch); {} when fewer than two distinct m."""
    out = {}
    by_rows = {}
    for pt in points:
        if pt["step_s"] is not None:
            by_rows.setdefault(pt["rows"], []).append(pt)
    for pts in by_rows.values():
        ms = [pt["m"] for pt in pts]
        if len(set(ms)) < 2:
            continue
        mx, my = statistics.fmean(ms), statistics.fmean(pt["step_s"] for pt in pts)
        a = sum((pt["m"] - mx) * (pt["step_s"] - my) for pt in pts) / sum((m - mx) ** 2 for m in ms)
        c = my - a * mx
        for pt in pts:
            out[pt["label"]] = c / (a * pt["m"] + c)
    return out


def plot_bubble(runs: dict, configs: dict, plt, path: Path) -> Path | None:
    groups = bubble_points(runs, configs)
    if not groups:
        return _skip("bubble", "no pipelined run with a saved config (bubble_fraction and a checkpoint)")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, ((sched, p, r), pts) in enumerate(sorted(groups.items())):
        color = f"C{i % 10}"
        ms = sorted({pt["m"] for pt in pts})
        grid = list(range(max(1, min(ms) // 2), 2 * max(ms) + 1))
        name = f"{sched} P={p}" + (f" R={r}" if r > 1 else "")
        ax.plot(grid, [(p - 1) / (r * m + p - 1) for m in grid], "-", color=color, lw=1,
                label=f"{name}: formula (P-1)/(RM+P-1)")
        ax.plot([pt["m"] for pt in pts], [pt["table"] for pt in pts], "o", color=color, ms=6, mfc="none",
                label=f"{name}: schedule table (metrics.jsonl)")
        measured = measured_bubble(pts)
        if measured:
            ax.plot([pt["m"] for pt in pts if pt["label"] in measured], [measured[pt["label"]] for pt in pts
                    if pt["label"] in measured], "x", color=color, ms=8, label=f"{name}: measured (step-time fit)")
    ax.set(title="Pipeline bubble against microbatches", xlabel="microbatches per step, M",
           ylabel="bubble (fraction of step time)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    if not any(measured_bubble(pts) for pts in groups.values()):
        print("report: bubble: no measured points (needs runs of one schedule at two or more M, same rows per microbatch)")
    return _save(fig, plt, path)


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return scale, name
    return 1, "bytes"


def plot_collectives(audits: dict, plt, path: Path) -> Path | None:
    usable = {k: a for k, a in audits.items() if a["axes"]}
    if not usable:
        return _skip("collectives", "no audit file given, or no collective in them (single device)")
    top = max(max(f["bytes"], f["model_bytes"]) for a in usable.values() for f in a["axes"].values())
    scale, unit = _unit(top)
    fig, axes = plt.subplots(1, len(usable), figsize=(min(4.2 * len(usable) + 1, 13), 4), squeeze=False, sharey=True)
    for ax, (label, a) in zip(axes[0], usable.items()):  # one panel per audited layout
        names = list(a["axes"])
        compiled = [a["axes"][n]["bytes"] for n in names]
        model = [a["axes"][n]["model_bytes"] for n in names]
        xs = range(len(names))
        w = 0.38
        ax.bar([x - w / 2 for x in xs], [v / scale for v in compiled], w, color="C0", label="compiled HLO")
        ax.bar([x + w / 2 for x in xs], [v / scale for v in model], w, color="C1", label="cost model")
        for x, c, m in zip(xs, compiled, model):  # the model's error against the compiler, as audit prints it
            if c and m:
                ax.text(x, max(c, m) / scale, f"{m / c - 1:+.1%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), names)
        mesh = " x ".join(f"{k}={v}" for k, v in a["mesh"].items() if v > 1)
        ax.set_title(f"{label}\n({mesh})", fontsize=9)
        ax.set(xlabel="mesh axis")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set(ylabel=f"{unit} per step per device")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Collective bytes per mesh axis: compiled against the cost model", fontsize=10)
    return _save(fig, plt, path)


XLA_PARTS = ("argument", "temp", "output not aliased")
MODEL_PARTS = ("params", "optimizer", "gradients", "activations", "working", "logits", "gathered", "batch")


def plot_memory(audits: dict, plt, path: Path) -> Path | None:
    usable = {k: a for k, a in audits.items() if a["memory"].get("xla")}
    for k in audits.keys() - usable.keys():
        print(f"report: memory: {k} left out: the backend gave no memory analysis")
    if not usable:
        return _skip("memory", "no audit file with XLA's memory analysis")
    bars, groups = [], []  # bars: (x position, tick label, {part: bytes}); groups: (centre, audit label)
    for g, (label, a) in enumerate(usable.items()):
        x, model = a["memory"]["xla"], a["memory"]["model"]
        err = a["memory"].get("error")
        left = 2.6 * g  # a gap between the pairs of different audits
        bars.append((left, "XLA", {"argument": x["argument"], "temp": x["temp"],
                                   "output not aliased": x["output"] - x["alias"]}))
        bars.append((left + 1, "cost model" + (f"\n({err:+.1%})" if err is not None else ""),
                     {p: model.get(p, 0.0) for p in MODEL_PARTS}))
        groups.append((left + 0.5, label))
    scale, unit = _unit(max(sum(b.values()) for _, _, b in bars))
    fig, ax = plt.subplots(figsize=(min(max(6.0, 3.2 * len(usable) + 3), 13), 4.4))
    cmap = plt.get_cmap("tab20")  # 11 parts: more than the 10 default colours
    colors = {p: cmap(i) for i, p in enumerate(XLA_PARTS + MODEL_PARTS)}
    drawn = set()
    for pos, _, parts in bars:
        bottom = 0.0
        for part, v in parts.items():
            if v <= 0:
                continue
            ax.bar(pos, v / scale, 0.8, bottom=bottom, color=colors[part], label=None if part in drawn else part)
            drawn.add(part)
            bottom += v / scale
        ax.text(pos, bottom, f"{bottom:,.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([b[0] for b in bars], [b[1] for b in bars], fontsize=8)
    for centre, label in groups:  # the audit file each pair comes from, under its tick labels
        ax.text(centre, -0.2, label, ha="center", va="top", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set_title("Memory per device: XLA against the planner's cost model", fontsize=10)
    ax.set(ylabel=f"{unit} per device")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, plt, path)


def _skip(name: str, why: str) -> None:
    print(f"report: {name} plot skipped: {why}")
    return None


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"report: wrote {path}")
    return path


# ----------------------------------------------------------------------------------------------


def summary_lines(runs: dict) -> list[str]:
    lines = [f"{'run':<24} {'steps':>6} {'loss (last 10 logged)':>22} {'eval loss':>10} {'tokens/s (median)':>18}"]
    for label, records in runs.items():
        _, losses = series(records, "loss")
        _, evals = series(records, "eval_loss")
        _, tps = series(records, "tokens_per_s")
        tail = losses[-10:]
        lines.append(f"{label:<24} {records[-1]['step']:>6} "
                     f"{(f'{statistics.fmean(tail):.4f}' if tail else '-'):>22} {(f'{evals[-1]:.4f}' if evals else '-'):>10} "
                     f"{(f'{statistics.median(tps):,.0f}' if tps else '-'):>18}")
    return lines


def report(workdirs: list[Path], audit_paths: list[Path], out: Path, prefix: str) -> list[Path]:
    runs = {label: read_metrics(w) for label, w in zip(labels_for(workdirs), workdirs)}
    configs = {label: read_saved_config(w) for label, w in zip(labels_for(workdirs), workdirs)}
    audits = {p.stem: read_audit(p) for p in audit_paths}
    try:
        import matplotlib
    except ImportError:
        raise ReportError("matplotlib is not installed (pip install -e '.[test]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    if runs:
        print("\n".join(summary_lines(runs)))
    written = [
        plot_loss(runs, plt, out / f"{prefix}_loss.png") if runs else _skip("loss", "no workdir given"),
        plot_throughput(runs, plt, out / f"{prefix}_throughput.png") if runs else _skip("throughput", "no workdir given"),
        plot_bubble(runs, configs, plt, out / f"{prefix}_bubble.png"),
        plot_collectives(audits, plt, out / f"{prefix}_collectives.png"),
        plot_memory(audits, plt, out / f"{prefix}_memory.png") if audits else _skip("memory", "no audit file given"),
    ]
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="report.py", description=__doc__.splitlines()[0])
    ap.add_argument("workdirs", nargs="*", type=Path, help="parallax train workdirs (each holds metrics.jsonl)")
    ap.add_argument("--audit", nargs="+", default=[], type=Path, metavar="AUDIT.json",
                    help="`parallax audit --json` outputs (label: the file name)")
    ap.add_argument("--out", type=Path, default=Path("runs/report"), help="output directory (default runs/report)")
    ap.add_argument("--name", default="report", help="file name prefix (default report)")
    args = ap.parse_args(argv)
    try:
        if not args.workdirs and not args.audit:
            raise ReportError("nothing to plot: give at least one WORKDIR or --audit file")
        written = report(args.workdirs, args.audit, args.out, args.name)
    except ReportError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"report: {len(written)} plot(s) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
