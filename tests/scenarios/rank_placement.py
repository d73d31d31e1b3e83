"""Scenarios for the rank layout check: a launcher that numbers ranks round-robin over the nodes."""

from __future__ import annotations

import os

from tests.helpers.training import make_fabric


def torchrun_numbering(num_nodes: int, devices: int, cyclic: bool) -> dict:
    """Start as torchrun would, with global ranks dealt round-robin over the nodes (``cyclic``) or node by node."""
    node_rank, local_rank = int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"])
    rank = local_rank * num_nodes + node_rank if cyclic else node_rank * devices + local_rank
    os.environ.update(
        TORCHELASTIC_RUN_ID="rank-layout", RANK=str(rank), GROUP_RANK=str(node_rank), LOCAL_WORLD_SIZE=str(devices)
    )
    fabric = make_fabric(num_nodes, devices, tensor_parallel_size=2)
    return {"global_rank": fabric.global_rank, "coordinates": fabric.strategy.topology.coordinates(fabric.global_rank)}
