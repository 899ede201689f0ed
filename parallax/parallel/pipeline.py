"""The `pipe` axis: the block stack split into stages, microbatches passed round a ppermute ring.

Layout. The scanned stack's parameters [L, ...] are reshaped to [R, P, Lc, ...] (R repeats, P
stages, Lc = ceil(L / (R P)) layers per chunk) with the P dimension sharded over `pipe`: chunk
v = rep * P + s holds layers v*Lc .. (v+1)*Lc - 1 and lives on stage s = v mod P. When R*P does
not divide L (uneven stages) the stack is first padded at its end with identity slots (zero
weights, masked per unit). The pad and reshape are the whole conversion, so checkpoints stay
layer-major and unpadded (`to_layer_major` / `to_stages`) and the same seed initialises the same
weights on any pipe size.

Schedule. One SPMD program: a `shard_map` manual only over `pipe` (data, tensor and expert stay
with the partitioner) scans over ticks; each tick every stage runs one chunk on one microbatch
and sends its output to the next stage with `ppermute`. Stage s at tick t works on item
k = t - s of its queue, where the queue visits microbatches in groups of P, each group going
round the ring R times (`Schedule.work`). That is GPipe for R = 1 and the circular schedule of
Praxis/MaxText for R > 1; ticks = R*M + P - 1 and the bubble is (P-1)/(R*M + P - 1).

The embedding and the loss head run outside the pipelined stack, replicated over `pipe`; the last
stage's outputs reach every stage through one psum over `pipe`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from parallax.model.fp8 import FP8_COLLECTION, combined_over, quantize_weights, scales_each_use
from parallax.model.fp8_state import padding_value
from parallax.model.layers import CastWeight, QuantizedWeight
from parallax.parallel.mesh import DATA, PIPE
from parallax.parallelism import Schedule
from parallax.model.transformer import Transformer, moe_stat_shapes, remat_policy, stack_unit
from parallax.model.logical import drop_axes, entry_axes, keep_axes, spec_axes, vary, varying_axes
from parallax.parallel.sharding import BATCH_AXES

# ----------------------------------------------------------------------------------------------
# Layer-major <-> stage layout (a reshape of the leading axis)


def to_stages(layers: Any, schedule: Schedule, fill: Callable[[str], float] | None = None) -> Any:
    """[L, ...] -> [R, P, Lc, ...] for every leaf of the scanned stack, first padded with
    `schedule.padding` slots at the end when R*P does not divide L (uneven stages).

    Parameters and optimizer moments pad with zeros (the slots are masked to identity, so they
    stay zero). The FP8 state pads with `fill(leaf name)`, fp8_state.padding_value: a scale of 1, so no
    padded slot divides by zero, and empty histories. The pad is a concatenation with constants,
    so its transpose is a slice: the padded slots' new state (their "cotangent") is dropped and
    never reaches a real layer. (An `edge` pad copied layer L-1's state into the slots; its
    transpose sums, which the fm32 type refuses, and in float32 folded the slots' amaxes into
    layer L-1's history.)"""
    r, p, extra = schedule.repeats, schedule.stages, schedule.padding

    def reshape(path: Any, x: jax.Array) -> jax.Array:
        if extra:
            value = fill(getattr(path[-1], "key", str(path[-1]))) if fill is not None else 0
            if isinstance(value, tuple):  # one value per entry of the last axis (fp8_state.step_state's leaves)
                columns = [jax.lax.full((extra, *x.shape[1:-1], 1), v, x.dtype) for v in value]
                slots = jax.lax.concatenate(columns, x.ndim - 1)
            else:
                slots = jax.lax.full((extra, *x.shape[1:]), value, x.dtype)  # constants: no cotangent
            x = jax.lax.concatenate([x, slots], 0)
        return x.reshape(r, p, x.shape[0] // (r * p), *x.shape[1:])

    return jax.tree_util.tree_map_with_path(reshape, layers)


def stack_state_spec(schedule: Schedule | None) -> P:
    """How a layer-major [L, ...] stack state that is not a parameter (the FP8 state) is stored so
    that `to_stages` moves nothing: stage s's own block of L/P layers on stage s, when that block
    is its whole stack (one chunk per stage, no padding). Circular and interleaved schedules give
    stage s R separate blocks, and padding shifts them: replicated there (the pipeline then
    gathers each leaf once per step, as it did everywhere before)."""
    if schedule is None or schedule.stages <= 1 or schedule.repeats != 1 or schedule.padding:
        return P()
    return P(PIPE)


def to_layer_major(layers: Any, units: int = 0) -> Any:
    """[R, P, Lc, ...] -> [L, ...]: the inverse of `to_stages` (dropping the padding slots when
    `units` says how many are real), for checkpoints."""

    def reshape(x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0] * x.shape[1] * x.shape[2], *x.shape[3:])
        return x[:units] if units else x

    return jax.tree.map(reshape, layers)


def unit_mask(schedule: Schedule, stage: jax.Array, rep: jax.Array | int = 0) -> jax.Array | None:
    """[Lc] bool: which units of chunk (rep, stage) are real layers (None: no padding at all).
    Chunk v = rep*P + stage holds units v*Lc .. v*Lc + Lc - 1 of the padded stack."""
    if not schedule.padding:
        return None
    first = (rep * schedule.stages + stage) * schedule.chunk_units
    return first + jnp.arange(schedule.chunk_units) < schedule.units


def stage_specs(layer_specs: Any) -> Any:
    """Logical specs of the stage layout: ('layers', ...) -> ('repeat', 'stage', 'layers', ...)."""
    return jax.tree.map(lambda s: P("repeat", "stage", *s), layer_specs, is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------------------------
# The pipelined forward pass


def with_batch_amaxes(factory: Any, combined: bool = False) -> Any:
    """An FP8 dot factory (or None) whose amaxes are pmax-ed over the batch axes: inside the
    pipeline's shard_map, manual over them, each device sees only its rows (fp8.py's hook).
    `combined`: the caller combines the state over the batch axes once per step instead
    (fp8.combined_over; `delayed` only): the dots keep their local amaxes, the telemetry's
    fractions are still the whole batch's."""
    if factory is None:
        return None
    if combined:
        return functools.partial(factory, amax_axes=(), stat_axes=tuple(BATCH_AXES))
    return functools.partial(factory, amax_axes=tuple(BATCH_AXES))


def _unit(model: Transformer, combined: bool) -> Callable[..., tuple[jax.Array, dict]]:
    """(unit params, its FP8 state or None, real (a bool) or None, docs, x [b, T, D]) -> (x,
    MoE stats): one unit of the stack, not checkpointed."""
    dot_general = with_batch_amaxes(model.dot_general, combined)
    # ZeRO-3's placer and the expert exchange as injected into the model (train_state.make_layout)
    block = stack_unit(model.cfg)(model.cfg, dot_general, placer=model.placer, exchange=model.exchange,
                                  attention_chunk=model.attention_chunk, attend=model.attend)

    def unit(params: Any, fp8: Any, real: Any, docs: Any, x: jax.Array) -> tuple[jax.Array, dict]:
        y, stats = block.apply({"params": params, **({FP8_COLLECTION: fp8} if fp8 is not None else {})}, x, docs)
        if real is None:
            return y, stats
        return jnp.where(real, y, x), {k: jnp.where(real, v, 0) for k, v in stats.items()}

    return unit


def unit_fn(model: Transformer, combined: bool = False) -> Callable[..., tuple[jax.Array, dict]]:
    """One unit of the stack as stage_fn runs it: checkpointed under the model's remat policy."""
    policy = remat_policy(model.remat, model.placer is not None)
    unit = _unit(model, combined)
    return unit if policy is None else jax.checkpoint(unit, policy=policy, prevent_cse=False)


def stage_fn(model: Transformer, combined: bool = False) -> Callable[..., tuple[jax.Array, dict]]:
    """(chunk params [Lc, ...], x [b, T, D], chunk FP8 state or None, unit mask [Lc] or None,
    repeat or None) -> (x, MoE stats [Lc, ...]): the chunk's units in order.

    Inside the stage's shard_map the activations are sharded over the manual batch axes, so FP8
    amaxes are pmax-ed over them (fp8.py's `amax_axes` hook). A masked-off unit (a padding slot of
    uneven stages) passes its input through: computed and discarded.

    With `rep` (circular schedule) the params and FP8 state are the stage's whole [R, Lc, ...]
    stack and, under a remat policy, each unit slices its own weights inside its checkpoint.
    `full`, `dots` and `save_attn_mlp` never save a slice (not a matmul output, not named):
    sliced outside, the slice (picked by the tick's repeat index) is a per-tick residual of the
    tick loop, ticks x the chunk's weights; inside, the residual is the loop-invariant stack and
    the backward slices again (a copy, not a FLOP). ZeRO-3's `none` policy saves everything but values named as gathered
    weights, slices included, so it keeps them like the per-tick slice (and, in practice, the
    gathered weights too: the named copy's producer is the gathered value; BUILD_NOTES.md). Without a policy, slicing per unit
    measured worse than the per-tick slice (BUILD_NOTES.md).
    """
    unit = _unit(model, combined)

    def sliced(stack: Any, fp8_stack: Any, rep: jax.Array, j: jax.Array, real: Any, docs: Any, x: jax.Array):
        pick = lambda c: c[rep, j]  # noqa: E731
        return unit(jax.tree.map(pick, stack), jax.tree.map(pick, fp8_stack), real, docs, x)

    policy = remat_policy(model.remat, model.placer is not None)
    if policy is not None:
        unit = jax.checkpoint(unit, policy=policy, prevent_cse=False)
        sliced = jax.checkpoint(sliced, policy=policy, prevent_cse=False)

    def stage(chunk: Any, x: jax.Array, fp8: Any = None, mask: Any = None, rep: Any = None, docs: Any = None):
        # docs: this microbatch's packed documents (segment ids, positions [b, T]) or None
        if rep is None or policy is None:
            if rep is not None:  # KNOWN COST (remat=none): the tick loop keeps this slice per tick
                chunk, fp8 = jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, rep, keepdims=False), (chunk, fp8))
            return jax.lax.scan(lambda h, xs: unit(*xs, docs, h), x, (chunk, fp8, mask))
        units = jax.tree.leaves(chunk)[0].shape[1]
        return jax.lax.scan(lambda h, xs: sliced(chunk, fp8, rep, *xs, docs, h), x, (jnp.arange(units), mask))

    return stage


@jax.custom_vjp
def _unless_idle(state: jax.Array, busy: jax.Array) -> jax.Array:
    """FP8 state leaf `state` itself; but a use on an idle tick (`busy` False) sends no new state
    back: its cotangent becomes fm32's zero (-inf), the identity of the max that combines uses.
    (The forward pass is untouched; `stop_gradient` would not do: it is the identity on fm32, an
    extended dtype.)"""
    return state


def _unless_idle_fwd(state: jax.Array, busy: jax.Array) -> tuple[jax.Array, jax.Array]:
    return state, busy


def _unless_idle_bwd(busy: jax.Array, ct: jax.Array) -> tuple[jax.Array, None]:
    nothing = jax.lax.full(ct.shape, -jnp.inf, ct.dtype)
    return jax.lax.select(jnp.broadcast_to(busy, ct.shape), ct, nothing), None


_unless_idle.defvjp(_unless_idle_fwd, _unless_idle_bwd)


@jax.custom_vjp
def _in_order(done: jax.Array, nxt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(done, nxt) unchanged, but nothing reads `nxt` before `done` exists, and in the backward
    pass nothing reads `done`'s cotangent before `nxt`'s exists. Between a tick's two halves:
    compiled for h100-8 without it, XLA:GPU fused the two halves' input selects (forward) and
    cotangent sums (backward) into one kernel each and its dot merger ran both halves' matmuls as
    one GEMM, so the first half waited for the second half's receive."""
    return jax.lax.optimization_barrier((done, nxt))


def _in_order_fwd(done: jax.Array, nxt: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
    return _in_order(done, nxt), None


def _in_order_bwd(_: None, cts: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return jax.lax.optimization_barrier(cts)


_in_order.defvjp(_in_order_fwd, _in_order_bwd)


def send_along(x: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
    """`jax.lax.ppermute(x, PIPE, pairs)` where `pairs` is a chain, or a ring whose last pair closes
    it; a ring is sent as two acyclic permutes, its chain and its closing pair. XLA:GPU's decomposer
    (distributed.GPU_FLAGS) splits a cyclic permute into two send/recv parts and orders the
    second part's receive after the first part's send is done, so the scheduler put both waits
    right after the sends: circular's and interleaved 1F1B's sends were 25% behind compute on
    h100-8. Two acyclic permutes each decompose into one send/recv, as the chains' do. Each device
    still sends once: the same bytes on the wire."""
    if len(pairs) < 2 or {i for i, _ in pairs} != {j for _, j in pairs}:  # a chain: its head receives nothing
        return jax.lax.ppermute(x, PIPE, pairs)
    closing = pairs[-1]
    along, back = jax.lax.ppermute(x, PIPE, pairs[:-1]), jax.lax.ppermute(x, PIPE, [closing])
    return jnp.where(jax.lax.axis_index(PIPE) == closing[1], back, along)


def _merge_halves(stats: list[dict]) -> dict:
    """Stats of the half-microbatches of one tick: counts add, per-token means average."""
    if len(stats) == 1:
        return stats[0]
    return {k: sum(st[k] for st in stats) / (1 if k == "load" else len(stats)) for k in stats[0]}


def stage_placement(spec: P, manual: set[str]) -> P:
    """What the partitioner places of a stage weight [R, Lc, ...] stored as `spec` [R, P, Lc,
    ...] inside the pipeline's shard_map (manual over `manual`): its other axes (`tensor`)."""
    inner = drop_axes(spec, manual)
    return P(inner[0] if len(inner) else None, *inner[2:])


def manual_over(fn: Callable[[jax.Array], jax.Array], placed: P) -> Callable[[jax.Array], jax.Array]:
    """`fn` (collectives over the pipeline's manual axes) applied with the axes `placed` names
    (`tensor`) manual too, each device on its own shard: the partitioner gathered a
    tensor-sharded operand of a manual all_gather or psum_scatter whole first."""
    axes = spec_axes(placed)
    if not axes:
        return fn
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=placed, out_specs=placed,
                         axis_names=axes)


def gather_stage_weight(c: Any, spec: P, manual: set[str], dtype: Any = None) -> Any:
    """Inside a pipeline's shard_map: a stage's weight [R, Lc, ...], stored as `spec` [R, P, Lc,
    ...], gathered over `data` where ZeRO-3 shards it, once per step, not per tick (a
    QuantizedWeight's FP8 bits too: half the bytes of bf16; its scale is the layer's, its master
    only gives the gradient its shape). `dtype`: a matmul weight's compute dtype: it is cast on
    its shard and gathered in it, a CastWeight (a float32 model's too, the same path; None:
    gathered as stored, float32). Expert weights stay sharded over `expert`: each device runs
    its own experts.

    The gather runs with `tensor` manual too (manual_over), each device on its own tensor shard:
    left to the partitioner, the operand was first gathered whole over `tensor` as well, in
    float32, on XLA:GPU and XLA:TPU alike, and the dense-1T row of experiments/targets.py
    (tensor 8 x pipe 16 x data 128, ZeRO-3) compiled for h100-16384 to 219 GiB per device (95
    with it; BUILD_NOTES.md "ZeRO-3 inside pipeline stages kept the tensor sharding")."""
    placed = stage_placement(spec, manual)

    def gather_data(a: jax.Array) -> jax.Array:
        for dim, entry in enumerate(spec):
            if DATA in entry_axes(entry) and dim != 1:
                a = jax.lax.all_gather(a, DATA, axis=dim - (dim > 1), tiled=True)
        return a

    if not any(DATA in entry_axes(e) for e in spec):
        return c
    gather = manual_over(gather_data, placed)
    if isinstance(c, QuantizedWeight):
        return QuantizedWeight(gather(c.master), gather(c.bits), c.scale)
    if dtype is None:
        return gather(c)
    copy = jax.lax.stop_gradient(gather(c.astype(dtype)))
    return CastWeight(_stand_in(gather, c, copy.shape, tuple(sorted(varying_axes(copy)))), copy)


def gather_stage_weights(model: Transformer, chunks: Any, layer_specs: Any, manual: set[str]) -> Any:
    """gather_stage_weight over a stage's parameters: the weights `layers.param_dot` multiplies
    with (Dense kernels; the experts' under capacity dispatch) cast to the compute dtype first
    and gathered in it; the norm scales and the router (float32 where used), a QuantizedWeight
    (its FP8 bits) and every weight of a model with an injected dot (FP8) or with plain autodiff
    of the cast (grad_dtype None, the reference) as stored."""
    moe = model.cfg.moe
    cast = () if model.dot_general is not None or model.grad_dtype is None else (
        "kernel", *(("wi", "wo") if moe is not None and moe.dispatch != "ragged" else ()))

    def one(path: tuple, spec: P, c: Any) -> Any:
        return gather_stage_weight(c, spec, manual, model.cfg.dtype if path[-1].key in cast else None)

    return jax.tree_util.tree_map_with_path(one, layer_specs, chunks, is_leaf=lambda a: isinstance(a, P))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 2, 3))
def _stand_in(gather: Callable[[jax.Array], jax.Array], shard: jax.Array, shape: tuple[int, ...],
              axes: tuple[str, ...]) -> jax.Array:
    """A CastWeight's master: zeros of the gathered shape (the matmul reads the copy, so no
    float32 gather runs), typed as the gather's output; its cotangent goes back through the
    gather's transpose (the float32 reduce-scatter over data the master's gather would have had)."""
    return vary(jnp.zeros(shape, shard.dtype), axes)


def _stand_in_fwd(gather, shard, shape, axes):
    return _stand_in(gather, shard, shape, axes), shard


def _stand_in_bwd(gather, shape, axes, shard, ct):
    return jax.linear_transpose(gather, shard)(ct)


_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)


def run_pipeline(
    model: Transformer, schedule: Schedule, mesh: jax.sharding.Mesh, layers: Any, layer_specs: Any, x: jax.Array,
    fp8: Any = None, docs: Any = None,
) -> tuple[jax.Array, dict]:
    """The block stack on [B, T, D] activations with stage-layout `layers`; returns ([B, T, D],
    MoE stats per unit of the stack, layer-major, combined over microbatches and batch shards).

    `fp8`: the stack's FP8 state (fm32, stage layout [R, P, Lc, ...]) or None. Each stage gets its
    own layers' state; every use of it (ticks, half-microbatches) combines by max through fm32's
    autodiff, and bubble ticks run on zeros so that their amax (0) never wins. The stage's weights
    are quantised once per step, before the tick loop (fp8.quantize_weights), and under `delayed`
    the dots keep local amaxes, combined over the batch axes once per step (fp8.combined_over).

    `layer_specs`: the mesh PartitionSpecs the stage-layout parameters are stored with.

    `docs`: packed documents, (segment ids, positions) [B, T] each, or None: cut into microbatches
    as the activations are, each tick's stage gets its microbatch's (halves: its half's).

    The shard_map is manual over `pipe` and over the batch axes: the parameters enter replicated
    over the batch axes, so their gradient is reduced over `data` once, where the shard_map is
    transposed, instead of once per tick inside the loop (which is where GSPMD put it when the
    batch axes were left to the partitioner: M times the traffic). `tensor` stays automatic.
    """
    p, r, m = schedule.stages, schedule.repeats, schedule.microbatches
    b, t, d = x.shape
    manual = {PIPE, *BATCH_AXES}
    # [B, T, D] -> [B/M, M, T, D] -> [M, B/M, T, D]: microbatch i takes rows i, i+M, ...; splitting
    # this way keeps each data shard's rows on the same shard (no resharding of the batch).
    micro = x.reshape(b // m, m, t, d).swapaxes(0, 1)
    micro_docs = None if docs is None else tuple(a.reshape(b // m, m, t).swapaxes(0, 1) for a in docs)  # [M, B/M, T]
    split = not scales_each_use(model.dot_general)
    # delayed: the stage's FP8 state combined over the batch axes once per step (fp8.combined_over)
    combined = fp8 is not None and split
    stage = stage_fn(model, combined)
    # A ring when the last stage's output feeds the first stage's next repeat (R > 1); for GPipe a
    # chain: the closing pair would send what no one reads, and XLA:GPU decomposes a ring into
    # two send/recv pairs per permute to break its cycle.
    ring = [(i, (i + 1) % p) for i in (range(p) if r > 1 else range(p - 1))]
    param_specs = jax.tree.map(lambda s: keep_axes(s, manual), layer_specs, is_leaf=lambda a: isinstance(a, P))

    # per weight, the manual axes it is stored sharded over (its FP8 amax is pmax-ed over them)
    sharded_over = jax.tree.map(lambda s: tuple(a for e in s for a in entry_axes(e) if a != PIPE), param_specs,
                                is_leaf=lambda a: isinstance(a, P))

    stat_shapes = moe_stat_shapes(model.cfg, layers_per_chunk=jax.tree.leaves(layers)[0].shape[2])

    def body(chunks: Any, micro: jax.Array, fp8_chunks: Any, micro_docs: Any) -> tuple[jax.Array, dict]:
        chunks, fp8_chunks = jax.tree.map(lambda c: c[:, 0], (chunks, fp8_chunks))  # [R, 1, Lc, ...] -> [R, Lc, ...]
        # FP8: each weight quantised here, once per step, not at every tick and recomputation
        chunks = quantize_weights(chunks, fp8_chunks, model.dot_general, model.cfg.dtype, sharded_over, lead=2)
        chunks = gather_stage_weights(model, chunks, layer_specs, manual)
        if combined:
            fp8_chunks = combined_over(fp8_chunks, tuple(BATCH_AXES))
        s = jax.lax.axis_index(PIPE)
        # Mark inputs varying here, once, outside the tick loop: the transpose of this cast is the
        # reduction of their cotangents (weights over the batch axes, microbatches over `pipe`),
        # which then runs once per step instead of at every use inside the loop.
        chunks = jax.tree.map(lambda c: vary(c, BATCH_AXES), chunks)
        micro = vary(micro, (PIPE,))
        halved = micro.shape[1] % 2 == 0 and split  # [M, B/M, T, D]: this device's rows

        def tick(carry, tick_index):
            recv_head, unsent_tail, outputs, acc = carry
            # The last tick's tail half goes out here, at this tick's start: the first half's
            # compute, which reads only the head received last tick, runs behind its send. Sent
            # at the end of the last tick, it would be the loop's last op with nothing after it.
            recv_tail = send_along(unsent_tail, ring)
            k = tick_index - s
            busy = (k >= 0) & (k < r * m)
            k = jnp.clip(k, 0, r * m - 1)
            group, rest = k // (r * p), k % (r * p)
            rep, i = rest // p, group * p + rest % p
            fresh = jax.lax.dynamic_index_in_dim(micro, i, keepdims=False)
            mask = unit_mask(schedule, s, rep)
            # Two half-microbatches per tick: the first half's send depends on nothing the second
            # half computes, so on accelerators it runs behind the second half's compute (async
            # start/done or send/recv); the second half's goes out at the next tick's start.
            # Not under FP8's `current` recipe: each call scales by its own amax, and a half is
            # half of this device's rows, a set that depends on the data sharding. A whole
            # microbatch (rows i, i+M, ...) is the same set on every layout, so the run's numbers
            # depend on M only, as on one device with M microbatches.
            # Each half picked on its own, the second after the first half's compute (_in_order):
            # XLA:GPU fused the two selects (or the concatenation of the two received halves) into
            # one kernel, so the first half's compute waited for the tail's receive.
            received = [recv_head, recv_tail] if halved else [recv_tail]
            fresh = jnp.split(fresh, 2) if halved else [fresh]
            docs_i = None if micro_docs is None else tuple(
                jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in micro_docs)  # [B/M, T] each
            doc_halves = [None] * len(received) if docs_i is None else (
                list(zip(*(jnp.split(a, len(received)) for a in docs_i))))
            # A bubble tick computes on zeros and its FP8 dots still return a new state: under the
            # current recipe a zero amax keeps the previous scale (1 at first), which would win
            # the max over uses against the real, smaller scales. So a bubble tick's new state is
            # replaced by the max's identity: a bubble never writes a scale or an amax.
            tick_fp8 = jax.tree.map(lambda c: _unless_idle(c, busy), fp8_chunks)
            if r == 1:  # a loop-invariant chunk: its residual is not stacked per tick
                chunk, fp8_chunk = jax.tree.map(lambda c: c[0], (chunks, tick_fp8))
                run = functools.partial(stage, chunk, fp8=fp8_chunk if fp8 is not None else None, mask=mask)
            else:
                run = functools.partial(stage, chunks, fp8=tick_fp8 if fp8 is not None else None, mask=mask, rep=rep)
            outs, results, head = [], [], None
            for f, h, dh in zip(fresh, received, doc_halves):
                if outs:  # the second half after the first (backward: before it); see _in_order.
                    # Only the send reads the ordered output: the backward adds its cotangent to
                    # the stored output's after the second half's, not in one kernel before it.
                    head, h = _in_order(outs[-1], h)
                h = jnp.where((s == 0) & (rep == 0), f, h)
                if fp8 is not None:  # a bubble tick's amaxes must be 0 (see the docstring)
                    h = jnp.where(busy, h, jnp.zeros_like(h))
                results.append(run(h, docs=dh))
                outs.append(results[-1][0])
            stats = _merge_halves([st for _, st in results])
            # Stats of chunk `rep` on this microbatch; a bubble tick adds nothing.
            acc = {k: acc[k].at[rep].add(jnp.where(busy, v, 0)) for k, v in stats.items()}
            head = outs[0][:0] if head is None else send_along(head, ring)
            out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
            done = busy & (s == p - 1) & (rep == r - 1)
            prev = jax.lax.dynamic_index_in_dim(outputs, i, keepdims=False)
            outputs = jax.lax.dynamic_update_index_in_dim(outputs, jnp.where(done, out, prev), i, 0)
            return (head, outs[-1], outputs, acc), None

        acc = {k: vary(jnp.zeros((r, *shape), jnp.float32), tuple(manual)) for k, shape in stat_shapes.items()}
        # the head half received, the tail half unsent ([0 or B/2M, T, D] and [B/2M or B/M, T, D])
        cut = micro.shape[1] // 2 if halved else 0
        init = (jnp.zeros_like(micro[0, :cut]), jnp.zeros_like(micro[0, cut:]), jnp.zeros_like(micro), acc)
        (_, _, outputs, acc), _ = jax.lax.scan(tick, init, jnp.arange(schedule.ticks))
        # Per-token means average over microbatches and the (equal) batch shards; counts add.
        acc = {k: jax.lax.psum(v, BATCH_AXES) if k == "load" else jax.lax.pmean(v / m, BATCH_AXES)
               for k, v in acc.items()}
        acc = {k: v[:, None] for k, v in acc.items()}  # [R, Lc, ...] -> [R, 1 (this stage), Lc, ...]
        return jax.lax.psum(outputs, PIPE), acc  # only the last stage wrote non-zero outputs

    act_spec = P(None, BATCH_AXES)
    fp8_in = {} if fp8 is None else fp8
    out, stats = jax.shard_map(
        body, mesh=mesh, in_specs=(param_specs, act_spec, P(None, PIPE), act_spec), out_specs=(act_spec, P(None, PIPE)),
        axis_names=manual,
    )(layers, micro, fp8_in, micro_docs)
    # [R, P, Lc, ...] -> [L_units, ...]: chunk v = rep * P + stage holds units v*Lc .. (v+1)*Lc - 1
    stats = {k: v.reshape(-1, *v.shape[3:])[:schedule.units or None] for k, v in stats.items()}
    return out.swapaxes(0, 1).reshape(b, t, d), stats  # [M, B/M, T, D] -> [B, T, D]


def make_pipelined_apply(
    model: Transformer, schedule: Schedule, mesh: jax.sharding.Mesh, layer_specs: Any
) -> Callable[[Any, jax.Array], jax.Array]:
    """(params with stage-layout 'layers', tokens [B, T], targets [B, T], FP8 collection or None,
    packed documents: segment_ids, positions, loss_mask [B, T] or None) -> (mean cross-entropy,
    MoE stats). The FP8 state stays layer-major in the train state (it is
    small and replicated); it is reshaped to the stage layout here, inside the loss."""

    def apply(params: Any, tokens: jax.Array, targets: jax.Array, fp8: Any = None, segment_ids: Any = None,
              positions: Any = None, loss_mask: Any = None) -> tuple[jax.Array, dict]:
        outer = {k: v for k, v in params.items() if k != "layers"}
        fp8 = fp8 or {}
        outer_vars = {"params": outer}
        if fp8.get("logits") is not None or fp8.get("embed") is not None:
            outer_vars[FP8_COLLECTION] = {k: v for k, v in fp8.items() if k != "layers"}
        x = model.apply(outer_vars, tokens, method=Transformer.embed_tokens)
        stack_fp8 = to_stages(fp8["layers"], schedule, fill=padding_value) if "layers" in fp8 else None
        docs = None if segment_ids is None else (segment_ids, positions)
        x, stats = run_pipeline(model, schedule, mesh, params["layers"], layer_specs, x, stack_fp8, docs)
        # The head runs on the whole batch: a packed batch's loss is the mean over all its kept tokens
        return model.apply(outer_vars, x, targets, loss_mask, method=Transformer.head_loss), stats

    return apply
