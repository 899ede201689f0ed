"""The optimizer: global-norm clipping, then AdamW (or Muon for the blocks' matrices) on a
learning-rate schedule.

Schedules (optim.schedule), each a linear warmup from 0 to train.lr over optim.warmup_steps, then:
- `cosine`: cosine decay to lr * min_lr_ratio, reached at count train.steps;
- `wsd` (warmup-stable-decay, as MiniCPM, MaxText's and torchtitan's): flat at lr, then the last
  `decay_fraction` of train.steps decays to lr * min_lr_ratio (reached at count train.steps, as
  the cosine's floor), `linear` or `1-sqrt` (lr * (1 - sqrt(progress)), Hägele et al. 2024);
- `constant`: flat at lr.
The count a schedule is read at is the optimizer's own (optax's ScaleByScheduleState.count), the
number of updates applied; a skipped non-finite step (train_step.py) does not advance it.

Weight decay applies to matmul kernels and the embedding only; norm scales are excluded (decaying
them towards zero fights the normalisation). The mask is decided by parameter name, not rank,
because the scanned stack gives every per-layer vector a leading `layers` dimension.

Muon (optim.name=muon; Jordan et al. 2024, Liu et al. 2025): the matmul kernels of the blocks
(attention q/k/v and output, MLP and expert projections) take Nesterov momentum orthogonalised by
Newton-Schulz (optax.contrib.scale_by_muon), scaled to the RMS optim.muon_rms, with decoupled
weight decay; the embedding, the output projection, the norms and the router take AdamW, as
Moonlight and torchtitan split it. Which axes of a kernel form its matrix is read from its
logical axis names (`muon_dimensions`): one owner for the split, also for pipelined stacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import Config, ConfigError, check_optim

DECAYED = ("kernel", "embedding")

# Logical axes that index separate matrices of one parameter (the layer stack, pipeline stage and
# repeat, the experts) or a fused slot (q/k/v of the attention kernel, gate/up of the MLP's):
# Muon orthogonalises each such matrix on its own.
MATRIX_BATCH_AXES = frozenset({"layers", "stage", "repeat", "exp", None})
# A kernel reading or writing one of these is a block's matmul (Muon); `vocab` and the router's
# expert scores are not.
BLOCK_AXES = frozenset({"heads", "kv_heads", "kv", "mlp"})


def wsd_boundaries(cfg: Config) -> tuple[int, int, int]:
    """(warmup end, decay start, decay length) of the wsd schedule, in optimizer counts. The decay
    is round(decay_fraction * steps) counts (at least 1) ending at count train.steps; a warmup
    longer than the stable phase shortens the decay instead of overlapping it."""
    steps = cfg.train.steps
    warmup = min(cfg.optim.warmup_steps, steps)
    start = max(warmup, steps - max(1, round(cfg.optim.decay_fraction * steps)))
    return warmup, start, max(steps - start, 1)


def _one_minus_sqrt(peak: float, end: float, length: int) -> optax.Schedule:
    # optax has no 1-sqrt shape (its polynomial_schedule is (1 - x)^p, not 1 - x^p)
    def schedule(count: jax.Array) -> jax.Array:
        progress = jnp.clip(count / length, 0.0, 1.0)
        return end + (peak - end) * (1.0 - jnp.sqrt(progress))

    return schedule


def make_lr_schedule(cfg: Config) -> optax.Schedule:
    """The learning rate by optimizer count (the number of updates applied before this one)."""
    t, o = cfg.train, cfg.optim
    warmup = min(o.warmup_steps, t.steps)
    end = t.lr * o.min_lr_ratio
    if o.schedule == "constant":
        # not optax.warmup_constant_schedule: with warmup_steps=0 it is 0 at every count (a
        # linear_schedule of no steps holds its init_value); join_schedules skips a 0-count phase
        return optax.join_schedules([optax.linear_schedule(0.0, t.lr, warmup), optax.constant_schedule(t.lr)], [warmup])
    if o.schedule == "wsd":
        warmup, start, length = wsd_boundaries(cfg)
        decay = (optax.linear_schedule(t.lr, end, length) if o.decay_shape == "linear"
                 else _one_minus_sqrt(t.lr, end, length))
        return optax.join_schedules(
            [optax.linear_schedule(0.0, t.lr, warmup), optax.constant_schedule(t.lr), decay], [warmup, start])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1),
        end_value=end,
    )


def applied_count(opt_state: Any) -> jax.Array:
    """The count the schedule is read at by the next update: optax's ScaleByScheduleState.count
    (int32 []), which only advances when an update is applied (train_step.py's guard keeps the old
    state on a skipped step, so it can trail TrainState.step)."""
    counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
              if isinstance(s, optax.ScaleByScheduleState)]
    assert len(counts) == 1, f"expected one scheduled learning rate in the optimizer state, found {len(counts)}"
    return counts[0]


def decay_mask(params: Any) -> Any:
    def leaf_name(path) -> str:
        last = path[-1]
        return str(getattr(last, "key", getattr(last, "name", last)))

    return jax.tree_util.tree_map_with_path(lambda path, _: leaf_name(path) in DECAYED, params)


def muon_dimensions(names: tuple) -> optax.contrib.MuonDimensionNumbers | None:
    """The matrix Muon orthogonalises in a parameter with these logical axis names, or None (AdamW).
    A block kernel reads `embed` (q/k/v, MLP input: the reduction axis, the other named axes its
    output) or writes it (attention output, MLP output: the other named axes reduce); every axis in
    MATRIX_BATCH_AXES separates matrices. Axes are counted from the end, so a pipelined stack's
    leading stage axes change nothing."""
    names = tuple(names)
    if "embed" not in names or not BLOCK_AXES & set(names):
        return None
    matrix = [i - len(names) for i, n in enumerate(names) if n not in MATRIX_BATCH_AXES]
    first = names[matrix[0]]
    if first == "embed":
        return optax.contrib.MuonDimensionNumbers(reduction_axis=(matrix[0],), output_axis=tuple(matrix[1:]))
    return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]), output_axis=(matrix[-1],))


@dataclass(frozen=True)
class MatrixPath:
    """The layouts a Muon leaf's update passes through, from the optimizer state's layout (first)
    to the one its Newton-Schulz iterations run in (last), one mesh axis moved per step: the
    partitioner turns each step into one all-to-all (or all-gather) over that axis, where a jump
    of several axes at once is an "involuntary full rematerialization" (the whole leaf gathered).
    A leaf of the pytree it sits in."""

    steps: tuple[NamedSharding, ...]

    @property
    def final(self) -> NamedSharding:
        return self.steps[-1]


def muon_shardings(abstract: Any, logical_specs: Any, shardings: Any) -> Any:
    """Where the Muon momentum lives (MatrixPath per leaf): each leaf's matrices whole on a
    device, the matrices spread over the mesh. Newton-Schulz multiplies whole matrices (X X^T, then
    by X) five times; on the ZeRO/tensor layout of a kernel ([.., D/data, .., F/tensor]) the
    partitioner gathers each matrix inside the iterations and every device repeats the work. So the
    mesh axes on a leaf's matrix dimensions move, in mesh order, to its batch axes (layers,
    experts, q/k/v and gate/up slots: MATRIX_BATCH_AXES) where they divide them, beside the axes
    those have (pipe on the stage, expert on the experts): the state's bytes per device are the
    optimizer rules' (ZeRO's), only their place changes. An axis that divides no batch axis stays
    on the matrix (the partitioner gathers along it inside the iterations); an axis the state is
    not sharded over (data without ZeRO) is not used: its devices repeat the iterations, as DDP's.
    The step reshards each gradient along the path and the update back: all-to-alls of one
    gradient's bytes. AdamW's leaves: a path of their own layout alone."""

    def place(x: Any, spec: P, sharding: NamedSharding) -> MatrixPath:
        names = tuple(spec)
        dims = muon_dimensions(names)
        if dims is None:
            return MatrixPath((sharding,))
        mesh, ndim = sharding.mesh, len(names)
        matrix = {a % ndim for a in (*dims.reduction_axis, *dims.output_axis)}
        have = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        axes = [() if h is None else (h if isinstance(h, tuple) else (h,)) for h in have]
        steps = [sharding]
        for axis in (a for a in mesh.axis_names if any(a in axes[i] for i in matrix)):
            to = next((i for i in range(ndim) if i not in matrix
                       and (x.shape[i] // math.prod(mesh.shape[a] for a in axes[i])) % mesh.shape[axis] == 0), None)
            if to is None:
                continue  # divides no batch axis: stays on the matrix (gathered inside the iterations)
            axes = [tuple(a for a in dim if a != axis) for dim in axes]
            axes[to] = (*axes[to], axis)
            steps.append(NamedSharding(mesh, P(*(d if len(d) > 1 else (d[0] if d else None) for d in axes))))
        return MatrixPath(tuple(steps))

    return jax.tree.map(place, abstract, logical_specs, shardings)


def _reshard(paths: Any, forward: bool) -> optax.GradientTransformation:
    """Move the updates along each leaf's MatrixPath: `forward` into the Newton-Schulz layout,
    else back to the optimizer state's; MaskedNode leaves (AdamW's) pass."""

    def move(u: Any, path: MatrixPath) -> Any:
        if isinstance(u, optax.MaskedNode):
            return u
        for sharding in (path.steps[1:] if forward else path.steps[-2::-1]):
            u = jax.lax.with_sharding_constraint(u, sharding)
        return u

    def update(updates, state, params=None):
        del params
        return jax.tree.map(move, updates, paths, is_leaf=lambda x: isinstance(x, optax.MaskedNode)), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _scale_to_rms(dimensions: Any, rms: float) -> optax.GradientTransformation:
    """An orthogonalised [fan_in, fan_out] update has RMS 1/sqrt(max(fan_in, fan_out)); scaling by
    sqrt(max(fan_in, fan_out)) * rms gives every matrix AdamW's typical update RMS (Liu et al. 2025,
    eq. 4), so that Muon and AdamW share one learning rate."""

    def scale(u: jax.Array, d: optax.contrib.MuonDimensionNumbers) -> jax.Array:
        fan_in = np.prod([u.shape[a] for a in d.reduction_axis])
        fan_out = np.prod([u.shape[a] for a in d.output_axis])
        return u * (np.sqrt(max(fan_in, fan_out)) * rms)

    def update(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates, dimensions(updates),
                            is_leaf=lambda x: isinstance(x, optax.contrib.MuonDimensionNumbers)), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _muon(cfg: Config, logical_specs: Any, mu_dtype: Any, shardings: Any) -> optax.GradientTransformation:
    o = cfg.optim
    dims = jax.tree.map(lambda s: muon_dimensions(tuple(s)), logical_specs, is_leaf=lambda x: isinstance(x, P))
    # a MuonDimensionNumbers is a NamedTuple: a leaf here, not a node
    is_dims = lambda x: x is None or isinstance(x, (optax.contrib.MuonDimensionNumbers, optax.MaskedNode))  # noqa: E731
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=is_dims)

    def muon_dims(updates: Any) -> Any:
        # the muon half's updates: the kernels it owns, MaskedNode where AdamW owns the leaf
        return jax.tree.map(lambda d, u: u if isinstance(u, optax.MaskedNode) else d, dims, updates, is_leaf=is_dims)

    muon = optax.chain(
        *([_reshard(shardings, forward=True)] if shardings is not None else []),
        optax.contrib.scale_by_muon(ns_steps=o.muon_ns_steps, beta=o.muon_beta, eps=o.eps, mu_dtype=mu_dtype,
                                    nesterov=True, weight_dimension_numbers=muon_dims),
        _scale_to_rms(muon_dims, o.muon_rms),
        *([_reshard(shardings, forward=False)] if shardings is not None else []),
        optax.add_decayed_weights(o.weight_decay),  # every Muon leaf is a kernel: all decayed
    )
    adam = optax.chain(optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps, mu_dtype=mu_dtype),
                       optax.add_decayed_weights(o.weight_decay, mask=decay_mask))
    # one learning rate after the partition: a single ScaleByScheduleState (applied_count), and
    # the same -lr * (update + wd * param) as optax.adamw for the AdamW half
    return optax.chain(optax.partition({"muon": muon, "adam": adam}, labels),
                       optax.scale_by_learning_rate(make_lr_schedule(cfg)))


def make_optimizer(cfg: Config, logical_specs: Any = None, muon_layout: Any = None) -> optax.GradientTransformation:
    """The optimizer of `cfg`. `logical_specs`: the parameters' logical axis names (a tree of
    PartitionSpec, as train_state.make_layout has them), which Muon needs to tell its matrices;
    `muon_layout`: muon_shardings' tree, the layout its momentum is computed in (None: wherever
    the partitioner puts it)."""
    check_optim(cfg)
    o = cfg.optim
    # None keeps the parameters' float32 (the default, numerically as before this field existed)
    mu_dtype = jnp.bfloat16 if o.mu_dtype == "bfloat16" else None
    if o.name == "muon":
        if logical_specs is None:
            raise ConfigError("optim.name='muon' needs the parameters' logical axis names "
                              "(make_optimizer(cfg, logical_specs)) to tell its matrices")
        opt = _muon(cfg, logical_specs, mu_dtype, muon_layout)
    else:
        opt = optax.adamw(make_lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                          mask=decay_mask, mu_dtype=mu_dtype)
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), opt)
    return opt
