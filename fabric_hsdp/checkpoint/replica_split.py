"""Read each shard of a sharded checkpoint once, not once per replica.

Under HSDP every replica (a node, or a group of nodes) holds the same shards, so a plain DCP load reads the whole
checkpoint once per replica: R replicas make the shared filesystem serve R copies. Here each tensor sharded as
``(Replicate(), Shard(0))`` on the strategy's mesh, with rows that split evenly into ``replicate x shard`` parts, is
read in ``1/R`` slices: the replica at ``replicate`` index ``r`` reads part ``r`` of its shard, through a DTensor
view of the shard on a flat mesh ordered shard-major (position ``shard * R + r``), so DCP's planner maps the slice to
the right rows. An all-gather along ``replicate`` then puts the whole shard on every replica. The filesystem serves
one copy of the checkpoint; the other ``R - 1`` travel over the network, once per shard.

Tensors that do not split evenly, are not sharded that way, or live on another device than the mesh's (CPU offload
on CUDA) are read whole, as DCP would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _Split:
    container: dict
    key: Any
    original: Any  # the DTensor of the whole local shard
    part: torch.Tensor  # this rank's rows of it (a view), filled by the load


def replica_parts(state: dict[str, Any], mesh: Any) -> tuple[dict[str, Any], list[_Split]]:
    """A copy of the nested ``state`` whose evenly divisible HSDP tensors are replaced by this rank's ``1/R`` part.

    Returns:
        The copy to pass to ``dcp.load``, and the parts to hand to :func:`gather_and_restore` afterwards.
    """
    if mesh.ndim != 2 or mesh.size(0) == 1:
        return state, []
    from torch.distributed.device_mesh import DeviceMesh

    replicas, shards = mesh.size(0), mesh.size(1)
    # the flat mesh's position p = shard * R + r holds rows [p, p + 1) * rows / (R * S): part r of shard `shard`
    flat = DeviceMesh(mesh.device_type, mesh.mesh.t().flatten(), _init_backend=False)
    replica_index = mesh.get_local_rank(0)
    splits: list[_Split] = []

    def visit(node: Any) -> Any:
        if isinstance(node, dict):
            copy = {}
            for key, value in node.items():
                copy[key] = visit(value)
                part = _part(value, mesh, flat, replicas, shards, replica_index)
                if part is not None:
                    copy[key] = part
                    splits.append(_Split(copy, key, value, part.to_local()))
            return copy
        if isinstance(node, list):
            return [visit(value) for value in node]
        return node

    return visit(state), splits


def _part(value: Any, mesh: Any, flat: Any, replicas: int, shards: int, replica_index: int) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor) or value.device_mesh != mesh:
        return None
    if tuple(value.placements) != (Replicate(), Shard(0)) or value.ndim == 0:
        return None
    local = value.to_local()
    rows = value.shape[0]
    if rows % (replicas * shards) or not local.is_contiguous() or local.device.type != mesh.device_type:
        return None
    part_rows = rows // (replicas * shards)
    part = local.narrow(0, replica_index * part_rows, part_rows)
    return DTensor.from_local(part, flat, [Shard(0)], run_check=False, shape=value.shape, stride=value.stride())


def gather_and_restore(splits: list[_Split], mesh: Any) -> None:
    """All-gather each part along ``replicate`` into its whole shard; put the original tensors back in the copy."""
    if not splits:
        return
    group = mesh.get_group("replicate")
    for split in splits:
        whole = split.original.to_local()
        dist.all_gather_into_tensor(whole, split.part.clone(), group=group)
        split.container[split.key] = split.original
