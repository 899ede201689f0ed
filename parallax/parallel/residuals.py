"""A chunk's VJP residuals, kept from its F to its B: what a microbatch made, and what it did not.

The table schedules (pipeline_1f1b.py) run a chunk's forward (F) and its backward (B) ticks apart.
Recomputing the forward in B costs one more forward per chunk and microbatch (4 F's of work where
Megatron's 1F1B does 3). Keeping `jax.vjp`'s residuals from F instead needs them split in two:

  - what the microbatch made (its activations, the remat policy's saved values): kept per
    microbatch in the tick loop's buffers, from F to B;
  - what it did not (the weights themselves, anything computed from the weights and the FP8
    state alone, the chunk's input): B has them anyway. Keeping them per microbatch would be a
    copy of the chunk's weights per in-flight microbatch.

`plan` reads the split off the jaxpr of the residuals (a dependence walk from the per-microbatch
arguments, into scans, checkpoints and calls); B traces the same VJP again, takes the kept
residuals from the buffer and the rest from its own trace, and the compiler drops the forward
whose residuals B did not use (checked in tests/test_cost_validation.py by the compiled FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from parallax.model.logical import aval_varying_axes, vary
from parallax.parallelism import REMATS, SCHEDULES, Schedule, keeps_residuals


def keeps(model: Any, sched: Schedule) -> bool:
    """Whether table schedule `sched`'s B (and W) start from F's residuals for `model` (a
    Transformer): parallelism.keeps_residuals for its remat policy and the attention kernel it
    runs (its `attend`, fused_attention.make_attend; None: XLA's). The pipeline (pipeline_1f1b)
    and the step record's compiled-cost bubble (train/loop.py) both read it here."""
    kernel = model.attend.kernel if model.attend is not None else "xla"
    return bool(keeps_residuals(SCHEDULES.index(sched.name), REMATS.index(model.remat), kernel))


@dataclass(frozen=True)
class Residuals:
    """Which leaves of a VJP's residuals (jax.tree.leaves of the vjp function) a microbatch made:
    `kept` their indices, `axes` the manual axes each kept one varies over."""

    leaves: tuple[tuple[tuple[int, ...], Any], ...]  # every leaf's (shape, dtype), in order
    kept: tuple[int, ...]
    untyped: int  # leaves the input made but not typed as varying over the axis asked (not kept)
    axes: tuple[frozenset, ...]

    def made(self, leaves: list) -> list:
        """The kept leaves of a VJP function traced where `plan` was (the same closures)."""
        traced = tuple((tuple(a.shape), a.dtype) for a in leaves)  # (FP8 state: an extended dtype)
        if traced != self.leaves:  # a trace unlike plan's: the kept positions would not be its
            raise AssertionError(f"a chunk's VJP traced {len(traced)} residuals unlike its plan's {len(self.leaves)}: "
                                 f"{[i for i, (a, b) in enumerate(zip(traced, self.leaves)) if a != b][:5]} differ")
        return [leaves[i] for i in self.kept]

    def zeros(self) -> list[jax.Array]:
        """The kept leaves of an idle tick: zeros, typed (varying) as the real ones."""
        return [vary(jnp.zeros(*self.leaves[i]), sorted(a)) for i, a in zip(self.kept, self.axes)]


def _sub_jaxprs(eqn: Any) -> list[Any]:
    out = []
    for value in eqn.params.values():
        if isinstance(value, jcore.ClosedJaxpr):
            out.append(value.jaxpr)
        elif isinstance(value, jcore.Jaxpr):
            out.append(value)
    return out


def _depends(jaxpr: Any, inputs: list[bool]) -> list[bool]:
    """Per output of `jaxpr`: does it depend on an input marked True?"""
    env: dict[Any, bool] = {v: d for v, d in zip(jaxpr.invars, inputs)}
    read = lambda a: isinstance(a, jcore.Var) and env.get(a, False)  # noqa: E731  (literals, consts: no)
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        subs = _sub_jaxprs(eqn)
        if name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
            carry = ins[n_consts:n_consts + n_carry]
            while True:  # a carry depends on x once any trip made it so: iterate to the fixpoint
                outs = _depends(body, ins[:n_consts] + carry + ins[n_consts + n_carry:])
                grown = [a or b for a, b in zip(carry, outs[:n_carry])]
                if grown == carry:
                    break
                carry = grown
            outs = carry + outs[n_carry:]
        elif len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(eqn.outvars):
            outs = _depends(subs[0], ins)  # pjit, closed_call, checkpoint (remat), custom calls' bodies
        else:  # anything else (cond, while, primitives): every output depends on every input
            outs = [any(ins)] * len(eqn.outvars)
        for v, d in zip(eqn.outvars, outs):
            env[v] = d
    return [read(a) for a in jaxpr.outvars]


def plan(residual_leaves: Callable[..., list[jax.Array]], args: tuple, per_microbatch: tuple[int, ...],
         varying: str | None = None) -> Residuals:
    """`residual_leaves(*args)`: jax.tree.leaves of a VJP's function. The leaves a microbatch
    made: computed (not one of the arguments passed through) from an argument in `per_microbatch`
    and, with `varying`, typed as varying over that manual axis (`untyped` counts the others).
    (The tick loop's buffers vary over `pipe`, so what it reads back does; a fused attention
    kernel's residuals are untyped (fused_attention.py), and read back typed their custom VJP
    refuses them.)

    The caller traces its VJPs as `residual_leaves` does: the same closures, traced values where
    the caller's are traced. (A static microbatch index where the tick's was traced made a slice
    of a dynamic slice, and JAX kept a packed microbatch's rotary tables as 8 residuals in the
    plan and merged them into 4 in the tick: `Residuals.made` refuses such a trace.)"""
    closed = jax.make_jaxpr(residual_leaves)(*args)
    jaxpr = closed.jaxpr
    flat = [jax.tree.leaves(a) for a in args]
    marks = [i in per_microbatch for i, leaves in enumerate(flat) for _ in leaves]
    made = _depends(jaxpr, marks)
    passed = set(jaxpr.invars)
    new = [i for i, (d, v) in enumerate(zip(made, jaxpr.outvars)) if d and not (isinstance(v, jcore.Var) and v in passed)]
    avals = closed.out_avals
    kept = tuple(i for i in new if varying is None or varying in aval_varying_axes(avals[i]))
    every = tuple((tuple(a.shape), a.dtype) for a in avals)
    return Residuals(every, kept, len(new) - len(kept), tuple(aval_varying_axes(avals[i]) for i in kept))
