"""Where the ranks run: the mesh assumes global ranks numbered node by node; check it once every rank is up.

:class:`~fabric_hsdp.topology.Topology` puts ranks ``k * M .. k * M + M - 1`` (``M`` ranks per node) on node
``k``: tensor-parallel peers are consecutive ranks, a ``"node"`` shard group is one such block. The launcher's numbering
stands, though (Lightning's environments for torchrun, SLURM, MPI and LSF ignore ``set_global_rank``), and ``srun
--distribution=cyclic``, ``mpirun --map-by node`` or ``jsrun -d cyclic`` deal ranks out round-robin: the groups would
span nodes and every layer's collectives cross the slow network, silently. Every rank exchanges its host and node
rank after the process group exists, and every rank raises the same error when a block is not one node.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist

from fabric_hsdp.processes.launchers import FABRIC_RUN, JSRUN, MPIRUN, SRUN, TORCHRUN, Launcher

_FIXES = {
    SRUN: "srun --distribution=block (SLURM's default: drop --distribution=cyclic, or unset SLURM_DISTRIBUTION)",
    MPIRUN: "mpirun --map-by slot (Open MPI: not --map-by node; MPICH/Intel MPI: -ppn M, not -rr)",
    JSRUN: "jsrun -d packed (not -d cyclic)",
    TORCHRUN: "torchrun numbers node by node; give each node its own --node-rank",
    FABRIC_RUN: "fabric run numbers node by node; give each node its own --node-rank",
}


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its host and the node rank and local rank its launcher gave it."""

    global_rank: int
    host: str
    node_rank: int
    local_rank: int

    @property
    def node(self) -> tuple[str, int]:
        # the host tells real nodes apart; the node rank tells simulated nodes on one host apart
        return (self.host, self.node_rank)


def gather_placements(global_rank: int, node_rank: int, local_rank: int) -> list[Placement]:
    """Every rank's :class:`Placement`, in global rank order (a collective: call it on every rank)."""
    mine = Placement(global_rank, socket.gethostname(), node_rank, local_rank)
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return [mine]  # alone, or a dry run whose object collectives carry no data: nothing to compare
    placements: list[Placement | None] = [None] * dist.get_world_size()
    dist.all_gather_object(placements, mine)
    return sorted(placements, key=lambda placement: placement.global_rank)  # type: ignore[arg-type, union-attr]


def check_rank_placement(placements: list[Placement], ranks_per_node: int, launcher: Launcher | None = None) -> None:
    """Raise unless each block of ``ranks_per_node`` consecutive global ranks runs on one node, a node per block.

    Raises:
        ValueError: The launcher numbered the ranks otherwise; the message shows where the ranks run and how to
            launch with block numbering.
    """
    blocks = [placements[start : start + ranks_per_node] for start in range(0, len(placements), ranks_per_node)]
    block_of_node: dict[tuple[str, int], int] = {}
    wrong = []
    for index, block in enumerate(blocks):
        nodes = {placement.node for placement in block}
        if len(nodes) != 1 or block_of_node.setdefault(block[0].node, index) != index:
            wrong.append(index)
    if not wrong:
        return
    ranks_on: dict[tuple[str, int], list[int]] = {}
    for placement in placements:
        ranks_on.setdefault(placement.node, []).append(placement.global_rank)
    where = "; ".join(f"{host} (node rank {node}): ranks {ranks}" for (host, node), ranks in list(ranks_on.items())[:4])
    more = f"; and {len(ranks_on) - 4} more node(s)" if len(ranks_on) > 4 else ""
    first = wrong[0] * ranks_per_node
    fix = _FIXES.get(launcher.name, "") if launcher is not None else ""
    fixes = fix or "; ".join(_FIXES.values())
    raise ValueError(
        f"the launcher numbered the global ranks across nodes, not node by node: HybridFSDPStrategy's mesh needs ranks"
        f" {first}..{first + ranks_per_node - 1} on one node of their own, but the ranks run on {where}{more}."
        " Tensor-parallel and shard groups would span nodes and every layer's collectives would cross the network."
        f" Launch with ranks numbered node by node: {fixes}."
    )
