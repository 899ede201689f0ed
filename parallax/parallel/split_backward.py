"""A backward split by its outputs: ZB-H1's B (the input gradient) and W (the weight gradients).

Zero-bubble schedules run a chunk's backward in two ops ticks apart: B, the input cotangent that
the previous stage waits for, and W, the weight gradients, deferred into the bubbles. A unit's
weight gradient needs its matmuls' output cotangents, which only B's chain computes; a W that is
`jax.vjp` w.r.t. the weights again runs that chain a second time (the input-gradient dots of every
unit: 4 forwards of work a chunk where 1F1B does 3). Here the backward's jaxpr is split instead,
with no change to the model code:

  - B runs the equations its outputs need (a dead-code walk from them);
  - W runs the rest of what its outputs need, and reads what it needs of B's values from a stash
    that B returns beside its outputs. A value W can compute again from its own inputs with cheap
    equations alone (no matmul, scan, conditional, collective or call: a transpose of a weight,
    a broadcast) it computes; any other is stashed, but a widening convert or a layout constraint
    of one of B's values, which W applies again to the narrower value it stashes (`_widens`).

Calls (`jit`, `closed_call`, the backward's `remat2`, a recomputed custom VJP's primal) are
inlined first, so the walk sees through them. A scan both sides need (the chunk's units) is split
in its body by the same rule: B's scan emits the stash of each trip as extra ys, W's scan takes
them as xs; a carry B needs is B's (the input cotangent through the units), any other W's (a
gradient summed over trips). Anything else that B needs (a conditional, a while loop, a
collective, a custom call) B runs whole.

The two sides are traced from the same function at each site (each with its own closures), so
their stashes line up: `Split.stash_of` names the layout, and the pipeline keeps it per residual
slot from B to W (pipeline_1f1b.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
from jax._src import source_info_util as _source_info  # (the rebound equations keep their op names)
from jax.extend import core as jcore

# Equations W never computes again from its own inputs: matmuls, loops, conditionals, calls and
# the collectives (the primitives of jax 0.10's jax._src.lax.parallel but the device index and
# the type casts, _CASTS)
_COLLECTIVES = {"all_gather", "all_gather_done", "all_gather_invariant", "all_gather_reduced",
                "all_gather_reduced_start", "all_gather_start", "all_to_all", "all_to_all_done", "all_to_all_start",
                "pbroadcast", "pbroadcast_done", "pbroadcast_start", "pmax", "pmin", "ppermute", "ppermute_done",
                "ppermute_start", "precv", "preduced", "psend", "psum", "psum_done", "psum_invariant",
                "psum_invariant_start", "psum_start", "ragged_all_to_all", "reduce_scatter", "reduce_scatter_done",
                "reduce_scatter_start", "unreduced_psum", "unreduced_psum_start", "unreduced_reduce_scatter",
                "unreduced_reduce_scatter_start"}
_HEAVY = {"dot_general", "conv_general_dilated", "ragged_dot_general", "scan", "while", "cond",
          "custom_call", "pallas_call", "custom_vjp_call", "custom_jvp_call", *_COLLECTIVES}
_CASTS = {"pvary", "pcast", "vary_unreduced_cast_p"}  # casts between shard_map's types (no data moves)
_INLINED = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_vjp_call"}


def _subjaxprs(eqn: Any) -> list:
    return [v for v in eqn.params.values() if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))]


def _cheap(eqn: Any) -> bool:
    return eqn.primitive.name not in _HEAVY and not _subjaxprs(eqn) and not eqn.effects


def _widens(eqn: Any) -> bool:
    """An equation W runs again on B's value rather than have the stash hold its wider result: a
    convert to a wider dtype (FP8's quantisation reads its operand in float32: the stash would
    hold the float32 copy of a bf16 value, twice its bytes) and a layout constraint (under
    sequence parallelism, transformer.scatter_partial_sums gathers a row-parallel output's
    cotangent over tensor: the stash keeps it T-sharded, as the residual stream, and W gathers
    it again, as the norms' outputs it recomputes)."""
    if not _is_var(eqn.invars[0]):
        return False
    if eqn.primitive.name == "sharding_constraint":
        return True
    if eqn.primitive.name != "convert_element_type":
        return False
    return eqn.outvars[0].aval.dtype.itemsize > eqn.invars[0].aval.dtype.itemsize


def _is_var(a: Any) -> bool:
    return isinstance(a, jcore.Var) and not isinstance(a, jcore.DropVar)


def _bind(eqn: Any, ins: list) -> list:
    # as jax.core.eval_jaxpr binds: the equation's context (e.g. its compute type) and its
    # source names (the HLO's op names the audit reads) kept
    names = _source_info.current_name_stack() + eqn.source_info.name_stack
    with _source_info.user_context(eqn.source_info.traceback, name_stack=names), eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _rescan(eqn: Any, consts: list, init: list, xs: list, body: Callable[[list, list, list], tuple[list, list]]):
    """A scan like `eqn`'s over (consts, init, xs) with body(consts, carry, x) -> (carry, ys)."""
    p = eqn.params
    return jax.lax.scan(lambda carry, x: body(consts, list(carry), list(x)), list(init), list(xs), length=p["length"],
                        reverse=p["reverse"], unroll=p["unroll"])


def _scan_parts(eqn: Any, ins: list) -> tuple[list, list, list]:
    nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
    return ins[:nc], ins[nc:nc + nk], ins[nc + nk:]


def _side_scan(eqn: Any, ins: list, reads: list[bool], carries: list[bool], ys: list[bool],
               run: Callable[[list, list], tuple[list, Any]], extra_xs: list = ()) -> tuple[list, Any]:
    """One side's part of a split scan: the consts and xs it `reads`, the `carries` and `ys` it
    owns (the others None), `run(body inputs, this trip's extra xs) -> (body outputs, aux ys)`
    its body; `extra_xs`: more per-trip inputs (W: B's stash). Returns (the scan's outputs, None
    where the side does not compute them; the aux ys: B's per-trip stash)."""
    nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
    c, k, x = _scan_parts(eqn, ins)
    x_idx = [j for j, r in enumerate(reads[nc + nk:]) if r]

    def step(c_in, carry, trip):
        it = iter(carry)
        xs = [None] * len(x)
        for j, a in zip(x_idx, trip[:len(x_idx)]):
            xs[j] = a
        outs, aux = run([*c_in, *[next(it) if own else None for own in carries], *xs], trip[len(x_idx):])
        return ([o for o, own in zip(outs[:nk], carries) if own],
                ([o for o, own in zip(outs[nk:], ys) if own], aux))

    carry, (out_ys, aux) = _rescan(eqn, [a if r else None for a, r in zip(c, reads[:nc])],
                                   [a for a, own in zip(k, carries) if own], [x[j] for j in x_idx] + list(extra_xs), step)
    it_k, it_y = iter(carry), iter(out_ys)
    return [next(it_k) if own else None for own in carries] + [next(it_y) if own else None for own in ys], aux


def _inline(jaxpr: Any, consts: list, args: list) -> list:
    """Evaluates `jaxpr`, its calls inlined and its scans' bodies too (so one walk sees every equation)."""
    env: dict = {}
    read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]  # noqa: E731
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        if name in _INLINED and len(_subjaxprs(eqn)) == 1:
            inner = _subjaxprs(eqn)[0]
            outs = (_inline(inner.jaxpr, inner.consts, ins) if isinstance(inner, jcore.ClosedJaxpr)
                    else _inline(inner, [], ins))
        elif name == "scan":
            body = eqn.params["jaxpr"]
            nk = eqn.params["num_carry"]

            def step(c, k, x, body=body, nk=nk):
                out = _inline(body.jaxpr, body.consts, [*c, *k, *x])
                return out[:nk], out[nk:]

            carry, ys = _rescan(eqn, *_scan_parts(eqn, ins), step)
            outs = [*carry, *ys]
        else:
            outs = _bind(eqn, ins)
        for v, x in zip(eqn.outvars, outs):
            if _is_var(v):
                env[v] = x
    return [read(a) for a in jaxpr.outvars]


@dataclass
class _Plan:
    """Who runs what in one jaxpr (a body's: per trip)."""

    b_eqns: list[bool]  # B runs equation i (a scan: its B part, `scans[i].b`)
    w_eqns: list[bool]  # W runs equation i (a split scan: its W part)
    b_reads: list[bool]  # per invar: B reads it
    stash: list = field(default_factory=list)  # the values B hands W at this level (Vars)
    scans: dict = field(default_factory=dict)  # eqn index -> _ScanPlan, for the scans B runs


@dataclass
class _ScanPlan:
    body: _Plan
    b_carry: list[bool]
    w_carry: list[bool]
    b_ys: list[bool]  # the ys B's part computes
    w_ys: list[bool]  # the ys W's part computes
    w_reads: list[bool]  # per body invar: W's part reads it (the B carries' per trip are stashed)


def _b_walk(jaxpr: Any, need: list[bool]) -> _Plan:
    """B's part of `jaxpr`: the equations the outputs marked in `need` depend on."""
    live = {a for a, n in zip(jaxpr.outvars, need) if n and _is_var(a)}
    b_eqns = [False] * len(jaxpr.eqns)
    scans: dict = {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs = [_is_var(v) and v in live for v in eqn.outvars]
        if not any(outs):
            continue
        b_eqns[i] = True
        if eqn.primitive.name == "scan":
            nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
            body = eqn.params["jaxpr"].jaxpr
            carry = outs[:nk]
            while True:  # a carry B's part reads in a trip is one B must carry: to the fixpoint
                sub = _b_walk(body, carry + outs[nk:])
                grown = [c or r for c, r in zip(carry, sub.b_reads[nc:nc + nk])]
                if grown == carry:
                    break
                carry = grown
            scans[i] = _ScanPlan(sub, carry, [False] * nk, outs[nk:], [False] * len(outs[nk:]), [])
            reads = sub.b_reads[:nc] + carry + sub.b_reads[nc + nk:]
        else:
            reads = [True] * len(eqn.invars)
        live.update(a for a, r in zip(eqn.invars, reads) if r and _is_var(a))
    return _Plan(b_eqns, [False] * len(jaxpr.eqns), [v in live for v in jaxpr.invars], scans=scans)


def _fresh(plan: _Plan) -> _Plan:
    """`plan` with B's part only (W's cleared, nested scans' too)."""
    scans = {i: _ScanPlan(_fresh(s.body), s.b_carry, [False] * len(s.w_carry), s.b_ys, [False] * len(s.b_ys), [])
             for i, s in plan.scans.items()}
    return _Plan(plan.b_eqns, [False] * len(plan.b_eqns), plan.b_reads, scans=scans)


def _w_walk(jaxpr: Any, plan: _Plan, need: list[bool], readable: list[bool]) -> list[bool]:
    """W's part of `jaxpr` for the outputs marked in `need`, into `plan` (B's part already in it):
    `readable` per invar, whether W has it. -> per invar, whether W reads it."""
    free = {v for v, r in zip(jaxpr.invars, readable) if r} | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:  # what W can compute again from its own inputs, cheaply
        if _cheap(eqn) and all(not _is_var(a) or a in free for a in eqn.invars):
            free.update(v for v in eqn.outvars if _is_var(v))
    live = {a for a, n in zip(jaxpr.outvars, need) if n and _is_var(a)}
    made_by_b = {v for i, e in enumerate(jaxpr.eqns) if plan.b_eqns[i] for v in e.outvars if _is_var(v)}
    stash: set = set()
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs = [_is_var(v) and v in live for v in eqn.outvars]
        if not any(outs):
            continue
        if all(v in free for v, o in zip(eqn.outvars, outs) if o):  # cheap, from W's own inputs
            plan.w_eqns[i] = True
            live.update(a for a in eqn.invars if _is_var(a))
        elif eqn.primitive.name in _CASTS and all(a in made_by_b for a in eqn.invars if _is_var(a)):
            # a cast to varying of B's values: B casts and hands over the typed value (the stash
            # is read back through a slot index that varies over `pipe`, so an untyped value,
            # a fused attention kernel's output, would come back typed unlike the cast's input)
            plan.b_eqns[i] = True
            stash.update(v for v, o in zip(eqn.outvars, outs) if o)
            made_by_b.update(v for v in eqn.outvars if _is_var(v))
        elif not plan.b_eqns[i]:  # nothing of B's: W runs it whole
            plan.w_eqns[i] = True
            live.update(a for a in eqn.invars if _is_var(a))
        elif i in plan.scans:  # both need it: what B's part computes is stashed, the rest is W's
            sp = plan.scans[i]
            nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
            body = eqn.params["jaxpr"].jaxpr
            mine = [o and not b for o, b in zip(outs, sp.b_carry + sp.b_ys)]
            stash.update(v for v, o, m in zip(eqn.outvars, outs, mine) if o and not m)
            if not any(mine):
                continue
            carry = mine[:nk]
            while True:  # a carry W's part reads (not B's) is one W must carry
                sub = _fresh(sp.body)  # each round from B's part alone
                readable_body = [True] * nc + [c and not b for c, b in zip(carry, sp.b_carry)] + \
                                [True] * (len(body.invars) - nc - nk)
                reads = _w_walk(body, sub, carry + mine[nk:], readable_body)
                grown = [c or (r and not b) for c, r, b in zip(carry, reads[nc:nc + nk], sp.b_carry)]
                if grown == carry:
                    break
                carry = grown
            sp.body, sp.w_carry, sp.w_ys, sp.w_reads = sub, carry, mine[nk:], reads
            plan.w_eqns[i] = True
            ins = reads[:nc] + carry + reads[nc + nk:]  # the W carries' inits, the consts and xs it reads
            live.update(a for a, r in zip(eqn.invars, ins) if r and _is_var(a))
        elif _widens(eqn):  # B's value widened: W widens again, the narrow one is handed over
            plan.w_eqns[i] = True
            live.update(a for a in eqn.invars if _is_var(a))
        else:  # B computes it: handed over
            stash.update(v for v, o in zip(eqn.outvars, outs) if o)
    # B's carries' values W reads in a trip are stashed too (not readable: `readable` False)
    stash.update(v for v, r in zip(jaxpr.invars, readable) if not r and v in live)
    order = {v: k for k, v in enumerate([*jaxpr.invars, *(o for e in jaxpr.eqns for o in e.outvars)])}
    plan.stash = sorted(stash, key=order.__getitem__)
    return [v in live for v in jaxpr.invars]


def _run_b(jaxpr: Any, plan: _Plan, consts: list, args: list) -> tuple[list, list]:
    """B's part: (the outputs B computes, None elsewhere; the stash, flat)."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update((v, a) for v, a in zip(jaxpr.invars, args) if a is not None)
    read = lambda a: a.val if isinstance(a, jcore.Literal) else env.get(a)  # noqa: E731
    nested: list = []
    for i, eqn in enumerate(jaxpr.eqns):
        if not plan.b_eqns[i]:
            continue
        ins = [read(a) for a in eqn.invars]
        if i in plan.scans:
            sp, body = plan.scans[i], eqn.params["jaxpr"].jaxpr
            outs, stash = _side_scan(eqn, ins, sp.body.b_reads, sp.b_carry, sp.b_ys,
                                     lambda a, _, body=body, sp=sp: _run_b(body, sp.body, [], a))
            nested.extend(stash)
        else:
            outs = _bind(eqn, ins)
        for v, a in zip(eqn.outvars, outs):
            if _is_var(v) and a is not None:
                env[v] = a
    return [read(a) for a in jaxpr.outvars], [env[v] for v in plan.stash] + nested


def _run_w(jaxpr: Any, plan: _Plan, consts: list, args: list, stash: list) -> list:
    """W's part: the outputs it computes (None elsewhere), reading B's values from `stash`
    (consumed from the front, as _run_b laid it out)."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update((v, a) for v, a in zip(jaxpr.invars, args) if a is not None)
    env.update(zip(plan.stash, stash[:len(plan.stash)]))
    rest = stash[len(plan.stash):]
    read = lambda a: a.val if isinstance(a, jcore.Literal) else env.get(a)  # noqa: E731
    for i, eqn in enumerate(jaxpr.eqns):
        if i in plan.scans:  # B ran (a part of) it: its trips' stash comes next, whoever reads it
            n_stash = _stash_count(plan.scans[i].body)
            mine, rest = rest[:n_stash], rest[n_stash:]
        if not plan.w_eqns[i]:
            continue
        ins = [read(a) for a in eqn.invars]
        if i in plan.scans:
            sp, body = plan.scans[i], eqn.params["jaxpr"].jaxpr
            outs, _ = _side_scan(eqn, ins, sp.w_reads, sp.w_carry, sp.w_ys,
                                 lambda a, st, body=body, sp=sp: (_run_w(body, sp.body, [], a, st), []), mine)
        else:
            outs = _bind(eqn, ins)
        for v, a in zip(eqn.outvars, outs):
            if _is_var(v) and a is not None:
                env[v] = a
    return [read(a) for a in jaxpr.outvars]


def _stash_count(plan: _Plan) -> int:
    return len(plan.stash) + sum(_stash_count(s.body) for s in plan.scans.values())


@dataclass(frozen=True)
class Split:
    """`fn(*args)` split by its outputs: `to_w` per output leaf, whether W computes it (the rest
    are B's). Built at each site from that site's `fn` (traced once: the calls inlined)."""

    jaxpr: Any  # the inlined ClosedJaxpr
    plan: _Plan
    out_tree: Any
    to_w: tuple[bool, ...]

    @classmethod
    def of(cls, fn: Callable, args: tuple, to_w: Callable[[Any], Any]) -> "Split":
        """`to_w(outputs)`: a pytree of bools like fn's outputs (True: W's)."""
        flat, in_tree = jax.tree.flatten(args)
        traced, out_shapes = jax.make_jaxpr(lambda *a: fn(*jax.tree.unflatten(in_tree, a)), return_shape=True)(*flat)
        inlined = jax.make_jaxpr(lambda *a: _inline(traced.jaxpr, traced.consts, list(a)))(*flat)
        jaxpr, readable = inlined.jaxpr, [True] * len(inlined.jaxpr.invars)
        w = [bool(x) for x in jax.tree.leaves(to_w(out_shapes))]
        b_only = _b_walk(jaxpr, [not x for x in w])
        # An output of W's that W would compute with cheap equations alone (a norm scale's
        # gradient: a product and a sum) B computes: W would need its cotangent stashed, a
        # [b, T, D] per norm and unit, where B holds it anyway
        for j in [j for j, x in enumerate(w) if x]:
            alone = _fresh(b_only)
            _w_walk(jaxpr, alone, [k == j for k in range(len(w))], readable)
            if not any(name in _HEAVY - {"scan"} for name in _names(jaxpr, alone, "w")):
                w[j] = False
        plan = _b_walk(jaxpr, [not x for x in w])
        _w_walk(jaxpr, plan, w, readable)
        return cls(inlined, plan, jax.tree.structure(out_shapes), tuple(w))

    def b(self, args: tuple) -> tuple[list, list]:
        """B: (fn's output leaves B computes, None at W's; the stash)."""
        outs, stash = _run_b(self.jaxpr.jaxpr, self.plan, list(self.jaxpr.consts), jax.tree.leaves(args))
        return [None if w else o for o, w in zip(outs, self.to_w)], stash

    def w(self, args: tuple, stash: list) -> list:
        """W: fn's output leaves W computes (None at B's), from B's stash."""
        outs = _run_w(self.jaxpr.jaxpr, self.plan, list(self.jaxpr.consts), jax.tree.leaves(args), list(stash))
        return [o if w else None for o, w in zip(outs, self.to_w)]

    def outputs(self, b: list, w: list) -> Any:
        """fn's outputs from B's leaves and W's."""
        return jax.tree.unflatten(self.out_tree, [y if t else x for x, y, t in zip(b, w, self.to_w)])

    def eqns(self, side: str) -> list[str]:
        """The primitive names `side` ('b' or 'w') runs, nested scans' bodies included."""
        return _names(self.jaxpr.jaxpr, self.plan, side)


def _names(jaxpr: Any, plan: _Plan, side: str) -> list[str]:
    names = []
    for i, e in enumerate(jaxpr.eqns):
        if not (plan.b_eqns if side == "b" else plan.w_eqns)[i]:
            continue
        names.append(e.primitive.name)
        if i in plan.scans:
            names += _names(e.params["jaxpr"].jaxpr, plan.scans[i].body, side)
    return names
