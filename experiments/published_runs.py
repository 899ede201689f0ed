"""The planner against published large runs: the layout it chooses and its predicted MFU, beside
the published layout and MFU (and how parallax would run the published layout).

    python experiments/published_runs.py              # fused attention, as the published runs used
    python experiments/published_runs.py --attention xla   # parallax's attention today

Pure arithmetic (parallax/analysis/plan.py over parallax/analysis/cost.py); seconds on a laptop.
"""

from __future__ import annotations

import argparse
import sys

from parallax.analysis.plan import PUBLISHED, compare_published


def _layout(r: dict | None) -> str:
    if r is None:
        return "none fits"
    sched = r["schedule"] + (f"x{r['repeats']}" if r["repeats"] > 1 else "")
    sp = (" SP" if r["sequence_parallel_dim"] == "length" else " SP(D)") if r["sequence_parallel"] else ""
    return (f"d{r['data']} t{r['tensor']}{sp} p{r['pipe']} ZeRO-{r['zero']} M{r['microbatches']} {sched} remat={r['remat']}, "
            f"{r['memory_gib']:.1f} GiB, MFU {r['mfu']:.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", choices=("xla", "fused"), default="fused")
    args = ap.parse_args(argv)
    for run in PUBLISHED:
        c = compare_published(run, args.attention)
        lo, hi = run.mfu
        pub = f"{lo:.1%}" if lo == hi else f"{lo:.0%}-{hi:.0%}"
        chosen = c["chosen"]
        gap = None if chosen is None else min(abs(chosen["mfu"] - lo), abs(chosen["mfu"] - hi)) * (
            0 if lo <= chosen["mfu"] <= hi else 1)
        pl = run.layout
        p = c["published_in_parallax"]
        print(f"{run.name}: {run.devices} {run.device}; published d{pl['data']} t{pl['tensor']} p{pl['pipe']}, MFU {pub}")
        print(f"  planner's choice:        {_layout(chosen)}"
              + ("" if gap is None else f"  (distance to published: {gap * 100:.1f} points)"))
        if not run.sequence_parallel:  # planned above with the published system's features
            print(f"  ... with sequence parallelism, which the published system lacked: {_layout(c['chosen_all_features'])}")
            if run.mfu_with_sp:
                print(f"      (published with it: {run.mfu_with_sp[0]:.1%}; {run.source_with_sp})")
        print("  published layout here:   " + ("not expressible (divisibility)" if p is None else
                                               _layout(p) + ("" if p["fits"] else f" - does NOT fit {c['usable_gib']:.0f} GiB")))
        print(f"  source: {run.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
