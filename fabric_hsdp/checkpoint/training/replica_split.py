"""Read each shard of a sharded checkpoint once, not once per replica.

Under HSDP every replica (a node, or a group of nodes) holds the same shards, so a plain DCP load reads the whole
checkpoint once per replica: R replicas make the shared filesystem serve R copies. Here every tensor that is
replicated along ``replicate`` and whose local rows split evenly into R parts is read in ``1/R`` slices: the replica
at ``replicate`` index ``r`` reads rows ``[r L/R, (r+1) L/R)`` of its local shard (the boxes of the stored tensor
they hold, :mod:`fabric_hsdp.checkpoint.core.boxes`), and an all-gather along ``replicate`` then puts the whole shard on
every replica. The filesystem serves one copy of the checkpoint; the other ``R - 1`` travel over the network, once
per shard. This works the same on the 2-D mesh and on the 3-D mesh of tensor parallelism, regrouped rows included.

Tensors whose rows do not split evenly, or that live on another device than the mesh's (CPU offload on CUDA), are
read whole, as DCP would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fabric_hsdp.checkpoint.core import boxes
from fabric_hsdp.models.fused_rows import FusedRows
from fabric_hsdp.topology import REPLICATE_DIM

if TYPE_CHECKING:
    from fabric_hsdp.topology import ParallelMesh


@dataclass
class Split:
    """A local shard that is read in parts: ``part`` (a view of this rank's rows of ``local``) is what is read."""

    local: torch.Tensor
    part: torch.Tensor


def replica_parts(
    state: dict[str, Any], mesh: ParallelMesh, fused: dict[str, FusedRows]
) -> tuple[dict[str, Any], list[boxes.Replaced], list[Split]]:
    """A DCP view of ``state`` (model and optimizer state dicts) that reads this rank's ``1/R`` part of each shard.

    Args:
        state: The state dicts to load into, by key.
        mesh: The strategy's mesh.
        fused: The parameters whose rows tensor parallelism regrouped (read in the checkpoint's order either way).

    Returns:
        The view to pass to ``dcp.load``, what it replaced (see
        :func:`~fabric_hsdp.checkpoint.core.boxes.dcp_view`), and the parts to hand to :func:`gather` afterwards.
    """
    splits: list[Split] = []

    def read_part(param: str | None, tensor: torch.Tensor) -> boxes.StoredBoxes | None:
        rows = raw_part(tensor, mesh, splits)
        if rows is None:
            return boxes.regrouped_boxes(param, tensor, fused)  # read whole, as a load without split reads does
        return boxes.boxes_of(tensor, fused.get(param), rows)

    view, replaced = boxes.dcp_view(state, read_part)
    return view, replaced, splits


def raw_part(tensor: torch.Tensor, mesh: ParallelMesh, splits: list[Split]) -> tuple[int, int] | None:
    """The local rows ``(start, stop)`` of ``tensor`` this replica reads (raw and sharded loads), noted in ``splits``
    for :func:`gather`; ``None`` when it reads its whole shard (not replicated, or rows that do not split evenly)."""
    from torch.distributed.tensor import DTensor

    replicas = mesh.topology.replicate_size
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if not _splits(tensor, local, mesh, replicas):
        return None
    rows = local.shape[0] // replicas
    replica = mesh.replicate.get_local_rank()
    start, stop = replica * rows, (replica + 1) * rows
    splits.append(Split(local, local[start:stop]))
    return start, stop


def _splits(tensor: torch.Tensor, local: torch.Tensor, mesh: ParallelMesh, replicas: int) -> bool:
    from torch.distributed.tensor import DTensor

    return (
        replicas > 1
        and isinstance(tensor, DTensor)
        and tensor.ndim > 0
        and REPLICATE_DIM in mesh.replicated_dims(tensor)
        and local.is_contiguous()
        and local.shape[0] > 0
        and local.shape[0] % replicas == 0
        and local.device.type == mesh.device_mesh.device_type
    )


def gather(splits: list[Split], mesh: ParallelMesh | None) -> None:
    """All-gather each part along ``replicate`` into its whole local shard."""
    if not splits or mesh is None:
        return
    group = mesh.replicate.get_group()
    for split in splits:
        dist.all_gather_into_tensor(split.local, split.part.clone(), group=group)
