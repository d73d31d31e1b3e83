"""The hybrid-sharding topology: how many ranks shard a model together, how many replicas of that group exist.

A world of ``num_nodes x ranks_per_node`` ranks becomes a 2-D mesh ``(replicate, shard)``. Global ranks are laid out
node by node (Lightning's ``global_rank = node_rank * ranks_per_node + local_rank``), and the mesh is row-major, so a
shard group is a run of consecutive ranks: one node, a part of one node, or several whole nodes. Parameters, gradients
and optimizer state are sharded along ``shard``; only the gradient all-reduce of a shard travels along ``replicate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

REPLICATE_DIM = "replicate"
SHARD_DIM = "shard"
MESH_DIM_NAMES = (REPLICATE_DIM, SHARD_DIM)

ShardSize = Literal["node", "world"] | int


def validate_shard_size(shard_size: ShardSize) -> ShardSize:
    """Check the form of ``shard_size`` before any process exists (the arithmetic is checked in ``resolve``)."""
    if shard_size in ("node", "world"):
        return shard_size
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(
            f"HybridFSDPStrategy(shard_size={shard_size!r}) is not valid. Use 'node' (shard within each node, replicate"
            " across nodes), 'world' (plain FSDP over all ranks), or a positive number of ranks per shard group,"
            " e.g. shard_size=16 to shard over two 8-GPU nodes."
        )
    return shard_size


@dataclass(frozen=True)
class Topology:
    """Degrees of the hybrid mesh, validated against the cluster they run on.

    Attributes:
        num_nodes: Nodes in the job.
        ranks_per_node: Processes (devices) per node.
        shard_size: Ranks that shard one copy of the model together.
    """

    num_nodes: int
    ranks_per_node: int
    shard_size: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def replicate_size(self) -> int:
        return self.world_size // self.shard_size

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.replicate_size, self.shard_size)

    @classmethod
    def resolve(cls, shard_size: ShardSize, num_nodes: int, ranks_per_node: int, world_size: int) -> Topology:
        """Turn ``shard_size`` ('node', 'world' or a number) into a validated topology.

        Raises:
            ValueError: The sizes don't multiply out, or a shard group would straddle nodes unevenly. The message
                shows the arithmetic and the values that would work.
        """
        shard_size = validate_shard_size(shard_size)
        if num_nodes * ranks_per_node != world_size:
            raise ValueError(
                f"num_nodes({num_nodes}) * ranks_per_node({ranks_per_node}) != WORLD_SIZE({world_size}). Pass"
                " Fabric(num_nodes=..., devices=...) matching what the launcher started (e.g. `fabric run"
                " --num-nodes N --devices M`, or SLURM's --nodes and --ntasks-per-node)."
            )
        if shard_size == "node":
            size = ranks_per_node
        elif shard_size == "world":
            size = world_size
        else:
            size = shard_size
        if world_size % size != 0:
            raise ValueError(
                f"shard_size({size}) does not divide WORLD_SIZE({world_size}) = num_nodes({num_nodes}) *"
                f" ranks_per_node({ranks_per_node}): replicate_size would be {world_size / size:g}. Choose a divisor:"
                f" {_divisors(world_size)}."
            )
        if size < ranks_per_node and ranks_per_node % size != 0:
            raise ValueError(
                f"shard_size({size}) does not divide ranks_per_node({ranks_per_node}), so a shard group would straddle"
                f" two nodes. Choose a divisor of ranks_per_node ({_divisors(ranks_per_node)}) or a multiple of it."
            )
        if size > ranks_per_node and size % ranks_per_node != 0:
            raise ValueError(
                f"shard_size({size}) is not a multiple of ranks_per_node({ranks_per_node}), so a shard group would"
                f" cover a fraction of a node. Choose a multiple of {ranks_per_node} that divides WORLD_SIZE"
                f"({world_size}): {[d for d in _divisors(world_size) if d % ranks_per_node == 0]}."
            )
        return cls(num_nodes=num_nodes, ranks_per_node=ranks_per_node, shard_size=size)

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """This rank's ``(replicate_index, shard_index)`` in the mesh."""
        return divmod(global_rank, self.shard_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named 2-D mesh ``(replicate, shard)`` over all ranks (needs the default process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)

    def describe(self) -> str:
        """One paragraph for the log: nodes, ranks per node, mesh shape and what each dim means."""
        if self.replicate_size == 1:
            kind = "FSDP over all ranks (no replication)"
        elif self.shard_size == 1:
            kind = "pure replication (DDP-like; nothing is sharded)"
        else:
            kind = "HSDP"
        nodes_per_group = max(1, self.shard_size // self.ranks_per_node)
        span = f"{nodes_per_group} node(s)" if self.shard_size >= self.ranks_per_node else "part of one node"
        return (
            f"{kind}: {self.num_nodes} node(s) x {self.ranks_per_node} rank(s) per node = {self.world_size} ranks;"
            f" mesh {self.mesh_shape} with dims {MESH_DIM_NAMES}: '{SHARD_DIM}'={self.shard_size} ranks hold one"
            f" sharded copy of the model ({span}), '{REPLICATE_DIM}'={self.replicate_size} copies exchange only"
            " gradient all-reduces of their shards."
        )


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
