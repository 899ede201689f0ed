"""Read a compiled step's HLO text: which collectives run, over which mesh axes, how often, how many bytes.

The design promises specific collectives (two tensor all-reduces per block forward, the gradient
reduction over data, weight all-gathers only under ZeRO-3). This module parses the optimized HLO
text of a compiled step so tests and `parallax audit` can hold the compiler to that promise.

Replica groups are mapped back to mesh axes: XLA numbers devices by their position in the
flattened mesh (`use_global_device_ids`), so a group is the set of flat indices along some axes.
Loop bodies run once per trip: a collective inside the scanned layer stack is counted
`known_trip_count` times per step, or, where the compiler gives none (the TPU compiler), the trip
count read from the loop's condition (_derived_trip_count); a loop of neither form is reported
with an unknown count; a conditional's branches (`branch_computations`, or `true_computation` and
`false_computation` on a pred: XLA:GPU's 1F1B ticks) once per trip of their loop. XLA:TPU's chains
of async collective fusions (async_fusion_chains) are one collective each. Matmul FLOPs are read
from dots and, as the TPU compiler writes every dot_general, from convolutions (conv_macs). The
MoE all-to-alls over `expert` form their own family beside data, tensor and pipe
(expert_parallel.py; cost.py models them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

# (a ragged all-to-all's bytes are its output buffer: sized for the most tokens that can arrive,
# an upper bound on what the step sends)
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}
_COMP_HEADER = re.compile(r"^(ENTRY )?%(\S+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_WHILE = re.compile(r"\bwhile\(.*?body=%([^,\s]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# (a conditional on a pred writes its two branches as true_computation / false_computation:
# XLA:GPU's 1F1B ticks)
_CALLS = re.compile(r"(calls|to_apply|body|condition|branch_computations|true_computation|false_computation|"
                    r"called_computations)=(\{[^}]*\}|%[^,\s}]+)")
_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def called(line: str) -> list[tuple[str, str]]:
    """(attribute, computation) for every computation one HLO instruction line calls: fusions,
    reductions, loop bodies and conditions, conditional branches, async wrappers."""
    return [(attr, callee) for attr, targets in _CALLS.findall(line) for callee in re.findall(r"%([^,\s}]+)", targets)]


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
    sent: tuple[tuple[str, int], ...] = ()  # (element type, bytes per execution) of the result buffers

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.executions


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _bytes_by_dtype(text: str) -> tuple[tuple[str, int], ...]:
    """((element type, bytes), ...) of the arrays in a shape, by type."""
    out: dict[str, int] = {}
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            out[dtype] = out.get(dtype, 0) + _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return tuple(sorted(out.items()))


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


_DEFINED = re.compile(r"^\s*(ROOT )?%(\S+) = (?:\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_CONSTANT = re.compile(r"^(-?\d+)\)")


def _instructions(lines: list[str]) -> tuple[dict[str, tuple[str, str]], str | None]:
    """{name: (opcode, text after the opening parenthesis)} of one computation, and its ROOT."""
    out, root = {}, None
    for line in lines:
        m = _DEFINED.match(line)
        if m:
            out[m.group(2)] = (m.group(3), m.group(4))
            root = m.group(2) if m.group(1) else root
    return out, root


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([^,\s)]+)", re.sub(r"/\*[^*]*\*/", "", rest).split(")", 1)[0])


def _through(instrs: dict, name: str) -> str:
    """`name` past any copies, bitcasts and converts of one operand."""
    for _ in range(8):
        op, rest = instrs.get(name, ("", ""))
        if op not in ("copy", "bitcast", "convert") or len(_operands(rest)) != 1:
            break
        name = _operands(rest)[0]
    return name


def _int_constant(instrs: dict, name: str) -> int | None:
    """The value of a scalar integer constant, through copies, bitcasts and converts."""
    op, rest = instrs.get(_through(instrs, name), ("", ""))
    m = _CONSTANT.match(rest) if op == "constant" else None
    return int(m.group(1)) if m else None


def _tuple_index(instrs: dict, name: str) -> int | None:
    """K where `name` is get-tuple-element(parameter(0)), index=K (through copies)."""
    op, rest = instrs.get(_through(instrs, name), ("", ""))
    m = re.search(r"index=(\d+)", rest)
    src = _operands(rest)
    if op != "get-tuple-element" or not m or len(src) != 1 or instrs.get(src[0], ("",))[0] != "parameter":
        return None
    return int(m.group(1))


def _as_op(comps: dict[str, list[str]], instrs: dict, name: str) -> tuple[str, list[str], str]:
    """(opcode, operands, attributes) of `name`; a fusion that wraps one op of its parameters
    (XLA:CPU's `wrapped_compare`, `wrapped_add`) reads as that op on the fusion's operands."""
    op, rest = instrs.get(name, ("", ""))
    callee = re.search(r"calls=%([^,\s]+)", rest)
    if op == "fusion" and callee and callee.group(1) in comps:
        inner, root = _instructions(comps[callee.group(1)])
        outer = _operands(rest)
        if root is not None:
            params = []
            for arg in _operands(inner[root][1]):
                p_op, p_rest = inner.get(arg, ("", ""))
                index = _CONSTANT.match(p_rest) if p_op == "parameter" else None
                params.append(outer[int(index.group(1))] if index and int(index.group(1)) < len(outer) else None)
            if params and None not in params:
                return inner[root][0], params, inner[root][1]
    return op, _operands(rest), rest


def _derived_trip_count(comps: dict[str, list[str]], caller: dict, line: str) -> int | None:
    """A while loop's trip count read from its condition when the compiler gives no
    `known_trip_count` (the TPU compiler gives none): the condition compares the induction
    variable (get-tuple-element K of the loop tuple) against a constant (LT, LE, GT, GE), the
    loop tuple's element K starts at a constant and the body adds (or subtracts) a constant to it.
    None where the loop does not have that form: its count is then unknown, not guessed."""
    cond = re.search(r"condition=%([^,\s]+)", line)
    body = re.search(r"body=%([^,\s]+)", line)
    init = re.search(r"\bwhile\(%([^,\s)]+)\)", line)
    if not (cond and body and init) or cond.group(1) not in comps or body.group(1) not in comps:
        return None
    c, c_root = _instructions(comps[cond.group(1)])
    if c_root is None:
        return None
    op, args, attrs = _as_op(comps, c, c_root)
    direction = re.search(r"direction=([A-Z]+)", attrs)
    if op != "compare":
        return None
    if not direction or len(args) != 2:
        return None
    flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}
    d = direction.group(1)
    k, bound = _tuple_index(c, args[0]), _int_constant(c, args[1])
    if k is None:  # constant on the left: `bound > i` is `i < bound`
        k, bound, d = _tuple_index(c, args[1]), _int_constant(c, args[0]), flip.get(d, d)
    if k is None or bound is None or d not in flip:
        return None
    if caller.get(init.group(1), ("",))[0] != "tuple":
        return None
    elements = _operands(caller[init.group(1)][1])
    if k >= len(elements) or (start := _int_constant(caller, elements[k])) is None:
        return None
    b, b_root = _instructions(comps[body.group(1)])
    if b_root is None or b[b_root][0] != "tuple" or k >= len(updates := _operands(b[b_root][1])):
        return None
    op, terms, _ = _as_op(comps, b, _through(b, updates[k]))
    if op not in ("add", "subtract") or len(terms) != 2:
        return None
    if _tuple_index(b, terms[0]) == k and (step := _int_constant(b, terms[1])) is not None:
        step = -step if op == "subtract" else step
    elif op == "add" and _tuple_index(b, terms[1]) == k and (step := _int_constant(b, terms[0])) is not None:
        pass
    else:
        return None
    span = {"LT": bound - start, "LE": bound - start + 1, "GT": start - bound, "GE": start - bound + 1}[d]
    step = step if d in ("LT", "LE") else -step
    if step <= 0:
        return None  # never ends, or ends only by overflow: not this form
    return max(0, -(-span // step))


def _loop_table(comps: dict[str, list[str]]) -> tuple[dict[str, int], set[str], list[dict]]:
    """Times each computation runs per call of ENTRY, through while trip counts, the set of
    computations reached through a conditional branch (their count is an upper bound: a branch
    runs only on the trips that take it), and every while loop reached with its trip count and
    where it came from: the compiler's `known_trip_count`, the loop's condition
    (_derived_trip_count), or 'unknown' (the body is then counted once per entry, as if one trip)."""
    runs, branched, loops = {"ENTRY": 1}, set(), []
    stack = ["ENTRY"]
    while stack:
        name = stack.pop()
        caller = None
        for line in comps.get(name, []):
            w = _WHILE.search(line)
            trip = None
            if w is not None:
                known = _TRIP.search(line)
                if known:
                    trip, source = int(known.group(1)), "known_trip_count"
                else:
                    caller = caller if caller is not None else _instructions(comps[name])[0]
                    trip = _derived_trip_count(comps, caller, line)
                    source = "condition" if trip is not None else "unknown"
                if w.group(1) in comps and w.group(1) not in runs:
                    op = re.search(r'op_name="([^"]*)"', line)
                    loops.append({"body": w.group(1), "computation": name, "trip_count": trip, "source": source,
                                  "op_name": op.group(1) if op else ""})
            for attr, callee in called(line):
                if callee not in comps or callee in runs:
                    continue
                is_body = w is not None and callee == w.group(1)
                runs[callee] = runs[name] * (trip if (is_body and trip is not None) else 1)
                if attr in _BRANCHES or name in branched:
                    branched.add(callee)
                stack.append(callee)
    return runs, branched, loops


def _executions(comps: dict[str, list[str]]) -> tuple[dict[str, int], set[str]]:
    runs, branched, _ = _loop_table(comps)
    return runs, branched


def computations(hlo: str) -> dict[str, list[str]]:
    """{computation ('ENTRY' for the entry): its instruction lines}. In a scheduled module (every
    accelerator compiler's output) the lines are in execution order."""
    return _split_computations(hlo)


def runs_per_step(comps: dict[str, list[str]]) -> dict[str, int]:
    """Times each computation runs per step, through the enclosing loops' trip counts."""
    return _executions(comps)[0]


def collective_names(lines: list[str]) -> list[str]:
    """The names of the collectives among a computation's lines (their -start when async), as
    `collectives` names them."""
    return [m.group(1) for line in lines if (m := _INSTR.match(line))]


def while_loops(hlo: str) -> list[dict]:
    """Every while loop with its trip count and its source ('known_trip_count', 'condition' or
    'unknown', trip_count None)."""
    return _loop_table(_split_computations(hlo))[2]


def link_bytes(kind: str, nbytes, group):
    """Bytes one device sends over its links for a collective whose result buffer is `nbytes`,
    over a group of `group` devices, by the bandwidth-optimal ring: all-reduce 2(n-1)/n of its
    result, all-gather and all-to-all (n-1)/n, reduce-scatter (n-1) of its 1/n shard, a
    collective-permute its buffer. The result-buffer convention (`Collective.bytes`) cannot set a
    reduce-scatter beside the ring of collective-permutes XLA:TPU writes it as inside a collective
    matmul (Llama-3-70B on v5p-512, tensor 4: the row-parallel projections' forward sums); this can."""
    n = np.maximum(group, 1)
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
              "ragged-all-to-all": (n - 1) / n, "reduce-scatter": n - 1, "collective-permute": 1.0}[kind]
    return nbytes * factor


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


_DONE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) [a-z-]+-done\(%([^,\s)]+)\)")
# XLA:GPU's decomposed collective-permute (distributed.GPU_FLAGS: the collective-permute
# decomposer): a `send` / `recv` pair per cycle part, with its pairs in a frontend attribute; the
# `send` (its result: (data, context, token)) is the transfer, the `recv` the other end of it.
SEND = re.compile(r"^\s*(?:ROOT )?%(\S+) = \(([a-z0-9]+\[[0-9,]*\])[^)]*\) send\(.*_xla_send_recv_source_target_pairs=")
_FUSED_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) fusion\(.*kind=kCustom, calls=%(all-reduce-scatter[^,\s]*)")


def _reduce_scatter_fusions(comps: dict[str, list[str]]) -> dict[str, tuple[str, str]]:
    """XLA:TPU's reduce-scatters: a `kCustom` fusion calling an `all-reduce-scatter` computation,
    whose all-reduce of the whole operand is cut to this device's shard inside the fusion (one
    collective on the wire: a reduce-scatter). -> {fused computation: (the fusion's result shape,
    its line)}."""
    out = {}
    for lines in comps.values():
        for line in lines:
            m = _FUSED_COLLECTIVE.match(line)
            if m:
                out[m.group(2)] = (m.group(1), line)
    return out


_CHAIN = re.compile(r'channel_id=(\d+),.*?\bchain_id="(\d+)"')


def async_fusion_chains(comps: dict[str, list[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """XLA:TPU's async collective fusions: one collective issued as a chain of fusions (one whose
    root is an `AsyncCollectiveStart` custom call, continuations that run it beside compute, one
    ending in `AsyncCollectiveDone`), each holding a copy of the collective instruction with the
    same `channel_id` and `chain_id` and the whole result shape. On the wire that is one
    collective. -> {(channel_id, chain_id): [(computation, collective name), ...]} for chains of
    more than one copy. (Seen on v5e-8 under sequence parallelism and ZeRO-3: the backward's
    cotangent gathers written as chains of 3-4 copies, which read one by one made the audit count
    the tensor gathers 1.8x.)"""
    chains: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            chain = _CHAIN.search(line) if m else None
            if chain:
                chains.setdefault(chain.groups(), []).append((comp, m.group(1)))
    return {k: v for k, v in chains.items() if len(v) > 1}


def collectives(hlo: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective in optimized HLO text, with its mesh axes and per-step executions. An
    all-reduce inside XLA:TPU's all-reduce-scatter fusion is the reduce-scatter it implements:
    its bytes are the fusion's result (the shard), its op name the fusion's. A chain of XLA:TPU's
    async collective fusions (async_fusion_chains) is one collective, named by its first copy."""
    comps = _split_computations(hlo)
    runs, branched = _executions(comps)
    scatters = _reduce_scatter_fusions(comps)
    copies = {member for members in async_fusion_chains(comps).values() for member in members[1:]}
    dones = {m.group(2): m.group(1) for lines in comps.values() for line in lines
             if (m := _DONE.match(line))}  # start name -> its -done's result shape
    found = []
    n_devices = math.prod(mesh_shape.values())
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line) or SEND.match(line)
            if not m:
                continue
            if m.re is SEND:  # its data, as the permute it is part of (the share below adds the parts up)
                (name, result), kind, start = m.groups(), "collective-permute", None
            else:
                name, result, kind, start = m.groups()
            if (comp, name) in copies:
                continue
            groups = _groups(line, n_devices)
            axes = groups_to_axes(groups, mesh_shape) if groups else ()
            nbytes, sent = _shape_bytes(result), result
            if start:  # an async start: its results are what its -done returns
                done = dones.get(name)
                # (XLA:GPU's all-reduce-start returns the results alone, its all-gather- and
                # reduce-scatter-start (operands, results); with no -done found, half the tuple)
                nbytes = _shape_bytes(done) if done is not None else nbytes // 2
                sent = done if done is not None else result
            if kind == "collective-permute" and groups:  # per device, averaged: only the sources send
                share = len({pair[0] for pair in groups}) / n_devices
                nbytes = int(round(nbytes * share))
                sent = tuple((t, int(round(b * share))) for t, b in _bytes_by_dtype(sent))
            op = re.search(r'op_name="([^"]*)"', line)
            if kind == "all-reduce" and comp in scatters:
                shard, caller = scatters[comp]
                kind, nbytes, op = "reduce-scatter", _shape_bytes(shard), re.search(r'op_name="([^"]*)"', caller)
                sent = shard
            found.append(Collective(
                kind, name, comp, axes, nbytes, runs.get(comp, 1), runs.get(comp, 1) > 1, op.group(1) if op else "",
                comp in branched, sent if isinstance(sent, tuple) else _bytes_by_dtype(sent),
            ))
    return found


_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = [a-z0-9]+\[([0-9,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%\S+ = [a-z0-9]+\[([0-9,]*)\]\S* dot\(%([^,\s)]+),.*?lhs_contracting_dims=\{([0-9,]*)\}")


# (the first array of the result is the product; the second, if any, cuBLAS's workspace)
_GEMM_CALL = re.compile(r"^\s*(?:ROOT )?%\S+ = \(?[a-z0-9]+\[([0-9,]*)\]\S* .*?custom-call\(%([^,\s)]+),")
_CONV = re.compile(r"^\s*(?:ROOT )?%\S+ = [a-z0-9]+\[([0-9,]*)\]\S* convolution\(%([^,\s)]+), %([^,\s)]+)\)(.*)")


def _window(text: str, key: str, n: int, default: int) -> list[int]:
    m = re.search(r"\b" + key + r"=([-\dx_]+)", text)
    return [int(v) for v in m.group(1).split("x")] if m else [default] * n


def conv_macs(out: list[int], lhs: list[int], rhs: list[int], attrs: str) -> int | None:
    """Multiply-adds of one convolution that touch real data: output elements x the kernel's input
    features x, per spatial dimension, the (output position, window tap) pairs that land on an
    input element rather than on padding or a dilation hole. The TPU compiler writes every
    dot_general as a convolution (batch and head dims as spatial dims with padding and window
    reversal), where this is the dot's 2 x out x contracted / 2. None where the labels are unread."""
    labels = re.search(r"dim_labels=([0-9bf]+)_([0-9io]+)->([0-9bf]+)", attrs)
    if not labels or "feature_group_count" in attrs or "batch_group_count" in attrs:
        return None
    lhs_l, rhs_l, out_l = labels.groups()
    if (len(lhs_l), len(rhs_l), len(out_l)) != (len(lhs), len(rhs), len(out)):
        return None
    spatial = sorted(int(c) for c in out_l if c.isdigit())
    win = re.search(r"window=\{([^}]*)\}", attrs)
    text = win.group(1) if win else ""
    n = len(spatial)
    size = _window(text, "size", n, 1)
    stride, lhs_dil, rhs_dil = (_window(text, k, n, 1) for k in ("stride", "lhs_dilate", "rhs_dilate"))
    pad = re.search(r"\bpad=([-\dx_]+)", text)
    lows = [int(p.split("_")[0]) for p in pad.group(1).split("x")] if pad else [0] * n
    if not all(len(v) == n for v in (size, stride, lhs_dil, rhs_dil, lows)):
        return None
    macs = math.prod(out) * rhs[rhs_l.index("i")]
    for d in spatial:
        n_in, n_out = lhs[lhs_l.index(str(d))], out[out_l.index(str(d))]
        if size[d] != rhs[rhs_l.index(str(d))] or n_out == 0:
            return None
        o = np.arange(n_out)
        valid = 0
        for t in range(size[d]):
            pos = o * stride[d] + t * rhs_dil[d] - lows[d]
            valid += int(np.count_nonzero((pos >= 0) & (pos <= (n_in - 1) * lhs_dil[d]) & (pos % lhs_dil[d] == 0)))
        macs = macs // n_out * valid
    return macs


def dot_flops(hlo: str) -> dict[str, float]:
    """Matmul FLOPs one device executes per step, counted from the HLO with loop trips (XLA's own
    cost analysis counts a loop body once): dots, convolutions and cuBLAS GEMM custom calls. `conditional`: the part inside conditional branches,
    counted on every trip (an upper bound: 1F1B's busy branches run on M of its ticks).
    `convolution`: the part from convolutions (the TPU compiler's form of every dot_general: see
    conv_macs); `uncounted_convolutions`: convolutions whose FLOPs could not be read."""
    comps = _split_computations(hlo)
    runs, branched = _executions(comps)
    total = conditional = convolution = 0.0
    uncounted = 0
    for comp, lines in comps.items():
        shapes = {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}
        for line in lines:
            d = _DOT.match(line)
            if d and d.group(2) in shapes:
                lhs = [int(v) for v in shapes[d.group(2)].split(",") if v]
                out = math.prod(int(v) for v in d.group(1).split(",") if v)
                flops = 2.0 * out * math.prod(lhs[int(i)] for i in d.group(3).split(",") if i) * runs.get(comp, 1)
            elif "__cublas$" in line and (g := _GEMM_CALL.match(line)) and g.group(2) in shapes:
                # a cuBLAS GEMM custom call (XLA:GPU's form of some dots): [out] x contracted
                lhs = [int(v) for v in shapes[g.group(2)].split(",") if v]
                contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
                k = math.prod(lhs[int(i)] for i in re.findall(r'"(\d+)"', contracting.group(1))) if contracting else 0
                out = math.prod(int(v) for v in g.group(1).split(",") if v)
                flops = 2.0 * out * k * runs.get(comp, 1)
            elif " convolution(" in line and (c := _CONV.match(line)):
                dims = [[int(v) for v in x.split(",") if v] if x is not None else None
                        for x in (c.group(1), shapes.get(c.group(2)), shapes.get(c.group(3)))]
                macs = conv_macs(*dims, c.group(4)) if dims[1] is not None and dims[2] is not None else None
                if macs is None:
                    uncounted += 1
                    continue
                flops = 2.0 * macs * runs.get(comp, 1)
                convolution += flops
            else:
                continue
            total += flops
            conditional += flops if comp in branched else 0.0
    return {"total": total, "conditional": conditional, "convolution": convolution,
            "uncounted_convolutions": uncounted}


_KERNEL = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
# Instructions that move no data of their own: views, tuples, control flow (their bodies count)
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                "opt-barrier", "partition-id", "replica-id", "after-all", "add-dependency"}


class Kernel(NamedTuple):
    """One instruction that runs as a kernel: `type` its result's (a tuple type too), `runs` its
    executions per step (loop trips), `branched` inside a conditional's branch."""

    computation: str
    name: str
    type: str
    op: str
    line: str
    runs: int
    branched: bool


def kernels(hlo: str) -> Iterator[tuple[Kernel, int]]:
    """(kernel, bytes it reads and writes) for each fusion, custom call, collective, copy of the
    step (an async pair at its start); nothing inside fusion bodies and reducers."""
    comps = _split_computations(hlo)
    runs, branched = _executions(comps)
    fused = {callee for lines in comps.values() for line in lines for attr, callee in called(line)
             if attr in ("calls", "to_apply") and " fusion(" in line or attr == "to_apply"}
    for comp, lines in ((c, ls) for c, ls in comps.items() if c not in fused and c in runs):
        types = {}
        for m in filter(None, map(_KERNEL.match, lines)):
            name, typ, op, rest = m.groups()
            types[name] = typ
            if op in _NOT_KERNELS or op.endswith("-done"):
                continue
            # (an async -start's tuple result holds its operand too: counted twice, a small excess)
            moved = _shape_bytes(typ) + sum(_shape_bytes(types.get(o, "")) for o in _operands(rest))
            yield Kernel(comp, name, typ, op, m.string, runs[comp], comp in branched), moved


def kernel_bytes(hlo: str, scope: str | None = None) -> dict[str, float]:
    """Bytes one device's kernels read and write per step (`kernels`, loop trips counted; XLA's
    cost analysis counts a loop body once, and a compile-only GPU target gives none).
    `conditional`: the part inside conditional branches (on every trip: an upper bound).
    `scope`: also `scoped`, the part of the kernels whose op_name holds `scope` as a path
    component (a jax.named_scope: the FP8 telemetry's)."""
    total = conditional = scoped = 0.0
    in_scope = re.compile(rf'op_name="(?:[^"]*/)?{re.escape(scope)}(?:/[^"]*)?"') if scope else None
    for k, moved in kernels(hlo):
        total += moved * k.runs
        conditional += moved * k.runs if k.branched else 0.0
        scoped += moved * k.runs if in_scope and in_scope.search(k.line) else 0.0
    return {"total": total, "conditional": conditional} | ({"scoped": scoped} if scope else {})


def summarize(found: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
    """{(kind, axes): {'ops': static count, 'executions': per step, 'bytes': per step}}."""
    out: dict[tuple[str, tuple[str, ...]], dict[str, int]] = {}
    for c in found:
        row = out.setdefault((c.kind, c.axes), {"ops": 0, "executions": 0, "bytes": 0})
        row["ops"] += 1
        row["executions"] += c.executions
        row["bytes"] += c.bytes_per_step
    return out


