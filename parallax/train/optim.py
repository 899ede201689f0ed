"""The optimizer: global-norm clipping, then AdamW on a learning-rate schedule.

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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from parallax.config import Config, check_optim

DECAYED = ("kernel", "embedding")


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


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    check_optim(cfg)
    o = cfg.optim
    # None keeps the parameters' float32 (the default, numerically as before this field existed)
    mu_dtype = jnp.bfloat16 if o.mu_dtype == "bfloat16" else None
    adamw = optax.adamw(make_lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=decay_mask, mu_dtype=mu_dtype)
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw)
    return adamw
