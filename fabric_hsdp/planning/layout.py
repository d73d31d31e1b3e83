"""The layouts a cluster allows: every ``shard_size`` the topology accepts, times every tensor-parallel size.

``shard_size`` ranks hold one copy of the model; tensor parallelism splits it ``T`` ways inside that group and FSDP
the rest, ``S = shard_size / T`` ways; ``R = world / shard_size`` replicas. The mesh is ``(replicate, shard)`` of shape
``(R, shard_size)`` when ``T == 1`` and ``(replicate, shard, tensor)`` of shape ``(R, S, T)`` otherwise, tensor
innermost: global rank ``(r S + s) T + t``, so tensor-parallel peers are consecutive ranks of one node.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fabric_hsdp.topology import Topology


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out on ``num_nodes x ranks_per_node`` ranks."""

    num_nodes: int
    ranks_per_node: int
    shard_size: int
    tensor_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def fsdp_size(self) -> int:
        """Ranks that FSDP shards each tensor-parallel slice over (``S``)."""
        return self.shard_size // self.tensor_parallel_size

    @property
    def replicate_size(self) -> int:
        return self.world_size // self.shard_size

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.tensor_parallel_size == 1:
            return (self.replicate_size, self.shard_size)
        return (self.replicate_size, self.fsdp_size, self.tensor_parallel_size)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("replicate", "shard") if self.tensor_parallel_size == 1 else ("replicate", "shard", "tensor")

    def rank(self, replicate_index: int, shard_index: int, tensor_index: int = 0) -> int:
        """Global rank at mesh coordinates ``(r, s, t)``."""
        return (replicate_index * self.fsdp_size + shard_index) * self.tensor_parallel_size + tensor_index

    def groups(self, dim: str) -> Iterator[list[int]]:
        """The rank groups along mesh dim ``dim`` ('replicate', 'shard' = FSDP, 'tensor'), each in ring order."""
        replicas, fsdp, tensor = self.replicate_size, self.fsdp_size, self.tensor_parallel_size
        if dim == "shard":
            for r in range(replicas):
                for t in range(tensor):
                    yield [self.rank(r, s, t) for s in range(fsdp)]
        elif dim == "replicate":
            for s in range(fsdp):
                for t in range(tensor):
                    yield [self.rank(r, s, t) for r in range(replicas)]
        elif dim == "tensor":
            for r in range(replicas):
                for s in range(fsdp):
                    yield [self.rank(r, s, t) for t in range(tensor)]
        else:
            raise ValueError(f"mesh dim {dim!r} is not one of 'replicate', 'shard', 'tensor'")

    def describe(self) -> str:
        """E.g. ``shard_size=8 (one node), mesh (2, 8)``."""
        if self.shard_size == self.world_size:
            span = "all ranks"
        elif self.shard_size >= self.ranks_per_node:
            nodes = self.shard_size // self.ranks_per_node
            span = "one node" if nodes == 1 else f"{nodes} nodes"
        else:
            span = f"{self.shard_size} of a node's {self.ranks_per_node} ranks"
        tensor = f", tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return f"shard_size={self.shard_size} ({span}){tensor}, mesh {self.mesh_shape}"


def topology_problem(layout: Layout) -> str | None:
    """Why ``HybridFSDPStrategy`` would reject ``layout`` (None if it accepts it)."""
    try:
        Topology.resolve(layout.shard_size, layout.num_nodes, layout.ranks_per_node, layout.world_size)
    except ValueError as error:
        return str(error)
    tensor = layout.tensor_parallel_size
    if tensor < 1 or layout.ranks_per_node % tensor or layout.shard_size % tensor:
        return (
            f"tensor_parallel_size({tensor}) must divide ranks_per_node({layout.ranks_per_node}) and"
            f" shard_size({layout.shard_size})"
        )
    return None


def candidate_layouts(
    num_nodes: int, ranks_per_node: int, tensor_parallel_sizes: list[int] | None = None
) -> list[Layout]:
    """Every layout the topology accepts, by shard size then tensor-parallel size.

    Args:
        tensor_parallel_sizes: Only these TP sizes (default: every divisor of ``ranks_per_node``).
    """
    if num_nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"num_nodes({num_nodes}) and devices per node({ranks_per_node}) must be positive.")
    world = num_nodes * ranks_per_node
    sizes = tensor_parallel_sizes or [t for t in range(1, ranks_per_node + 1) if ranks_per_node % t == 0]
    layouts = []
    for shard_size in (d for d in range(1, world + 1) if world % d == 0):
        for tensor in sizes:
            layout = Layout(num_nodes, ranks_per_node, shard_size, tensor)
            if topology_problem(layout) is None:
                layouts.append(layout)
    return layouts
