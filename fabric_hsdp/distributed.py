"""The process group of a job and the object collectives a strategy offers (as Lightning's parallel strategies do)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

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

from fabric_hsdp import versions
from fabric_hsdp.launchers import describe_launch
from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.rank_layout import check_rank_layout, gather_placements

if TYPE_CHECKING:
    from fabric_hsdp.launchers import Launcher

_logger = logging.getLogger(__name__)


def start_processes(
    environment: ClusterEnvironment,
    launched_by: Launcher,
    device: torch.device,
    *,
    num_nodes: int,
    ranks_per_node: int,
    backend: str | None,
    timeout: timedelta | None,
    cpu_offload: bool | Any = False,
) -> str:
    """Initialise the process group (:func:`init_process_group`), log how the job was launched, and check that every
    rank sits where the launcher's layout says (one error on every rank otherwise). Returns the backend used."""
    node_rank, local_rank = environment.node_rank(), environment.local_rank()
    backend = init_process_group(
        environment,
        node_rank=node_rank,
        local_rank=local_rank,
        ranks_per_node=ranks_per_node,
        num_nodes=num_nodes,
        device=device,
        backend=backend,
        timeout=timeout,
        cpu_offload=cpu_offload,
    )
    info_on_rank_zero(_logger, "%s", describe_launch(launched_by, environment))
    placements = gather_placements(environment.global_rank(), node_rank, local_rank)
    check_rank_layout(placements, ranks_per_node, launched_by)
    return backend


def init_process_group(
    environment: ClusterEnvironment,
    node_rank: int,
    local_rank: int,
    ranks_per_node: int,
    num_nodes: int,
    device: torch.device,
    backend: str | None,
    timeout: timedelta | None,
    cpu_offload: bool | Any = False,
) -> str:
    """Set the world ranks on ``environment`` (node by node), then initialise the default process group.

    Returns:
        The backend used: see :func:`choose_backend`.
    """
    reset_seed()
    environment.set_global_rank(node_rank * ranks_per_node + local_rank)
    environment.set_world_size(num_nodes * ranks_per_node)
    rank_zero_only.rank = utils_rank_zero_only.rank = environment.global_rank()
    backend = choose_backend(device, backend, cpu_offload)
    bind = device.type != "cpu" and versions.may_bind_device(backend)
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device if bind else None)
    return backend


def choose_backend(device: torch.device, backend: str | None, cpu_offload: bool | Any) -> str:
    """The process group's backend: ``backend`` if given, else ``nccl`` on CUDA and ``gloo`` on CPU.

    With CPU offload on an accelerator, FSDP2 keeps the shards and gradients in CPU memory, and the collectives on
    them (replicas' broadcast, the gradient norm, full gathers for a save, rank 0 loads) need a CPU backend beside
    the accelerator's: ``"cpu:gloo,cuda:nccl"``, each tensor's collective served by its own device's backend.
    """
    from fabric_hsdp.fsdp import offloads

    if backend:
        return backend
    default = _get_default_process_group_backend_for_device(device)
    if offloads(cpu_offload) and device.type != "cpu" and ":" not in default:
        return f"cpu:gloo,{device.type}:{default}"
    return default


def barrier(device: torch.device) -> None:
    """Wait for every rank (on NCCL, on this rank's device)."""
    if not _distributed_is_initialized():
        return
    if "nccl" in str(dist.get_backend()):  # "nccl", or "cpu:gloo,cuda:nccl" under CPU offload
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
