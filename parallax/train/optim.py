"""The optimizer: global-norm clipping, then AdamW on a warmup + cosine schedule.

Weight decay applies to matmul kernels and the embedding only; norm scales are excluded (decaying
them towards zero fights the normalisation). The mask is decided by parameter name, not rank,
because the scanned stack gives every per-layer vector a leading `layers` dimension.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from parallax.config import Config

DECAYED = ("kernel", "embedding")


def make_lr_schedule(cfg: Config) -> optax.Schedule:
    """The learning rate by step: linear warmup, then cosine decay to lr * min_lr_ratio."""
    t = cfg.train
    warmup = min(cfg.optim.warmup_steps, t.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1),
        end_value=t.lr * cfg.optim.min_lr_ratio,
    )


def decay_mask(params: Any) -> Any:
    def leaf_name(path) -> str:
        last = path[-1]
        return str(getattr(last, "key", getattr(last, "name", last)))

    return jax.tree_util.tree_map_with_path(lambda path, _: leaf_name(path) in DECAYED, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    adamw = optax.adamw(
        make_lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask
    )
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw)
    return adamw
