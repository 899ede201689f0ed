"""Which collectives the compiled schedule hides behind compute, read from the scheduled HLO.

The design says where communication should hide: the data-parallel gradient reduction behind the
backward pass, the pipeline's sends behind neighbouring microbatches' compute; the tensor
all-reduces sit on the critical path. XLA:CPU schedules nothing asynchronously, so only an
accelerator compiler (a compile-only target: parallel/targets.py) can confirm or refute that.

A scheduled module (`is_scheduled=true`: every optimized module the accelerator compilers emit)
lists each computation's instructions in execution order. An asynchronous collective is a
`-start` / `-done` pair (XLA:GPU: `all-reduce-start`, `all-gather-start`, `reduce-scatter-start`,
`collective-permute-start`, `all-to-all-start`; a generic `async-start` whose called
computation holds the collective; or a decomposed collective-permute's `send` and `send-done`);
it is **overlapped** when compute is scheduled between its start and its done in the same
computation, **exposed** otherwise. A decomposed permute has two waits, the sender's `send-done`
and the receiver's `recv-done` (every stage of the ring or chain is both): it is overlapped only
when compute lies between the send and each of them, wrapping round the loop body when the
compiler pipelined the recv-done into the next iteration. A synchronous collective (the
form XLA:TPU leaves a collective in when its latency-hiding scheduler found nothing to put beside
it: `async_collective_name` in its frontend attributes names the async pair it came from) is
exposed. XLA:TPU's async collective fusions issue one collective as a chain of fusions (start,
continuations fused with compute, done; hlo.async_fusion_chains): overlapped when compute runs
from its start to its done.

Compute is what keeps an accelerator's math units busy: a dot or convolution (the TPU compiler's
form of every matmul), a GEMM or fused-attention custom call (cuBLAS, cuDNN), a Pallas/Mosaic
kernel (`tpu_custom_call`), or any fusion, loop, call or conditional whose called computations
hold one of those. Elementwise fusions, copies and bitcasts do not count: they overlap nothing
worth hiding a collective behind.

What this cannot see: how long the compute between start and done runs against the transfer
(the schedule is real, the kernels' speed is not without a device), so "overlapped" means "has
compute to hide behind", not "fully hidden".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parallax.analysis.hlo import SEND, KINDS, Collective, async_fusion_chains, called, collective_names, computations

_ASYNC_KINDS = "|".join(KINDS)
_START = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? (?:(" + _ASYNC_KINDS + r")-start|async-start)\(")
_DONE_OF = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? (?:[a-z-]+-done|async-done)\(%([^,\s)]+)")
_OPCODE = re.compile(r"^\s*(?:ROOT )?%\S+ = (?:\(.*?\)|\S+) ([a-z][\w\-]*)\(")
_KERNEL_TARGET = re.compile(r'custom_call_target="([^"]*(?:gemm|matmul|cublas|cudnn|fmha|tpu_custom_call|'
                            r'mosaic)[^"]*)"', re.IGNORECASE)


@dataclass(frozen=True)
class Placement:
    """One collective in the schedule: asynchronous or not, and what runs between its start and done."""

    asynchronous: bool
    overlapped: bool  # compute scheduled between start and done
    between: int  # instructions scheduled between start and done


def _callees(line: str) -> list[str]:
    return [callee for _, callee in called(line)]


def _is_kernel(line: str) -> bool:
    """Compute by itself: a dot, a convolution, or a GEMM / attention / Pallas custom call."""
    op = _OPCODE.match(line)
    if op is None:
        return False
    if op.group(1) in ("dot", "convolution"):
        return True
    return op.group(1) == "custom-call" and _KERNEL_TARGET.search(line) is not None


def _is_fusion(line: str) -> bool:
    op = _OPCODE.match(line)
    return op is not None and op.group(1) == "fusion"


def _computing(comps: dict[str, list[str]]) -> set[str]:
    """The computations that hold compute, directly or through the computations they call."""
    direct = {name for name, lines in comps.items() if any(_is_kernel(line) for line in lines)}
    calls = {name: {c for line in lines for c in _callees(line)} for name, lines in comps.items()}
    found, changed = set(direct), True
    while changed:
        changed = False
        for name, callees in calls.items():
            if name not in found and callees & found:
                found.add(name)
                changed = True
    return found


def placements(hlo: str) -> dict[tuple[str, str], Placement]:
    """{(computation, collective's start or op name): Placement} for every collective in the
    module (hlo.collectives names a collective by its start, or by its op when synchronous)."""
    comps = computations(hlo)
    computing = _computing(comps)
    # computations that run as one fused kernel (a fusion's, and nothing else's, callee)
    fused = {c for lines in comps.values() for line in lines if _is_fusion(line) for c in _callees(line)}
    fused -= {c for lines in comps.values() for line in lines if not _is_fusion(line) for c in _callees(line)}
    out: dict[tuple[str, str], Placement] = {}
    for comp, lines in comps.items():
        open_at: dict[str, tuple[int, list[str]]] = {}
        # a decomposed permute's receiving end: {its recv: where its recv-done is}
        recv_done = {d.group(1): i for i, line in enumerate(lines) if " recv-done(" in line
                     and (d := _DONE_OF.match(line))}
        for i, line in enumerate(lines):
            start = _START.match(line)
            if start and start.group(2):
                open_at[start.group(1)] = (i, [])
                continue
            if send := SEND.match(line):  # a decomposed permute's send: open until its send-done
                open_at[send.group(1)] = (i, [])
                continue
            if start and (wrapped := [c for c in _callees(line) if collective_names(comps.get(c, []))]):
                open_at[start.group(1)] = (i, wrapped)
                continue
            done = _DONE_OF.match(line)
            if done and done.group(1) in open_at:
                at, wrapped = open_at.pop(done.group(1))
                between = lines[at + 1:i]
                busy = any(_is_kernel(x) or set(_callees(x)) & computing for x in between)
                received = recv_done.get(done.group(1).removesuffix("-send") + "-recv")
                if received is not None:  # ... and compute before the receiver waits
                    wait = lines[at + 1:received] if received > at else lines[at + 1:] + lines[:received]
                    busy = busy and any(_is_kernel(x) or set(_callees(x)) & computing for x in wait)
                placed = Placement(True, busy, len(between))
                out[(comp, done.group(1))] = placed
                # a generic async-start: hlo.collectives names the collective inside its computation
                out.update({(c, name): placed for c in wrapped for name in collective_names(comps[c])})
    out.update(_chain_placements(comps, computing))
    for comp, lines in comps.items():
        # XLA:TPU's async collective fusion: the collective (a later layer's weight gather, say)
        # and the compute it runs beside in one fusion; the DMA engines move the bytes while the
        # matrix units compute
        inside = collective_names(lines)
        if inside and comp in computing and comp in fused:
            out.update({(comp, name): Placement(True, True, len(lines)) for name in inside
                        if (comp, name) not in out})
    return out


def _chain_placements(comps: dict[str, list[str]], computing: set[str]) -> dict[tuple[str, str], Placement]:
    """A chain of XLA:TPU's async collective fusions (hlo.async_fusion_chains: a start fusion,
    continuations, a done fusion, called in that order from one computation) is one collective,
    overlapped when compute is scheduled from its start to its done: a continuation fused with a
    convolution, or any computing instruction between."""
    callers = {c: (comp, i) for comp, lines in comps.items() for i, line in enumerate(lines)
               if _is_fusion(line) for c in _callees(line)}
    out = {}
    for members in async_fusion_chains(comps).values():
        calls = [callers.get(comp) for comp, _ in members]
        if None in calls or len({caller for caller, _ in calls}) != 1:
            continue  # not one computation's schedule: left to the per-fusion rule
        lines = comps[calls[0][0]]
        first, last = min(i for _, i in calls), max(i for _, i in calls)
        span = lines[first:last + 1]
        busy = any(_is_kernel(x) or set(_callees(x)) & computing for x in span)
        out.update({member: Placement(True, busy, last - first - 1) for member in members})
    return out


def placement_of(c: Collective, table: dict[tuple[str, str], Placement]) -> Placement:
    """A collective's placement; one not in the table runs synchronously (exposed)."""
    return table.get((c.computation, c.name), Placement(False, False, 0))


def overlap_by_family(found: list[Collective], table: dict[tuple[str, str], Placement],
                      family) -> dict[str, dict[str, float]]:
    """Per parallelism (`family(collective)` names it): bytes per step per device overlapped and
    exposed, how many collectives are asynchronous and how many of those have compute between."""
    out: dict[str, dict[str, float]] = {}
    for c in found:
        name = family(c)
        if name == "none":
            continue
        p = placement_of(c, table)
        f = out.setdefault(name, {"bytes": 0, "overlapped": 0, "exposed": 0, "ops": 0, "async_ops": 0,
                                  "overlapped_ops": 0})
        f["bytes"] += c.bytes_per_step
        f["overlapped" if p.overlapped else "exposed"] += c.bytes_per_step
        f["ops"] += 1
        f["async_ops"] += p.asynchronous
        f["overlapped_ops"] += p.overlapped
    for f in out.values():
        f["overlapped_fraction"] = f["overlapped"] / f["bytes"] if f["bytes"] else None
    return out
