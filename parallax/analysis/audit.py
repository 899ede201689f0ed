"""`parallax audit`: compile the train step (for this machine or a named target) and hold the
compiled program (read by hlo.py) to the cost model: collectives per axis family, memory, FLOPs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from parallax.analysis.hlo import Collective, collectives, dot_flops, link_bytes, summarize, while_loops
from parallax.analysis.gemms import ATTENTION_KERNEL_NAMES, attention_kernels, fp8_report
from parallax.analysis.overlap import overlap_by_family, placement_of, placements
from parallax.config import Config

# ----------------------------------------------------------------------------------------------
# `parallax audit`: compile the step ahead of time and set it beside the cost model (cost.py)

SCALAR_BYTES = 4096  # per step: loss, gradient-norm and norm-scale pieces, reduced wherever XLA likes
# LLVM optimisation off: the optimized HLO (partitioning, collectives, buffer assignment, memory
# analysis) is the same as a default compile (checked: BUILD_NOTES.md), only machine-code
# generation is cheaper (~40% faster compiles). `parallax audit` and the tests use it.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def target_options(compiler_options: dict | None, platform: str) -> dict | None:
    """The options a target's compiler takes: FAST_COMPILE is XLA:CPU's LLVM level, which the
    TPU compiler does not know (and has no LLVM backend to speed up), so it is dropped there."""
    if platform == "cpu" or not compiler_options:
        return compiler_options
    return {k: v for k, v in compiler_options.items() if k not in FAST_COMPILE} or None


@dataclass(frozen=True)
class CompiledStep:
    hlo: str
    memory: dict[str, int] | None  # XLA's memory_analysis(), None where the backend gives none
    cost: dict[str, float] | None  # XLA's cost_analysis(), None where empty
    mesh_shape: dict[str, int]
    platform: str
    compile_s: float
    device_kind: str = ""
    target: str | None = None
    attention: str = "xla"  # the kernel the layout asked for on this platform (parallelism.attention_kernel)


def _memory_stats(compiled) -> dict[str, int] | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - best effort by contract: some backends raise, some return None
        return None
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    stats = {f.split("_size")[0]: int(getattr(m, f, 0) or 0) for f in fields}
    if not any(stats.values()):
        return None
    # pinned host memory the program holds (remat=save_attn_mlp_offload's residuals; not in `peak`)
    stats["host_temp"] = int(getattr(m, "host_temp_size_in_bytes", 0) or 0)
    # Donated state: outputs written over their arguments count once.
    stats["peak"] = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]
    return stats


def _cost_stats(compiled) -> dict[str, float] | None:
    try:
        c = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - best effort
        return None
    if isinstance(c, (list, tuple)):
        c = c[0] if c else None
    if not c:
        return None
    return {k: float(v) for k, v in c.items() if k in ("flops", "transcendentals", "bytes accessed")}


_COMPILED: dict[tuple, CompiledStep] = {}


def compile_step(cfg: Config, compiler_options: dict | None = None, target: str | None = None) -> CompiledStep:
    """Lower and compile the train step with abstract inputs on `cfg`'s mesh: nothing initialised,
    nothing run. `target`: a named compile-only target (parallel/targets.py: 'v5e-8', 'v5p-32'),
    compiled by that target's own compiler; None: the devices JAX has. Cached per (config,
    options, target): tests and the CLI share one compile per layout."""
    key = (cfg, tuple(sorted((compiler_options or {}).items())), target)
    if key in _COMPILED:
        return _COMPILED[key]
    import time

    devices = None
    if target is not None:  # before JAX starts (build imports it): a GPU target sets JAX_PLATFORMS=cpu
        from parallax.parallel.targets import target as lookup, target_devices, target_mesh_shape

        t = lookup(target)
        target_mesh_shape(cfg.mesh, t)  # the mesh against the target's count, naming the target
        devices = target_devices(t)
        from parallax.train.distributed import overlap_options

        # the collective-overlap flags a training run on the target sets (distributed.py)
        compiler_options = {**overlap_options(t.platform), **(target_options(compiler_options, t.platform) or {})}
    from parallax.train.build import build

    built = build(cfg, devices)
    started = time.perf_counter()
    lowered = built.train_step().lower(built.abstract_state(), built.abstract_batch())
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    step = CompiledStep(compiled.as_text(), _memory_stats(compiled), _cost_stats(compiled), dict(built.mesh.shape),
                        built.platform, time.perf_counter() - started, built.device_kind, target,
                        built.parallelism.attention)
    _COMPILED[key] = step
    return step


@dataclass(frozen=True)
class Row:
    """One (axes, kind) line: the compiled figures beside the model's."""

    axes: tuple[str, ...]
    kind: str
    ops: int  # distinct collectives in the program
    executions: int  # per step (conditional branches counted on every trip)
    bytes: int  # per step, per device
    model_executions: float
    model_bytes: float
    model_what: tuple[str, ...]
    conditional: bool
    sent: tuple[tuple[str, int], ...] = ()  # (element type on the wire, bytes per step), most bytes first
    overlapped: int = 0  # of `bytes`: asynchronous with compute scheduled between start and done
    group: int = 1  # devices in each group (the product of the axes' sizes)

    @property
    def links(self) -> float:
        """Bytes per step one device sends over its links (hlo.link_bytes)."""
        return float(link_bytes(self.kind, self.bytes, self.group))

    @property
    def model_links(self) -> float:
        return float(link_bytes(self.kind, self.model_bytes, self.group))

    @property
    def family(self) -> str:
        return axis_family(self.axes, self.kind)

    @property
    def explained(self) -> bool:
        if self.model_bytes > 0 or not self.axes:  # no axes: single-device groups, nothing moves
            return True
        return self.bytes <= SCALAR_BYTES  # loss and norm pieces: not modelled, never large

    @property
    def error(self) -> float | None:
        if self.model_bytes <= 0 or self.bytes <= 0:
            return None
        return self.model_bytes / self.bytes - 1


def axis_family(axes: tuple[str, ...], kind: str = "all-reduce") -> str:
    """The parallelism a collective serves: an all-to-all over `expert` is the MoE exchange
    (expert parallelism); anything else over a batch axis (data, or expert, which is more data
    parallelism outside MoE layers) is data parallelism (XLA sometimes spreads a gradient
    reduction over (data, pipe) or (data, tensor) replicas), then tensor, then pipe."""
    if kind.endswith("all-to-all") and "expert" in axes:
        return "expert"
    for family in ("data", "expert", "tensor", "pipe"):
        if family in axes:
            return "data" if family == "expert" else family
    return "none"


def family_totals(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Bytes per step per device by axis family, compiled beside modelled, with a row explained
    when its family is modelled at all (XLA may split one reduction over kinds and groups)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.family == "none":
            continue
        f = out.setdefault(r.family, {"bytes": 0, "model_bytes": 0.0, "executions": 0, "model_executions": 0.0,
                                      "links": 0.0, "model_links": 0.0})
        f["bytes"] += r.bytes
        f["model_bytes"] += r.model_bytes
        f["executions"] += r.executions
        f["model_executions"] += r.model_executions
        f["links"] += r.links
        f["model_links"] += r.model_links
    for f in out.values():
        f["error"] = f["model_bytes"] / f["bytes"] - 1 if f["bytes"] and f["model_bytes"] else None
        # the same comparison in bytes sent over the links: invariant to the kind a compiler chose
        f["links_error"] = f["model_links"] / f["links"] - 1 if f["links"] and f["model_links"] else None
    return out


def compare_collectives(found: list[Collective], terms: list, placed: dict | None = None,
                        mesh_shape: dict[str, int] | None = None) -> list[Row]:
    """Group compiled collectives and model terms by (mesh axes, kind) and set them side by side.
    `placed`: overlap.placements of the same program (the overlapped bytes per row); `mesh_shape`:
    the group sizes for the bytes sent over the links (Row.links; without it, groups of 1).

    The model's static executions (conditional branches on every trip) are what the HLO counts.
    """
    compiled = summarize(found)
    cond = {(c.kind, c.axes) for c in found if c.conditional}
    sent: dict[tuple, dict[str, int]] = {}
    hidden: dict[tuple, int] = {}
    for c in found:
        by_type = sent.setdefault((c.kind, c.axes), {})
        for dtype, nbytes in c.sent:
            by_type[dtype] = by_type.get(dtype, 0) + nbytes * c.executions
        if placed is not None and placement_of(c, placed).overlapped:
            hidden[(c.kind, c.axes)] = hidden.get((c.kind, c.axes), 0) + c.bytes_per_step
    model: dict[tuple, list] = {}
    for term in terms:
        static = float(np.sum(term.static))
        if static <= 0 or float(np.sum(term.bytes)) <= 0:
            continue
        row = model.setdefault((term.kind, term.axes), [0.0, 0.0, []])
        row[0] += static
        row[1] += float(np.sum(term.bytes * term.static))
        row[2].append(term.what)
    rows = []
    for key in sorted(set(compiled) | set(model), key=lambda k: (k[1], k[0])):
        c = compiled.get(key, {"ops": 0, "executions": 0, "bytes": 0})
        m = model.get(key, [0.0, 0.0, []])
        group = math.prod((mesh_shape or {}).get(a, 1) for a in key[1])
        rows.append(Row(key[1], key[0], c["ops"], c["executions"], c["bytes"], m[0], m[1], tuple(m[2]), key in cond,
                        tuple(sorted(sent.get(key, {}).items(), key=lambda kv: -kv[1])), hidden.get(key, 0), group))
    return rows


def executed_dot_flops(dots: dict, cfg: Config, head: float) -> float:
    """The matmul FLOPs one device executes per step, from hlo.dot_flops' count. A table schedule's
    tick branches are counted there on every tick; M x v of them are busy, but the loss head's,
    busy M times (the last chunk only): `head`, the model's head FLOPs, is taken off v - 1 times."""
    from parallax.schedules import Schedule

    p = cfg.parallel
    if cfg.mesh.pipe == 1:
        return dots["total"]
    sched = Schedule(cfg.mesh.pipe, p.microbatches, p.repeats, p.schedule)
    if not sched.own_gradients:
        return dots["total"]
    busy = p.microbatches * p.repeats
    return dots["total"] - dots["conditional"] * (1 - busy / sched.ticks) - head * (p.repeats - 1)


def audit(cfg: Config, compiler_options: dict | None = None, target: str | None = None) -> dict:
    """The whole audit as plain data (what `--json` prints). `target`: compile for a named
    compile-only target ('v5e-8': parallel/targets.py) with its own compiler, no device needed."""
    from parallax.analysis.collectives import collective_terms
    from parallax.analysis.cost import (Grid, Workload, hardware_flops_per_device, memory_parts, memory_platform,
                                        model_flops_per_step)

    step = compile_step(cfg, compiler_options, target)
    w, g = Workload.of(cfg), Grid.of(cfg, step.mesh_shape)
    platform = "cpu" if step.platform == "cpu" else "accelerator"
    found = collectives(step.hlo, step.mesh_shape)
    placed = placements(step.hlo)
    # The attention the compiled program runs (its custom calls), which the cost model then counts:
    # a fused kernel keeps no [B, N, T, T] scores and skips the causal half (and, under remat none,
    # keeps a table schedule's B recomputing: parallelism.keeps_residuals).
    kernels = attention_kernels(step.hlo)
    attention = kernels["kernel"]  # 'xla', or the fused kernel by name ('cudnn' keeps a packed-document mask)
    from parallax.parallel.targets import all_reduce_groups

    rows = compare_collectives(found, collective_terms(w, g, platform, attention, *all_reduce_groups(target)),
                               placed, step.mesh_shape)
    families = family_totals(rows)
    modelled = {k for k, v in families.items() if v["model_bytes"] > 0}
    # XLA:GPU's memory terms where the compiler is a GPU's (cost.GPU_*); the TPU keeps the accelerator fit
    parts = {k: float(v) for k, v in memory_parts(w, g, memory_platform(step.platform), attention=attention).items()}
    n = math.prod(step.mesh_shape.values())
    hw = {k: float(v) for k, v in hardware_flops_per_device(w, g, attention=attention).items()}
    # A fused kernel's matmuls are inside its custom calls, where dot_flops cannot see them.
    hw["attention_kernel"] = 0.0 if attention == "xla" else \
        hw["total"] - float(hardware_flops_per_device(w, g, attention="none")["total"])
    dots = dot_flops(step.hlo)
    return {
        "mesh": step.mesh_shape,
        "platform": step.platform,
        "device_kind": step.device_kind,
        "target": step.target,
        "compiler": _compiler(step.platform),
        "compile_s": round(step.compile_s, 2),
        "collectives": [
            {"axes": list(r.axes), "kind": r.kind, "ops": r.ops, "executions": r.executions, "bytes": r.bytes,
             "model_executions": r.model_executions, "model_bytes": r.model_bytes, "model": list(r.model_what),
             "conditional": r.conditional, "explained": r.explained or r.family in modelled, "error": r.error,
             "sent": dict(r.sent), "overlapped_bytes": r.overlapped}
            for r in rows
        ],
        "axes": families,
        # per parallelism: bytes with compute scheduled between start and done, and the rest
        # (XLA:CPU runs every collective synchronously: all exposed there)
        "overlap": overlap_by_family(found, placed, lambda c: axis_family(c.axes, c.kind)),
        "memory": {"xla": step.memory, "model": parts,
                   "error": (parts["total"] / step.memory["peak"] - 1) if step.memory else None},
        "flops": {"model_per_step": model_flops_per_step(w), "model_per_device": model_flops_per_step(w) / n,
                  "executed_model": hw, "hlo_dots": dots, "hlo_executed": executed_dot_flops(dots, cfg, hw["head"]),
                  "xla": step.cost},
        "loops": while_loops(step.hlo),
        # the FP8 dot_general's matmuls kept FP8 by the compiler, and why the others are not
        "fp8": fp8_report(step.hlo) if cfg.fp8.enabled else None,
        "attention": {"kernel": kernels["kernel"], "configured": step.attention, "calls": kernels["calls"],
                      "name": ATTENTION_KERNEL_NAMES[kernels["kernel"]]},
    }


def _compiler(platform: str) -> str:
    """Which compiler produced the program: 'XLA:CPU (jaxlib 0.10.2)', 'XLA:TPU (libtpu 0.0.42.1)'."""
    from importlib import metadata

    package = {"cpu": "jaxlib", "tpu": "libtpu", "gpu": "jax-cuda12-plugin"}.get(platform, f"jax-{platform}-plugin")
    try:
        version = metadata.version(package)
    except metadata.PackageNotFoundError:
        version = "?"
    return f"XLA:{platform.upper()} ({package} {version})"


# ----------------------------------------------------------------------------------------------
# Command line


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_report(a: dict, title: str) -> str:
    lines = [title, "collectives per step, per device     sent as   compiled (ops / runs / bytes)     cost model (runs / "
                    "bytes)   diff   overlapped"]
    for r in a["collectives"]:
        axes = "+".join(r["axes"]) or "(none)"
        err = f"{r['error'] * 100:+.1f}%" if r["error"] is not None else "-"
        flag = "" if r["explained"] else "   UNEXPLAINED by the cost model"
        cond = " (conditional: runs counted on every trip)" if r["conditional"] else ""
        hidden = f"{r['overlapped_bytes'] / r['bytes']:.0%}" if r["bytes"] else "-"
        dtype = next(iter(r["sent"]), "-")  # the type carrying most of the bytes; the rest below
        lines.append(f"  {axes:<17} {r['kind']:<19} {dtype:<7} {r['ops']:>4} {r['executions']:>6} "
                     f"{_mib(r['bytes']):>14}   {r['model_executions']:>7.0f} {_mib(r['model_bytes']):>14}  {err:>7}"
                     f"   {hidden:>4}{flag}{cond}")
        if len(r["sent"]) > 1:
            lines.append("      sent as " + ", ".join(f"{t} {_mib(b)}" for t, b in r["sent"].items()))
        if r["model"]:
            lines.append(f"      model: {'; '.join(r['model'])}")
        elif r["bytes"] <= SCALAR_BYTES:
            lines.append("      loss, norm and MoE routing-statistics scalars (not modelled)")
        elif not r["axes"]:
            lines.append("      groups of one device: a no-op the compiler kept (nothing crosses a link)")
        elif r["explained"]:
            lines.append("      part of a reduction XLA split over another group (counted in the axis total below)")
    if not a["collectives"]:
        lines.append("  none (single device)")
    lines.append("per parallelism (all kinds and groups that serve it; data: gradient reductions and ZeRO gathers "
                 "over data and/or expert; expert: the MoE all-to-alls):")
    for axis, f in a["axes"].items():
        err = f"{f['error'] * 100:+.1f}%" if f["error"] is not None else "-"
        links = f"{f['links_error'] * 100:+.1f}%" if f["links_error"] is not None else "-"
        lines.append(f"  {axis:<8} compiled {f['executions']:>6} runs {_mib(f['bytes']):>14}   model "
                     f"{f['model_executions']:>7.0f} runs {_mib(f['model_bytes']):>14}  {err:>7};   sent over the "
                     f"links: compiled {_mib(f['links'])}, model {_mib(f['model_links'])} ({links})")
    lines.append("overlap in the compiled schedule (asynchronous, with compute scheduled between start and done; "
                 "the rest exposed):")
    for axis, o in a["overlap"].items():
        share = f"{o['overlapped_fraction']:.0%}" if o["overlapped_fraction"] is not None else "-"
        lines.append(f"  {axis:<8} overlapped {_mib(o['overlapped']):>14}   exposed {_mib(o['exposed']):>14}   ({share} of "
                     f"the bytes; {o['overlapped_ops']} of {o['ops']} collectives, {o['async_ops']} asynchronous)")
    mem = a["memory"]
    parts = ", ".join(f"{k} {_mib(v)}" for k, v in mem["model"].items() if k not in ("total", "host") and v)
    if mem["model"].get("host"):  # remat=save_attn_mlp_offload: pinned host memory, not in the total
        parts += f"; in host memory {_mib(mem['model']['host'])}"
    if mem["xla"]:
        x = mem["xla"]
        host = f", host temporaries {_mib(x['host_temp'])}" if x.get("host_temp") else ""
        lines.append(f"memory per device: XLA {_mib(x['peak'])} (arguments {_mib(x['argument'])}, temporaries "
                     f"{_mib(x['temp'])}, outputs not aliased {_mib(x['output'] - x['alias'])}{host}); cost model "
                     f"{_mib(mem['model']['total'])} ({mem['error'] * 100:+.1f}%): {parts}")
    else:
        lines.append(f"memory per device: the backend gives no memory analysis; cost model {_mib(mem['model']['total'])}: {parts}")
    f = a["flops"]
    xla = f["xla"] or {}
    dots = f["hlo_dots"]
    cond = f" ({dots['conditional'] / 1e9:,.2f} of it in conditional branches, counted on every trip)" if dots["conditional"] else ""
    lines.append(f"FLOPs per step: model {f['model_per_step'] / 1e9:,.2f} G (6N + causal attention), "
                 f"{f['model_per_device'] / 1e9:,.2f} G per device; executed per device: cost model "
                 f"{f['executed_model']['total'] / 1e9:,.2f} G (recomputation, bubble ticks, embedding, "
                 f"{'full [T, T] scores' if not f['executed_model'].get('attention_kernel') else 'the kernel: causal half'}"
                 f"), compiled matmuls {dots['total'] / 1e9:,.2f} G{cond}; XLA cost_analysis "
                 + (f"{xla['flops'] / 1e9:,.2f} G (counts each loop body once)" if "flops" in xla else "gives none"))
    if dots.get("convolution"):
        lines.append(f"  compiled matmuls include {dots['convolution'] / 1e9:,.2f} G from convolutions (the compiler's "
                     f"form of dot_general)" + (f"; {dots['uncounted_convolutions']} convolution(s) not read"
                                                if dots.get("uncounted_convolutions") else ""))
    if a.get("fp8"):
        e = a["fp8"]
        why = "; ".join(f"{n} {reason}" for reason, n in e["not_fp8"].items()) or "none"
        lines.append(f"FP8 GEMMs per step (matmul executions, each layer's own): {e['fp8_gemms']} of the "
                     f"{e['fp8_dot_general']} matmuls through the FP8 dot_general run on FP8 operands (forward "
                     f"{e['fp8_gemms_forward']} of {e['fp8_dot_general_forward']}, backward {e['fp8_gemms_backward']} "
                     f"of {e['fp8_dot_general_backward']}: {', '.join(e['operand_types']) or '-'}); not FP8: {why}")
    loops = a.get("loops", [])
    if any(lp["source"] != "known_trip_count" for lp in loops):
        derived = [lp for lp in loops if lp["source"] == "condition"]
        unknown = [lp for lp in loops if lp["source"] == "unknown"]
        lines.append(f"while loops: {len(loops)}, {len(loops) - len(derived) - len(unknown)} with the compiler's "
                     f"known_trip_count, {len(derived)} read from the loop condition "
                     f"({', '.join(str(lp['trip_count']) for lp in derived) or '-'} trips)"
                     + (f", {len(unknown)} UNKNOWN (their collectives and FLOPs counted once per entry)"
                        if unknown else ""))
    att = a.get("attention")
    if att:
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(att["calls"].items()))
        lines.append(f"attention: {att['name']}" + (f": {calls}" if calls else "")
                     + (f" (the layout asked for {att['configured']})" if att["configured"] != att["kernel"] else ""))
        if att["kernel"] != "xla":
            lines.append(f"  the kernel's matmuls ({f['executed_model']['attention_kernel'] / 1e9:,.2f} G per device "
                         "in the cost model) run inside its custom calls: not in the compiled matmuls above")
    bad = [r for r in a["collectives"] if not r["explained"]]
    lines.append(f"{len(bad)} collective group(s) the cost model does not explain" if bad else
                 "every collective is explained by the cost model")
    return "\n".join(lines)


def add_audit_parser(sub) -> None:
    p = sub.add_parser("audit", help="compile the train step and compare it with the cost model")
    p.add_argument("experiment", help="an experiment file defining get_config()")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--json", action="store_true", help="print the audit as JSON")
    p.add_argument("--target", metavar="NAME",
                   help="compile for a named slice with its own compiler, no device needed (v5e-8, v6e-256, v5p-32, "
                        "v4-128, tpu7x-8, 2xv5p-128, h100-8, h200-16, b200-64; TPU needs libtpu, GPU the CUDA plugin "
                        "and ptxas: the test extra installs both)")


def audit_command(args) -> int:
    """`configure_host_devices` sizes the simulated CPU devices before JAX starts, as for train."""
    import json

    from parallax.config import apply_overrides, load_experiment
    from parallax.train.distributed import configure_host_devices

    cfg = apply_overrides(load_experiment(args.experiment), args.set)
    target = getattr(args, "target", None)
    if target is not None:
        from parallax.parallel.targets import require_compiler, target as lookup, target_mesh_shape
        from parallax.train.distributed import accelerator_platform

        t = lookup(target)  # every bad --target is refused before JAX starts
        target_mesh_shape(cfg.mesh, t)
        require_compiler(t)
        if accelerator_platform() is None:
            # Compile-only devices need no backend of their own: JAX runs on the CPU, and an
            # installed libtpu is not asked to find a TPU (it would say so on stderr).
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        line = f"parallax: compiling for {t.name} ({t.devices} compile-only {t.platform.upper()} devices, " \
               f"{t.chips} chips; nothing runs)"
    else:
        line = configure_host_devices(cfg)
    if not args.json:
        print(line, flush=True)
    a = audit(cfg, FAST_COMPILE, target)
    if args.json:
        print(json.dumps(a, default=float))
        return 0
    shape = " x ".join(f"{k}={v}" for k, v in a["mesh"].items())
    on = f"{target}: {a['device_kind']}, " if target else ""
    title = (f"parallax audit: {cfg.name} on {shape} ({on}{math.prod(a['mesh'].values())} {a['platform']} devices), "
             f"compiled by {a['compiler']} in {a['compile_s']:.1f} s (nothing initialised or run)")
    print(format_report(a, title))
    return 0
