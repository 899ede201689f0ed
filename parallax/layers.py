"""Building blocks: Dense with an injectable dot_general, Embed, RMSNorm, SwiGLU MLP.

Single-device math annotated with logical axis names only; sharding.py decides where they live.
Parameters are float32 (master weights); compute happens in `dtype`.

Parameters pass through `constrain_param` where they are used: under ZeRO-3 that is where they
are all-gathered from their storage layout to their compute layout (see sharding.py).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from parallax.sharding import constrain, constrain_param

# A factory returning a Flax module with lax.dot_general's signature (e.g. an FP8 op that keeps
# its scaling state in its own collection). None means plain jax.lax.dot_general.
DotGeneralFactory = Callable[[], nn.Module] | None


def _dot_general(factory: DotGeneralFactory) -> Callable[..., jax.Array]:
    return jax.lax.dot_general if factory is None else factory()


class Dense(nn.Module):
    """y = x . W over the last `contract` dims of x; W has logical names `axes`."""

    features: tuple[int, ...]
    axes: tuple[str, ...]  # logical names of the kernel: contracted input dims, then features
    contract: int = 1
    init_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[x.ndim - self.contract :]
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.axes),
            (*in_shape, *self.features),
            jnp.float32,
        )
        kernel = constrain_param(kernel, self.axes, self.dtype)  # ZeRO-3: all-gather here, in self.dtype
        lhs_dims = tuple(range(x.ndim - self.contract, x.ndim))
        dims = ((lhs_dims, tuple(range(self.contract))), ((), ()))
        return _dot_general(self.dot_general)(
            x.astype(self.dtype), kernel.astype(self.dtype), dims, preferred_element_type=self.dtype
        )


class Embed(nn.Module):
    """Token embedding [V, D]; `attend` reuses it as the tied output projection.

    `dot_general` serves `attend` only: the lookup's one-hot matmul selects rows exactly, and an
    FP8 (or any approximate) matmul there would only round the table itself.
    """

    vocab_size: int
    d_model: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), ("vocab", "embed")),
            (self.vocab_size, self.d_model),
            jnp.float32,
        )
        self.attend_dot_general = _dot_general(self.dot_general)  # a submodule must be made in setup

    @property
    def table(self) -> jax.Array:
        return constrain_param(self.embedding, ("vocab", "embed"), self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # [B, T] -> [B, T, D]. A one-hot matmul rather than a gather: with `vocab` sharded over
        # `tensor` it partitions as local partial sums plus one all-reduce of [B, T, D] (Megatron's
        # vocab-parallel embedding) instead of an all-gather of the whole table.
        one_hot = jax.nn.one_hot(tokens, self.vocab_size, dtype=self.dtype)
        one_hot = constrain(one_hot, ("activation_batch", "activation_length", "activation_vocab"))
        dims = (((2,), (0,)), ((), ()))
        return jax.lax.dot_general(one_hot, self.table.astype(self.dtype), dims, preferred_element_type=self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        # [B, T, D] x [V, D] -> [B, T, V]
        dims = (((2,), (1,)), ((), ()))
        return self.attend_dot_general(
            x.astype(self.dtype), self.table.astype(self.dtype), dims, preferred_element_type=self.dtype
        )


class RMSNorm(nn.Module):
    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (x.shape[-1],), jnp.float32
        )
        scale = constrain_param(scale, ("embed",))
        # Statistics in float32 whatever the compute dtype.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


class MLP(nn.Module):
    """SwiGLU: (silu(x W0) * (x W1)) W2; F sharded over tensor (column then row parallel)."""

    d_ff: int
    init_std: float = 0.02
    out_std: float = 0.02
    dtype: Any = jnp.float32
    dot_general: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        # Gate and up projections fused into one [D, 2, F] kernel: one matmul, so the backward
        # pass all-reduces one input-gradient partial sum over tensor instead of two.
        gate_up = Dense(
            (2, self.d_ff), ("embed", None, "mlp"), init_std=self.init_std, dtype=self.dtype,
            dot_general=self.dot_general, name="wi",
        )(x)  # [B, T, D] -> [B, T, 2, F]
        h = nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))  # [B, T, F]
        return Dense(
            (d_model,), ("mlp", "embed"), init_std=self.out_std, dtype=self.dtype,
            dot_general=self.dot_general, name="wo",
        )(h)  # [B, T, D]
