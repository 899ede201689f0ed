"""What the compiled train step holds at its memory peak, beside the cost model's parts (issue 15, item 4).

    python experiments/peak_buffers.py "1b dp x tp, ZeRO-1/h100-8"
    python experiments/peak_buffers.py "1b dp x tp, ZeRO-1/h100-8" --set train.global_batch=16 --set model.n_layers=8

Compiles one row of experiments/targets.py (ROWS or CALIBRATION) for its compile-only target with
XLA's buffer assignment dumped as a proto, replays the heap simulator's trace
(parallax/analysis/heap.py) and prints: memory_analysis()'s arguments and temporaries, the
replayed peak and where it falls, the cost model's parts (cost.memory_parts), the live bytes per
program region (the op_name's path up to the first loop body) and the largest live buffers.
`--set SECTION.FIELD=VALUE` varies the row (one compile each), so a term of the model can be
isolated: what the temporaries gain per layer, per row of the batch, per loss-head chunk.
Every figure is "compiled for TARGET, not run".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend of their own

import targets  # noqa: E402  (experiments/targets.py: the rows)

GIB, MIB = 2**30, 2**20


def vary(cfg, assignments: list[str]):
    """`cfg` with each 'section.field=value' replaced (the value parsed as the field's type)."""
    for a in assignments:
        path, value = a.split("=", 1)
        section, name = path.split(".")
        old = getattr(getattr(cfg, section), name)
        new = (value.lower() in ("1", "true")) if isinstance(old, bool) else type(old)(value)
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: new})})
    return cfg


def region(op_name: str) -> str:
    """The program region of an op_name: its path up to the first loop body, without 'jit(step)/'."""
    path = op_name.removeprefix("jit(step)/")
    return re.split(r"/while/body/", path)[0][:90] or "(compiler-made)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("row", choices=sorted({**targets.ROWS, **targets.CALIBRATION}))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--top", type=int, default=20, help="largest live buffers to list")
    args = ap.parse_args()

    from parallax.analysis.audit import compile_step
    from parallax.analysis.cost import Grid, Workload, memory_parts, memory_platform
    from parallax.analysis.heap import DUMP_OPTIONS, dumped_peak

    cfg = vary({**targets.ROWS, **targets.CALIBRATION}[args.row], args.set)
    name = args.row.split("/")[1]
    with tempfile.TemporaryDirectory() as d:
        step = compile_step(cfg, {**DUMP_OPTIONS, "xla_dump_to": d}, name)
        p = dumped_peak(d)
    m = step.memory
    parts = memory_parts(Workload.of(cfg), Grid.of(cfg, step.mesh_shape), memory_platform(step.platform),
                         attention=step.attention)
    print(f"{' '.join([args.row, *args.set])}: compiled for {name}, not run (compile {step.compile_s:.0f} s)")
    print(f"memory_analysis: arguments {m['argument'] / GIB:.3f} GiB, temporaries {m['temp'] / GIB:.3f} GiB; "
          f"heap trace peak {p.bytes / GIB:.3f} GiB at {p.instruction} ({p.computation})")
    print("cost model: " + ", ".join(f"{k} {float(v) / GIB:.3f}" for k, v in parts.items() if float(v)))
    print("live at the peak, by region (GiB):")
    for r, b in p.by(lambda x: region(x.op_name)).items():
        if b >= 0.01 * p.bytes:
            print(f"  {b / GIB:7.3f}  {r}")
    print("largest live buffers (MiB):")
    for b in p.buffers[:args.top]:
        print(f"  {b.bytes / MIB:9.1f}  {b.instruction:<34} {b.op_name.removeprefix('jit(step)/')[-110:]}")


if __name__ == "__main__":
    main()
