"""The rank layout check: ranks numbered across nodes (srun --distribution=cyclic, mpirun --map-by node) stop setup."""

from __future__ import annotations

import os

import pytest

from fabric_hsdp.processes.launchers import Launcher
from fabric_hsdp.processes.rank_placement import Placement, check_rank_placement
from tests.helpers.launch import launch
from tests.helpers.training import make_fabric


def _placements(hosts: list[str], node_ranks: list[int]) -> list[Placement]:
    return [Placement(rank, host, node, 0) for rank, (host, node) in enumerate(zip(hosts, node_ranks))]


def test_ranks_numbered_node_by_node_pass():
    check_rank_placement(_placements(["a", "a", "b", "b"], [0, 0, 1, 1]), ranks_per_node=2)
    check_rank_placement(_placements(["h"] * 4, [0, 0, 1, 1]), ranks_per_node=2)  # simulated nodes on one host
    check_rank_placement(_placements(["a", "a", "a", "a"], [0, 0, 0, 0]), ranks_per_node=4)
    check_rank_placement(_placements(["a"], [0]), ranks_per_node=1)
    check_rank_placement(_placements(["a", "a", "b", "b"], [0, 0, 0, 0]), ranks_per_node=2)  # the hosts decide


@pytest.mark.parametrize(
    ("hosts", "node_ranks", "ranks_per_node"),
    [
        (["a", "b", "a", "b"], [0, 1, 0, 1], 2),  # srun --distribution=cyclic
        (["h"] * 4, [0, 1, 0, 1], 2),  # the same, simulated on one host
        (["a", "a", "b", "b", "a", "a", "b", "b"], [0, 0, 1, 1, 0, 0, 1, 1], 4),  # blocks of 2 dealt round-robin
        (["a", "b", "a", "b"], [0, 0, 0, 0], 2),  # one node rank on two hosts: the hosts decide
    ],
)
def test_ranks_numbered_across_nodes_are_refused_with_the_launch_fix(hosts, node_ranks, ranks_per_node):
    placements = _placements(hosts, node_ranks)
    with pytest.raises(ValueError, match=r"numbered the global ranks across nodes") as error:
        check_rank_placement(placements, ranks_per_node, Launcher("srun"))
    assert f"ranks 0..{ranks_per_node - 1} on one node of their own" in str(error.value)
    assert "srun --distribution=block" in str(error.value)


def test_cyclic_numbering_fails_every_rank_at_setup():
    # each rank's own traceback (without FABRIC_HSDP_DEBUG rank 0 says it in one line: tests/test_errors.py)
    result = launch(
        torchrun_numbering,
        {"cyclic": True},
        timeout=240,
        env={"FABRIC_HSDP_DEBUG": "1"},
    )
    assert result.returncodes == [1, 1, 1, 1], result.returncodes
    for rank in result.ranks:
        assert "numbered the global ranks across nodes" in rank.stderr, rank.stderr[-2000:]
        assert "(node rank 0): ranks [0, 2]" in rank.stderr and "(node rank 1): ranks [1, 3]" in rank.stderr
        assert "torchrun numbers node by node" in rank.stderr


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# The rank layout check: a launcher that numbers ranks round-robin over the nodes.


def torchrun_numbering(num_nodes: int, devices: int, cyclic: bool) -> dict:
    """Start as torchrun would, with global ranks dealt round-robin over the nodes (``cyclic``) or node by node."""
    node_rank, local_rank = int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"])
    rank = local_rank * num_nodes + node_rank if cyclic else node_rank * devices + local_rank
    os.environ.update(
        TORCHELASTIC_RUN_ID="rank-layout", RANK=str(rank), GROUP_RANK=str(node_rank), LOCAL_WORLD_SIZE=str(devices)
    )
    fabric = make_fabric(num_nodes, devices, tensor_parallel_size=2)
    return {"global_rank": fabric.global_rank, "coordinates": fabric.strategy.topology.coordinates(fabric.global_rank)}
