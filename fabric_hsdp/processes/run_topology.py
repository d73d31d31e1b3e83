"""The run's topology and mesh: what the strategy was asked for (``shard_size``, ``tensor_parallel_size``), resolved
once the processes exist, or for ``shard_size="auto"`` chosen by the planner at ``setup_module``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.topology import (
    Topology,
    validate_context_parallel_size,
    validate_expert_parallel_size,
    validate_shard_size,
)
from fabric_hsdp.units import parse_bytes
from fabric_hsdp.versions import split_shard_dim_unsupported

if TYPE_CHECKING:
    from fabric_hsdp.planning.memory import Training, Workload
    from fabric_hsdp.topology import ParallelMesh, ShardSize

_logger = logging.getLogger(__name__)


class RunTopology:
    """The layout a strategy was asked for, and the topology and mesh it resolves to (rank 0 logs them).

    A fixed ``shard_size`` resolves when the processes exist (:meth:`resolve`); ``"auto"`` at ``setup_module``, from
    the model (:meth:`choose`). The arguments are the strategy's, validated here.
    """

    def __init__(
        self,
        shard_size: ShardSize | str,
        tensor_parallel_size: int,
        memory_budget: int | str | None,
        workload: Workload | None,
        expert_parallel_size: int | None = None,
        context_parallel_size: int | None = None,
    ) -> None:
        self.shard_size = shard_size if shard_size == "auto" else validate_shard_size(shard_size)
        self.tensor_parallel_size = tensor_parallel_size
        # None: 1, or with shard_size="auto" the planner's choice
        self.expert_parallel_size = (
            None if expert_parallel_size is None else validate_expert_parallel_size(expert_parallel_size)
        )
        # None: 1, with shard_size="auto" too: a script splits its sequences only when it asks for it (shard_sequence)
        self.context_parallel_size = (
            None if context_parallel_size is None else validate_context_parallel_size(context_parallel_size)
        )
        for name, size in (("expert", expert_parallel_size), ("context", context_parallel_size)):
            if (size or 1) > 1 and (reason := split_shard_dim_unsupported()):
                raise ValueError(
                    f"HybridFSDPStrategy({name}_parallel_size={size}) cannot run here: {reason}. Upgrade torch, or"
                    f" drop {name}_parallel_size."
                )
        self.memory_budget = check_memory_budget(shard_size, memory_budget, device_type=None)
        self.workload = workload
        self._topology: Topology | None = None
        self._mesh: ParallelMesh | None = None
        self._cluster: dict[str, Any] = {}
        self._device: Any = None

    @property
    def resolved(self) -> bool:
        return self._topology is not None

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError(_NOT_YET.format("topology"))
        return self._topology

    @property
    def mesh(self) -> ParallelMesh:
        if self._mesh is None:
            raise RuntimeError(_NOT_YET.format("device mesh"))
        return self._mesh

    @property
    def mesh_if_built(self) -> ParallelMesh | None:
        return self._mesh

    def check_device(self, device_type: str) -> None:
        """Before the processes start: ``"auto"`` without a budget needs a CUDA device to measure."""
        check_memory_budget(self.shard_size, self.memory_budget, device_type)

    def set_up(self, num_nodes: int, ranks_per_node: int, world_size: int, device: Any, backend: str | None) -> None:
        """Once the processes exist: a fixed ``shard_size`` resolves its topology and builds the mesh here;
        ``"auto"`` keeps the cluster for :meth:`choose`."""
        self._cluster = {"num_nodes": num_nodes, "ranks_per_node": ranks_per_node, "backend": backend}
        self._device = device
        if self.shard_size != "auto":
            sizes = (self.tensor_parallel_size, self.expert_parallel_size or 1, self.context_parallel_size or 1)
            self._use(Topology.resolve(self.shard_size, num_nodes, ranks_per_node, world_size, *sizes))

    def choose(self, module: Any, tensor_parallel_plan: Any, training: Training) -> None:
        """``shard_size="auto"``: plan ``module`` with the smallest budget of all ranks and take the recommended
        layout; every rank makes the same choice (or raises the same error, see :func:`auto_topology`), and rank 0
        logs it with the plan's table."""
        from fabric_hsdp.planning.auto import auto_topology, describe_choice, smallest_budget

        budget = smallest_budget(self.memory_budget, self._device)  # a collective: before fail_together
        with fail_together("HybridFSDPStrategy(shard_size='auto')"):
            topology, plan = auto_topology(
                module,
                budget,
                tensor_parallel_size=self.tensor_parallel_size,
                tensor_parallel_plan=tensor_parallel_plan,
                training=training,
                expert_parallel_size=self.expert_parallel_size,
                context_parallel_size=self.context_parallel_size or 1,
                **self._cluster,
            )
        info_on_rank_zero(_logger, "%s", describe_choice(plan))
        self._use(topology)

    def sampler_kwargs(self, world_size: int, global_rank: int) -> dict[str, int]:
        """``DistributedSampler``'s replicas and rank: FSDP peers and replicas each compute on their own
        micro-batch, tensor-parallel and context-parallel peers share one (before ``"auto"`` chose, these depend on
        the sizes given)."""
        if self._topology is None and self.shard_size == "auto":
            size = self.tensor_parallel_size * (self.context_parallel_size or 1)
            return {"num_replicas": world_size // size, "rank": global_rank // size}
        topology = self.topology
        return {"num_replicas": topology.data_parallel_size, "rank": topology.data_parallel_rank(global_rank)}

    def _use(self, topology: Topology) -> None:
        self._topology, self._mesh = topology, topology.build_mesh(self._device.type)
        info_on_rank_zero(_logger, "%s", topology.describe())


_NOT_YET = (
    "the {} exists only after fabric.launch() (or `fabric run`) set up the ranks, and with shard_size='auto' after"
    " fabric.setup_module(model)"
)


def check_memory_budget(shard_size: Any, memory_budget: int | str | None, device_type: str | None) -> int | None:
    """Validate ``memory_budget`` against ``shard_size`` and the device type; bytes, or None to measure CUDA memory.

    Raises:
        ValueError: A budget without ``shard_size="auto"``, or ``"auto"`` on a device whose memory cannot be read.
    """
    if shard_size != "auto":
        if memory_budget is not None:
            raise ValueError(
                f"HybridFSDPStrategy(memory_budget={memory_budget!r}) is only used with shard_size='auto' (got"
                f" shard_size={shard_size!r}). Pass shard_size='auto', or drop memory_budget."
            )
        return None
    budget = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
    if budget is None and device_type is not None and device_type != "cuda":
        raise ValueError(
            f"HybridFSDPStrategy(shard_size='auto') on {device_type} needs the memory each rank may use: pass"
            " memory_budget=, e.g. HybridFSDPStrategy(shard_size='auto', memory_budget='8GB'). Only CUDA devices"
            " report their free memory."
        )
    return budget
