"""`build(cfg)`: the mesh, the parallelism checked against it, the layout and the step factories.

This is the one place in the package that goes mesh -> the layout rules -> `make_layout`: the
training run, `parallax audit`, the planner's verification and the benchmarks all start here, so
no layout is made from a config whose rules were not checked. `devices` picks the devices the mesh
spans (compile-only TPU/GPU devices, one device for a benchmark); None means every device.
Nothing is initialised: the state is abstract until `train_state.init_state` or a restore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from parallax.config import Config
from parallax.parallel.fused_attention import require_kernel
from parallax.parallel.mesh import AXES, DATA, EXPERT, PIPE, TENSOR, describe, make_mesh
from parallax.model.transformer import Transformer
from parallax.parallelism import Parallelism, Schedule
from parallax.train.train_state import Layout, TrainState, make_layout
from parallax.train import train_step as steps


@dataclass(frozen=True)
class Build:
    """A config laid out on a mesh: what a run, an audit or a benchmark needs before any array exists."""

    cfg: Config
    mesh: jax.sharding.Mesh
    parallelism: Parallelism  # the rules checked on the mesh's sizes and platform
    layout: Layout

    @property
    def batch_shards(self) -> int:
        """Batch shards: data x expert (outside MoE layers `expert` is more data parallelism)."""
        return self.parallelism.batch_shards

    @property
    def schedule(self) -> Schedule | None:
        """The pipeline schedule the layout runs; None when the stack is not pipelined."""
        return self.layout.schedule

    @property
    def pipelined(self) -> bool:
        return self.parallelism.pipelined

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    @property
    def device_kind(self) -> str:
        return self.mesh.devices.flat[0].device_kind

    @property
    def n_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def batch_sharding(self) -> NamedSharding:
        return steps.batch_sharding(self.mesh)

    def train_step(self) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
        """The jitted train step (train_step.make_train_step): a fresh one each call. Looked up on
        the module when called, so that a test can stand in for it (tests/test_robustness.py)."""
        return steps.make_train_step(self.cfg, self.layout)

    def eval_step(self) -> Callable[[Any, dict, Any], jax.Array]:
        return steps.make_eval_step(self.layout)

    def abstract_state(self) -> TrainState:
        """The state as ShapeDtypeStructs carrying their shardings: lowers a step with nothing initialised."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            self.layout.abstract_state, self.layout.state_shardings)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """'inputs', 'targets' (packed documents, data.eod_id >= 0: and data.DOC_KEYS): [B, T]
        int32, sharded over the batch axes."""
        from parallax.train.data import DOC_KEYS

        shape = (self.cfg.train.global_batch, self.cfg.train.seq_len)
        keys = ("inputs", "targets") + (DOC_KEYS if self.cfg.data.eod_id >= 0 else ())
        return {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=self.batch_sharding) for k in keys}

    def params_per_device(self) -> int:
        """Parameters one device holds: each leaf's shard shape under its sharding."""
        leaves = zip(jax.tree.leaves(self.layout.abstract_state.params), jax.tree.leaves(self.layout.param_shardings))
        return sum(math.prod(sharding.shard_shape(leaf.shape)) for leaf, sharding in leaves)

    def describe(self) -> list[str]:
        """The mesh and what each axis carries, one line per axis (printed when a run starts)."""
        cfg = self.cfg
        zero = {0: "", 1: "; ZeRO-1 optimizer state on embed", 3: "; ZeRO-3 params + optimizer state on embed"}
        roles = {
            DATA: "batch" + zero[cfg.parallel.zero],
            TENSOR: "heads, kv_heads, mlp, vocab (Megatron column/row split)",
            PIPE: f"pipeline stages; {cfg.parallel.schedule}, {cfg.parallel.microbatches} microbatches, "
                  f"{cfg.parallel.repeats} chunk(s) per stage",
            EXPERT: f"{cfg.model.moe.num_experts} experts (all_to_all in each MoE layer); batch outside MoE layers",
        }
        lines = [f"mesh: {describe(self.mesh)}"]
        for a in AXES:
            role = roles[a] if self.mesh.shape[a] > 1 else "-"
            lines.append(f"  {a:<7}{self.mesh.shape[a]:>4}  {role}")
        return lines


def build(cfg: Config, devices: list[jax.Device] | None = None, model: Transformer | None = None) -> Build:
    """Mesh over `devices` (None: all), the config's rules checked on its sizes and platform
    (parallelism.Parallelism; raises config.ConfigError naming the field), then the layout.
    `model`: a Transformer other than the one the config describes (a benchmark's variant), laid
    out the same way."""
    mesh = make_mesh(cfg.mesh, devices)
    par = Parallelism.of_mesh(cfg, mesh)
    require_kernel(par.attention)  # cuDNN's library, before anything is traced
    return Build(cfg, mesh, par, make_layout(cfg, mesh, par, model=model))
