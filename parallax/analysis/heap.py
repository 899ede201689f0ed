"""What a compiled program holds at its memory peak: XLA's heap-simulator trace, replayed.

`memory_analysis()` gives one number (the temporary allocation); the cost model splits its
prediction into parts (cost.memory_parts). To hold one to the other part by part, this module
reads the buffer assignment XLA writes with `xla_dump_hlo_as_proto` (an HloProto: the optimized
module, and its BufferAssignmentProto with the heap simulator's alloc/free/share events in
schedule order, nested computations included), replays the events and lists the buffers live
at the largest total, each with the JAX op_name of the instruction that defines it.

jaxlib ships no Python bindings for XLA's protos, so the protobuf wire format is decoded here;
only the few fields below are read (field numbers from xla/service/hlo.proto):
HloProto{hlo_module=1, buffer_assignment=3}; HloModuleProto{computations=3};
HloComputationProto{name=1, instructions=2}; HloInstructionProto{name=1, metadata=7, id=35};
OpMetadata{op_name=2}; BufferAssignmentProto{logical_buffers=1, heap_simulator_traces=4};
LogicalBufferProto{id=1, size=2, defined_at=3 (Location{instruction_id=4})};
HeapSimulatorTrace{events=1}; Event{kind=1 (ALLOC 0, FREE 1, SHARE_WITH 2), buffer_id=2,
computation_name=3, instruction_name=4, share_with_canonical_id=5}.

Measured (BUILD_NOTES.md, "What the compiled peak holds"): on XLA:GPU the replayed peak is the
temporary allocation of `memory_analysis()` within 5% (the rest is the allocator's packing);
on XLA:TPU `memory_analysis()` reports 0.9-2.0 GiB more temporaries than the dumped buffer
assignment's whole temporary allocation (the trace plus packing; the module after codegen has the
same instructions), so the trace explains its composition, not its total.
"""

from __future__ import annotations

import glob
import os
from collections import defaultdict
from dataclasses import dataclass

# The compiler options that make XLA write the proto this module reads (one module, no pass dumps).
DUMP_OPTIONS = {"xla_dump_hlo_as_proto": True, "xla_dump_hlo_module_re": "jit_step", "xla_dump_hlo_pass_re": "^$"}


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        x = b[i]
        i += 1
        value |= (x & 0x7F) << shift
        shift += 7
        if x < 0x80:
            return value, i


def _fields(b: bytes) -> list[tuple[int, int | bytes]]:
    """One message's (field number, value) pairs: varints as ints, everything else as bytes."""
    i, out = 0, []
    while i < len(b):
        key, i = _varint(b, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            value, i = b[i:i + n], i + n
        elif wire in (1, 5):  # fixed64 / fixed32
            n = 8 if wire == 1 else 4
            value, i = b[i:i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} is not decoded here")
        out.append((number, value))
    return out


def _first(fs: list, number: int, default=None):
    return next((v for n, v in fs if n == number), default)


@dataclass(frozen=True)
class LiveBuffer:
    instruction: str  # the defining HLO instruction
    op_name: str  # its JAX op_name metadata ('' for compiler-made instructions)
    bytes: int


@dataclass(frozen=True)
class HeapPeak:
    bytes: int  # the largest total the trace reaches
    instruction: str  # the event at which it is reached
    computation: str
    buffers: tuple[LiveBuffer, ...]  # live there, largest first (one per defining instruction)

    def by(self, source) -> dict[str, int]:
        """Bytes live at the peak grouped by `source(LiveBuffer) -> str` (a label)."""
        out: dict[str, int] = defaultdict(int)
        for b in self.buffers:
            out[source(b)] += b.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _instructions(module: bytes) -> dict[int, tuple[str, str]]:
    """Instruction id -> (name, op_name) over every computation of an HloModuleProto."""
    out = {}
    for number, comp in _fields(module):
        if number != 3:
            continue
        for n, ins in _fields(comp):
            if n != 2:
                continue
            fs = _fields(ins)
            metadata = _fields(_first(fs, 7, b""))
            out[_first(fs, 35)] = (_first(fs, 1, b"").decode(), _first(metadata, 2, b"").decode())
    return out


def peak(hlo_proto: bytes) -> HeapPeak:
    """Replay the largest heap-simulator trace of a dumped HloProto (`*after_optimizations.hlo.pb`)."""
    top = _fields(hlo_proto)
    names = _instructions(_first(top, 1, b""))
    assignment = _fields(_first(top, 3, b""))
    if not assignment:
        raise ValueError("the HloProto holds no buffer assignment (dumped before optimizations?)")
    size, defined = {}, {}
    for number, value in assignment:
        if number == 1:
            fs = _fields(value)
            bid = _first(fs, 1, 0)
            size[bid] = _first(fs, 2, 0)
            defined[bid] = names.get(_first(_fields(_first(fs, 3, b"")), 4), ("?", ""))
    best, at, held = 0, {}, {}  # the largest total, its event, the bytes live there per canonical buffer
    for number, trace in assignment:
        if number != 4:
            continue
        live: dict[int, int] = {}  # canonical buffer -> bytes
        canonical: dict[int, int] = {}
        users: dict[int, int] = {}  # canonical buffer -> buffers sharing it
        total = 0
        for n, event in _fields(trace):
            if n != 1:
                continue
            e = _fields(event)
            kind, bid = _first(e, 1, 0), _first(e, 2, 0)
            if kind == 0:  # ALLOC
                canonical[bid], users[bid], live[bid] = bid, 1, size.get(bid, 0)
                total += live[bid]
            elif kind == 2:  # SHARE_WITH: the same memory as the canonical buffer, no new bytes
                c = canonical.get(_first(e, 5, 0), _first(e, 5, 0))
                canonical[bid] = c
                users[c] = users.get(c, 0) + 1
            elif kind == 1:  # FREE: the memory returns when its last sharer is freed
                c = canonical.pop(bid, bid)
                users[c] = users.get(c, 1) - 1
                if users[c] <= 0:
                    total -= live.pop(c, 0)
                    users.pop(c, None)
            if total > best:
                best, at, held = total, e, dict(live)
    per_instruction: dict[tuple[str, str], int] = defaultdict(int)
    for c, nbytes in held.items():
        per_instruction[defined.get(c, ("?", ""))] += nbytes
    buffers = tuple(sorted((LiveBuffer(i, o, b) for (i, o), b in per_instruction.items() if b), key=lambda x: -x.bytes))
    return HeapPeak(best, _first(at, 4, b"").decode(), _first(at, 3, b"").decode(), buffers)


def dumped_peak(directory: str) -> HeapPeak:
    """The peak of the train step dumped into `directory` with DUMP_OPTIONS."""
    found = sorted(glob.glob(os.path.join(directory, "*jit_step*after_optimizations.hlo.pb")))
    if not found:
        raise FileNotFoundError(f"{directory}: no optimized jit_step HloProto (compile with heap.DUMP_OPTIONS)")
    with open(found[-1], "rb") as f:
        return peak(f.read())
