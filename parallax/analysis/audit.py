"""Read the compiled HLO: which collectives run, over which mesh axes, how often, how many bytes.

The design promises specific collectives (two tensor all-reduces per block forward, the gradient
reduction over data, weight all-gathers only under ZeRO-3). This module parses the optimized HLO
text of a compiled step so tests and `parallax audit` can hold the compiler to that promise.

Replica groups are mapped back to mesh axes: XLA numbers devices by their position in the
flattened mesh (`use_global_device_ids`), so a group is the set of flat indices along some axes.
Loop bodies run once per trip: a collective inside the scanned layer stack is counted
`known_trip_count` times per step. The MoE all-to-alls over `expert` form their own family beside
data, tensor and pipe (expert_parallel.py; cost.py models them).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import numpy as np

from parallax.config import Config

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}
_COMP_HEADER = re.compile(r"^(ENTRY )?%(\S+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_WHILE = re.compile(r"\bwhile\(.*?body=%([^,\s]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"(calls|to_apply|body|condition|branch_computations|called_computations)=(\{[^}]*\}|%[^,\s}]+)")


@dataclass(frozen=True)
class Collective:
    kind: str
    name: str
    computation: str
    axes: tuple[str, ...]  # mesh axes the group spans, in mesh order; () if unrecognised
    bytes: int  # bytes of the result buffer(s) on one device, per execution
    executions: int  # times it runs per step (product of enclosing loop trip counts)
    in_loop: bool
    op_name: str  # JAX's name for the op that produced it, e.g. ".../transpose(jvp(...))/while/..."
    conditional: bool = False  # inside a conditional branch: `executions` is an upper bound

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.executions


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _split_computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = _COMP_HEADER.match(line)
        if m and line.rstrip().endswith("{"):
            current = "ENTRY" if m.group(1) else m.group(2)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    return comps


def _executions(comps: dict[str, list[str]]) -> tuple[dict[str, int], set[str]]:
    """Times each computation runs per call of ENTRY, through while trip counts, and the set of
    computations reached through a conditional branch (their count is an upper bound: a branch
    runs only on the trips that take it)."""
    runs, branched = {"ENTRY": 1}, set()
    stack = ["ENTRY"]
    while stack:
        name = stack.pop()
        for line in comps.get(name, []):
            w = _WHILE.search(line)
            trip = _TRIP.search(line)
            for attr, targets in _CALLS.findall(line):
                for callee in re.findall(r"%([^,\s}]+)", targets):
                    if callee not in comps or callee in runs:
                        continue
                    is_body = w is not None and callee == w.group(1)
                    runs[callee] = runs[name] * (int(trip.group(1)) if (is_body and trip) else 1)
                    if attr == "branch_computations" or name in branched:
                        branched.add(callee)
                    stack.append(callee)
    return runs, branched


def _groups(line: str, n_devices: int) -> list[list[int]] | None:
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m:
        return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))?"
                  r"(?:\s*\{([^}]*)\})?", line)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        # `mesh[...] {'axis_2'}` groups along the named axes; without braces, along all of them.
        listed = re.findall(r"'(\w+)'", m.group(3)) if m.group(3) is not None else names
        grouped = [names.index(a) for a in listed]
        rest = [i for i in range(len(names)) if i not in grouped]
        # `device_ids=([4,2]T(1,0))` (an iota, maybe transposed) or `device_ids=(0,2,...)` lays the
        # mesh over a permuted device list; without it, over the devices in order. (Seen under
        # ZeRO-1 with experts: a reduction over data written as a transposed (data, expert) mesh.)
        devices = np.arange(math.prod(sizes))
        if m.group(2) and m.group(2).startswith("["):
            iota = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2))
            devices = devices.reshape([int(v) for v in iota.group(1).split(",")])
            if iota.group(2):
                devices = devices.transpose([int(v) for v in iota.group(2).split(",")])
            devices = devices.reshape(-1)
        elif m.group(2):
            devices = np.asarray([int(v) for v in m.group(2).split(",")])
        ids = devices.reshape(sizes).transpose(rest + grouped)
        return ids.reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    if re.search(r"replica_groups=\{\}", line):  # empty: one group of every device
        return [list(range(n_devices))]
    m = re.search(r"source_target_pairs=\{([\d,{}]*)\}", line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return None


def groups_to_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of each group differ (flat row-major mesh order)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[str] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # [members, axes]
        varying |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(a for a in names if a in varying)


def collectives(hlo: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective in optimized HLO text, with its mesh axes and per-step executions."""
    comps = _split_computations(hlo)
    runs, branched = _executions(comps)
    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, result, kind, start = m.groups()
            groups = _groups(line, math.prod(mesh_shape.values()))
            axes = groups_to_axes(groups, mesh_shape) if groups else ()
            nbytes = _shape_bytes(result)
            if start:  # async start returns (operands, results): count the results only
                nbytes //= 2
            op = re.search(r'op_name="([^"]*)"', line)
            found.append(Collective(
                kind, name, comp, axes, nbytes, runs.get(comp, 1), runs.get(comp, 1) > 1, op.group(1) if op else "",
                comp in branched,
            ))
    return found


_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = [a-z0-9]+\[([0-9,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%\S+ = [a-z0-9]+\[([0-9,]*)\]\S* dot\(%([^,\s)]+),.*?lhs_contracting_dims=\{([0-9,]*)\}")


def dot_flops(hlo: str) -> dict[str, float]:
    """Matmul FLOPs one device executes per step, counted from the HLO with loop trips (XLA's own
    cost analysis counts a loop body once). `conditional`: the part inside conditional branches,
    counted on every trip (an upper bound: 1F1B's busy branches run on M of its ticks)."""
    comps = _split_computations(hlo)
    runs, branched = _executions(comps)
    total = conditional = 0.0
    for comp, lines in comps.items():
        shapes = {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}
        for line in lines:
            d = _DOT.match(line)
            if not d or d.group(2) not in shapes:
                continue
            lhs = [int(v) for v in shapes[d.group(2)].split(",") if v]
            out = math.prod(int(v) for v in d.group(1).split(",") if v)
            flops = 2.0 * out * math.prod(lhs[int(i)] for i in d.group(3).split(",") if i) * runs.get(comp, 1)
            total += flops
            conditional += flops if comp in branched else 0.0
    return {"total": total, "conditional": conditional}


def summarize(found: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
    """{(kind, axes): {'ops': static count, 'executions': per step, 'bytes': per step}}."""
    out: dict[tuple[str, tuple[str, ...]], dict[str, int]] = {}
    for c in found:
        row = out.setdefault((c.kind, c.axes), {"ops": 0, "executions": 0, "bytes": 0})
        row["ops"] += 1
        row["executions"] += c.executions
        row["bytes"] += c.bytes_per_step
    return out


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

    from parallax.train.build import build

    devices = None
    if target is not None:
        from parallax.parallel.targets import target as lookup, target_devices, target_mesh_shape

        t = lookup(target)
        target_mesh_shape(cfg.mesh, t)  # the mesh against the target's count, naming the target
        devices = target_devices(t)
        compiler_options = target_options(compiler_options, t.platform)
    built = build(cfg, devices)
    started = time.perf_counter()
    lowered = built.train_step().lower(built.abstract_state(), built.abstract_batch())
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    step = CompiledStep(compiled.as_text(), _memory_stats(compiled), _cost_stats(compiled), dict(built.mesh.shape),
                        built.platform, time.perf_counter() - started, built.device_kind, target)
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
    if kind == "all-to-all" and "expert" in axes:
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
        f = out.setdefault(r.family, {"bytes": 0, "model_bytes": 0.0, "executions": 0, "model_executions": 0.0})
        f["bytes"] += r.bytes
        f["model_bytes"] += r.model_bytes
        f["executions"] += r.executions
        f["model_executions"] += r.model_executions
    for f in out.values():
        f["error"] = f["model_bytes"] / f["bytes"] - 1 if f["bytes"] and f["model_bytes"] else None
    return out


def compare_collectives(found: list[Collective], terms: list) -> list[Row]:
    """Group compiled collectives and model terms by (mesh axes, kind) and set them side by side.

    The model's static executions (conditional branches on every trip) are what the HLO counts.
    """
    compiled = summarize(found)
    cond = {(c.kind, c.axes) for c in found if c.conditional}
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
        rows.append(Row(key[1], key[0], c["ops"], c["executions"], c["bytes"], m[0], m[1], tuple(m[2]), key in cond))
    return rows


def audit(cfg: Config, compiler_options: dict | None = None, target: str | None = None) -> dict:
    """The whole audit as plain data (what `--json` prints). `target`: compile for a named
    compile-only target ('v5e-8': parallel/targets.py) with its own compiler, no device needed."""
    from parallax.analysis.collectives import collective_terms
    from parallax.analysis.cost import Grid, Workload, hardware_flops_per_device, memory_parts, model_flops_per_step

    step = compile_step(cfg, compiler_options, target)
    w, g = Workload.of(cfg), Grid.of(cfg, step.mesh_shape)
    platform = "cpu" if step.platform == "cpu" else "accelerator"
    rows = compare_collectives(collectives(step.hlo, step.mesh_shape), collective_terms(w, g, platform))
    families = family_totals(rows)
    modelled = {k for k, v in families.items() if v["model_bytes"] > 0}
    parts = {k: float(v) for k, v in memory_parts(w, g, platform, attention="xla").items()}
    n = math.prod(step.mesh_shape.values())
    hw = {k: float(v) for k, v in hardware_flops_per_device(w, g, attention="xla").items()}
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
             "conditional": r.conditional, "explained": r.explained or r.family in modelled, "error": r.error}
            for r in rows
        ],
        "axes": families,
        "memory": {"xla": step.memory, "model": parts,
                   "error": (parts["total"] / step.memory["peak"] - 1) if step.memory else None},
        "flops": {"model_per_step": model_flops_per_step(w), "model_per_device": model_flops_per_step(w) / n,
                  "executed_model": hw, "hlo_dots": dot_flops(step.hlo), "xla": step.cost},
    }


def _compiler(platform: str) -> str:
    """Which compiler produced the program: 'XLA:CPU (jaxlib 0.10.2)', 'XLA:TPU (libtpu 0.0.42.1)'."""
    from importlib import metadata

    package = {"cpu": "jaxlib", "tpu": "libtpu"}.get(platform, f"jax-{platform}-plugin")
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
    lines = [title, "collectives per step, per device     compiled (ops / runs / bytes)     cost model (runs / bytes)   diff"]
    for r in a["collectives"]:
        axes = "+".join(r["axes"]) or "(none)"
        err = f"{r['error'] * 100:+.1f}%" if r["error"] is not None else "-"
        flag = "" if r["explained"] else "   UNEXPLAINED by the cost model"
        cond = " (conditional: runs counted on every trip)" if r["conditional"] else ""
        lines.append(f"  {axes:<17} {r['kind']:<19} {r['ops']:>4} {r['executions']:>6} {_mib(r['bytes']):>14}"
                     f"   {r['model_executions']:>7.0f} {_mib(r['model_bytes']):>14}  {err:>7}{flag}{cond}")
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
        lines.append(f"  {axis:<8} compiled {f['executions']:>6} runs {_mib(f['bytes']):>14}   model "
                     f"{f['model_executions']:>7.0f} runs {_mib(f['model_bytes']):>14}  {err:>7}")
    mem = a["memory"]
    parts = ", ".join(f"{k} {_mib(v)}" for k, v in mem["model"].items() if k != "total" and v)
    if mem["xla"]:
        x = mem["xla"]
        lines.append(f"memory per device: XLA {_mib(x['peak'])} (arguments {_mib(x['argument'])}, temporaries "
                     f"{_mib(x['temp'])}, outputs not aliased {_mib(x['output'] - x['alias'])}); cost model "
                     f"{_mib(mem['model']['total'])} ({mem['error'] * 100:+.1f}%): {parts}")
    else:
        lines.append(f"memory per device: the backend gives no memory analysis; cost model {_mib(mem['model']['total'])}: {parts}")
    f = a["flops"]
    xla = f["xla"] or {}
    dots = f["hlo_dots"]
    cond = f" ({dots['conditional'] / 1e9:,.2f} of it in conditional branches, counted on every trip)" if dots["conditional"] else ""
    lines.append(f"FLOPs per step: model {f['model_per_step'] / 1e9:,.2f} G (6N + causal attention), "
                 f"{f['model_per_device'] / 1e9:,.2f} G per device; executed per device: cost model "
                 f"{f['executed_model']['total'] / 1e9:,.2f} G (recomputation, bubble ticks, embedding, full [T, T] "
                 f"scores), compiled matmuls {dots['total'] / 1e9:,.2f} G{cond}; XLA cost_analysis "
                 + (f"{xla['flops'] / 1e9:,.2f} G (counts each loop body once)" if "flops" in xla else "gives none"))
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
                        "v4-128, tpu7x-8, 2xv5p-128; TPU needs libtpu)")


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
