"""The layouts a cluster allows, and the rank groups of each: ``Topology`` objects, as the strategy builds them.

A layout is a :class:`~fabric_hsdp.topology.Topology`: ``shard_size`` ranks hold one copy of the model, tensor
parallelism splits it ``T`` ways and FSDP ``S = shard_size / T`` ways, ``R = world / shard_size`` replicas; the
mesh is ``(replicate, shard[, tensor])`` with tensor innermost, global rank ``(r S + s) T + t``. The planner asks
``Topology.resolve`` which layouts exist, so it never offers one the strategy would refuse. Expert parallelism of
degree ``N`` (a mixture-of-experts model's) splits the shard dim into ``(expert_shard, expert)``, mesh
``(R, shard_size / N, N)``; context parallelism of degree ``C`` (with neither) splits it the same way into
``(data_shard, context)``, mesh ``(R, shard_size / C, C)``.
"""

from __future__ import annotations

import itertools

from fabric_hsdp.topology import Topology


def candidate_layouts(
    num_nodes: int,
    ranks_per_node: int,
    tensor_parallel_sizes: list[int] | None = None,
    expert_parallel_sizes: list[int] | None = None,
    context_parallel_sizes: list[int] | None = None,
) -> list[Topology]:
    """Every layout ``Topology.resolve`` accepts, by shard size, tensor-, expert-, then context-parallel size.

    Args:
        tensor_parallel_sizes: Only these TP sizes (default: every divisor of ``ranks_per_node``).
        expert_parallel_sizes: These EP sizes where the topology accepts them (default: 1 only; a mixture-of-experts
            model's come from :func:`~fabric_hsdp.planning.experts.expert_parallel_candidates`).
        context_parallel_sizes: These CP sizes where the topology accepts them (default: 1 only; the plan's come
            from :func:`~fabric_hsdp.planning.context.context_parallel_candidates`).
    """
    if num_nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"num_nodes({num_nodes}) and devices per node({ranks_per_node}) must be positive.")
    world = num_nodes * ranks_per_node
    sizes = tensor_parallel_sizes or [t for t in range(1, ranks_per_node + 1) if ranks_per_node % t == 0]
    layouts = []
    for shard_size in (d for d in range(1, world + 1) if world % d == 0):
        for tensor in sizes:
            for expert, context in itertools.product(expert_parallel_sizes or [1], context_parallel_sizes or [1]):
                try:
                    degrees = (tensor, expert, context)
                    layouts.append(Topology.resolve(shard_size, num_nodes, ranks_per_node, world, *degrees))
                except ValueError:
                    continue  # the strategy would refuse it too
    return layouts


def layout_summary(topology: Topology) -> str:
    """One line, e.g. ``shard_size=8 (one node), mesh (2, 8)`` (``Topology.describe()`` is the log's paragraph)."""
    if topology.shard_size == topology.world_size:
        span = "all ranks"
    elif topology.shard_size >= topology.ranks_per_node:
        nodes = topology.shard_size // topology.ranks_per_node
        span = "one node" if nodes == 1 else f"{nodes} nodes"
    else:
        span = f"{topology.shard_size} of a node's {topology.ranks_per_node} ranks"
    tensor, expert = topology.tensor_parallel_size, topology.expert_parallel_size
    split = f", tensor_parallel_size={tensor}" if tensor > 1 else ""
    split += f", expert_parallel_size={expert}" if expert > 1 else ""
    split += f", context_parallel_size={topology.context_parallel_size}" if topology.context_parallel_size > 1 else ""
    return f"shard_size={topology.shard_size} ({span}){split}, mesh {topology.mesh_shape}"
