"""The process group of a job and the object collectives a strategy offers (as Lightning's parallel strategies do)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
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
from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.processes.launchers import describe_launch
from fabric_hsdp.processes.rank_placement import check_rank_placement, gather_placements

if TYPE_CHECKING:
    from fabric_hsdp.processes.launchers import Launcher

_logger = logging.getLogger(__name__)
RENDEZVOUS_NOTICE = 30.0  # seconds a rank waits for the others in init_process_group before each node's first says so


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
    check_rank_placement(placements, ranks_per_node, launched_by)
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
    with _say_if_waiting(environment, num_nodes, ranks_per_node, local_rank, timeout):
        _init_dist_connection(environment, backend, timeout=timeout, device_id=device if bind else None)
    return backend


@contextmanager
def _say_if_waiting(
    environment: ClusterEnvironment, num_nodes: int, ranks_per_node: int, local_rank: int, timeout: timedelta | None
) -> Iterator[None]:
    """If the ranks have not all joined after ``RENDEZVOUS_NOTICE`` seconds, each node's local rank 0 says so, once.

    A node that never starts (a failed job step, a wrong address) leaves every other rank silent in
    ``init_process_group`` until the timeout; this names what they wait for, where, since when and until when.
    """
    started = datetime.now(timezone.utc)
    address = f"{environment.main_address}:{environment.main_port}"
    limit = timeout or timedelta(minutes=30)  # init_process_group's default

    def say() -> None:
        _logger.warning(
            "waiting since %s for all %d ranks of the job (%d node(s) x %d) to join at %s (the main address and"
            " port); a node or rank that did not start keeps the others waiting here until %s (timeout %s). Check"
            " that every node's launch started and can reach %s.",
            f"{started:%H:%M:%S} UTC",
            num_nodes * ranks_per_node,
            num_nodes,
            ranks_per_node,
            address,
            f"{started + limit:%H:%M:%S} UTC",
            limit,
            address,
        )

    timer = threading.Timer(RENDEZVOUS_NOTICE, say) if local_rank == 0 else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def choose_backend(device: torch.device, backend: str | None, cpu_offload: bool | Any) -> str:
    """The process group's backend: ``backend`` if given, else ``nccl`` on CUDA and ``gloo`` on CPU.

    With CPU offload on an accelerator, FSDP2 keeps the shards and gradients in CPU memory, and the collectives on
    them (replicas' broadcast, the gradient norm, full gathers for a save, rank 0 loads) need a CPU backend beside
    the accelerator's: ``"cpu:gloo,cuda:nccl"``, each tensor's collective served by its own device's backend.
    """
    from fabric_hsdp.setup.fsdp import offloads

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
