"""Read the compiled HLO: which collectives run, over which mesh axes, how often, how many bytes.

The design promises specific collectives (two tensor all-reduces per block forward, the gradient
reduction over data, weight all-gathers only under ZeRO-3). This module parses the optimized HLO
text of a compiled step so tests and `parallax audit` can hold the compiler to that promise.

Replica groups are mapped back to mesh axes: XLA numbers devices by their position in the
flattened mesh (`use_global_device_ids`), so a group is the set of flat indices along some axes.
Loop bodies run once per trip: a collective inside the scanned layer stack is counted
`known_trip_count` times per step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

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
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([^,\s}]+)")


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


def _executions(comps: dict[str, list[str]]) -> dict[str, int]:
    """Times each computation runs per call of ENTRY, through while trip counts."""
    runs = {"ENTRY": 1}
    stack = ["ENTRY"]
    while stack:
        name = stack.pop()
        for line in comps.get(name, []):
            w = _WHILE.search(line)
            trip = _TRIP.search(line)
            for callee in _CALLS.findall(line):
                if callee not in comps or callee in runs:
                    continue
                is_body = w is not None and callee == w.group(1)
                runs[callee] = runs[name] * (int(trip.group(1)) if (is_body and trip) else 1)
                stack.append(callee)
    return runs


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
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:\s*\{([^}]*)\})?", line)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        # `mesh[...] {'axis_2'}` groups along the named axes; without braces, along all of them.
        listed = re.findall(r"'(\w+)'", m.group(2)) if m.group(2) is not None else names
        grouped = [names.index(a) for a in listed]
        rest = [i for i in range(len(names)) if i not in grouped]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + grouped)
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
    runs = _executions(comps)
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
                kind, name, comp, axes, nbytes, runs.get(comp, 1), runs.get(comp, 1) > 1, op.group(1) if op else ""
            ))
    return found


def summarize(found: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
    """{(kind, axes): {'ops': static count, 'executions': per step, 'bytes': per step}}."""
    out: dict[tuple[str, tuple[str, ...]], dict[str, int]] = {}
    for c in found:
        row = out.setdefault((c.kind, c.axes), {"ops": 0, "executions": 0, "bytes": 0})
        row["ops"] += 1
        row["executions"] += c.executions
        row["bytes"] += c.bytes_per_step
    return out
