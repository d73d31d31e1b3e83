"""The process group of a job and the object collectives a strategy offers (as Lightning's parallel strategies do)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only


def init_process_group(
    environment: ClusterEnvironment,
    node_rank: int,
    local_rank: int,
    ranks_per_node: int,
    num_nodes: int,
    device: torch.device,
    backend: str | None,
    timeout: timedelta | None,
) -> str:
    """Set the world ranks on ``environment`` (node by node), then initialise the default process group.

    Returns:
        The backend used: ``backend``, or ``nccl`` on CUDA and ``gloo`` on CPU.
    """
    reset_seed()
    environment.set_global_rank(node_rank * ranks_per_node + local_rank)
    environment.set_world_size(num_nodes * ranks_per_node)
    rank_zero_only.rank = utils_rank_zero_only.rank = environment.global_rank()
    backend = backend or _get_default_process_group_backend_for_device(device)
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device if device.type != "cpu" else None)
    return backend


def barrier(device: torch.device) -> None:
    """Wait for every rank (on NCCL, on this rank's device)."""
    if not _distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (pickled)."""
    if not _distributed_is_initialized():
        return obj
    objects = [obj]
    dist.broadcast_object_list(objects, src)
    return objects[0]
