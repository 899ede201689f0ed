"""The `expert` axis: MoE slots moved to the devices that hold their experts and back.

Experts are sharded over `expert` (their hidden dimension over `tensor`); outside MoE layers the
batch is sharded over ('data', 'expert'), so `expert` is more data parallelism there. Routing,
dispatch into [G, E, C, D] slots and the combine are per sequence and need no communication;
between them the slots change owner: before the exchange a device holds all E experts' slots of
its own sequences, after it the slots of its E/ep experts from the ep devices of its `expert`
group. That is one `all_to_all` over `expert` each way, in a `shard_map` that is manual over the
batch axes (the partitioner, left to itself, was seen all-gathering instead: ANCHORS.md).

The exchange is the identity when `expert` has size 1. Inside a `shard_map` that is already
manual over `expert` (a pipeline stage), the collective runs directly on the local block.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from parallax.mesh import DATA, EXPERT
from parallax.moe import LOCAL, Exchange
from parallax.sharding import BATCH_AXES

# [G, E, C, D]: before, sequences over the batch axes; after, sequences over data, experts over expert.
_TOKEN_MAJOR = P(BATCH_AXES)
_EXPERT_MAJOR = P(DATA, EXPERT)


def _to_experts_local(x: jax.Array) -> jax.Array:
    # [g, E, C, D] -> [g * ep, E / ep, C, D]: split experts, gather the group's sequences
    return jax.lax.all_to_all(x, EXPERT, split_axis=1, concat_axis=0, tiled=True)


def _from_experts_local(x: jax.Array) -> jax.Array:
    # [g * ep, E / ep, C, D] -> [g, E, C, D]: the inverse
    return jax.lax.all_to_all(x, EXPERT, split_axis=0, concat_axis=1, tiled=True)


def _exchange(local, in_spec: P, out_spec: P):
    def move(x: jax.Array) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or EXPERT not in mesh.axis_names or mesh.shape[EXPERT] == 1:
            return x
        if EXPERT in mesh.manual_axes:  # already inside a shard_map over expert (pipeline stage)
            return local(x)
        return jax.shard_map(local, mesh=mesh, in_specs=in_spec, out_specs=out_spec, axis_names=set(BATCH_AXES))(x)

    return move


EXPERT_EXCHANGE = Exchange(_exchange(_to_experts_local, _TOKEN_MAJOR, _EXPERT_MAJOR),
                           _exchange(_from_experts_local, _EXPERT_MAJOR, _TOKEN_MAJOR))

__all__ = ["EXPERT_EXCHANGE", "LOCAL"]
