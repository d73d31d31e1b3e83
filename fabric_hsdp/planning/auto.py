"""``HybridFSDPStrategy(shard_size="auto")``: plan with the real model and the devices' memory, resolve the topology.

At ``setup_module`` the strategy calls :func:`smallest_budget` (the smallest of the ranks' budgets: explicit, or the
free CUDA memory), then :func:`auto_topology`, so every rank plans with the same numbers and picks the same layout.
The plan is :func:`~fabric_hsdp.planning.plan.make_plan`'s, the same as ``fabric-hsdp plan`` prints.
"""

from __future__ import annotations

from typing import Any

from fabric_hsdp.planning.memory import Training
from fabric_hsdp.planning.model import model_shape_of_module
from fabric_hsdp.planning.plan import DEFAULT_SAFETY_MARGIN, Cluster, Plan, make_plan, no_fit_error
from fabric_hsdp.planning.report import plan_table
from fabric_hsdp.topology import Topology
from fabric_hsdp.units import format_bytes, parse_bytes


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


def smallest_budget(memory_budget: int | None, device: Any) -> int:
    """The budget every rank plans with: ``memory_budget``, else the free CUDA memory, the smallest over all ranks.

    One all-reduce when the process group exists: call it on every rank.
    """
    import torch
    import torch.distributed as dist

    budget = memory_budget if memory_budget is not None else int(torch.cuda.mem_get_info(device)[0])
    if not (dist.is_available() and dist.is_initialized()):
        return budget
    value = torch.tensor([budget], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def auto_topology(
    module: Any,
    budget: int,
    *,
    num_nodes: int,
    ranks_per_node: int,
    tensor_parallel_size: int,
    tensor_parallel_plan: Any,
    training: Training,
    backend: str | None,
) -> tuple[Topology, Plan]:
    """Plan ``module`` with ``budget`` bytes per device; return the topology of the recommended layout and the plan.

    The tensor-parallel size is the strategy's (the plan varies ``shard_size`` only); the split dims come from its
    ``tensor_parallel_plan``. ``training`` is the strategy's (``planner_training()``): the levers (AC mode, sequence and
    loss parallel) change the activation estimate as ``fabric-hsdp plan``'s options do. The ranking is the plan's
    (per token; with the TP size fixed, the tokens per step are the same for every row). No collectives.

    Raises:
        NoLayoutFitsError: Nothing fits the budget; the message gives the smallest total and what would fit.
    """
    cluster = Cluster(num_nodes, ranks_per_node, budget, backend="gloo" if backend == "gloo" else "nccl")
    model = model_shape_of_module(module, tensor_parallel_plan=tensor_parallel_plan)
    plan = make_plan(model, cluster, training, DEFAULT_SAFETY_MARGIN, [tensor_parallel_size])
    if plan.recommended is None:
        raise no_fit_error(plan, tensor_parallel_size)
    shard_size = plan.recommended.layout.shard_size
    # the plan only holds layouts Topology.resolve accepted; resolving again keeps one source of truth
    world = num_nodes * ranks_per_node
    return Topology.resolve(shard_size, num_nodes, ranks_per_node, world, tensor_parallel_size), plan


def describe_choice(plan: Plan) -> str:
    """What the log says: the workload and budget it planned for, then the table with the recommendation."""
    workload = plan.training.workload
    return (
        f"HybridFSDPStrategy(shard_size='auto') planned for {workload.micro_batch_size} x {workload.seq_len} tokens"
        f" per rank and {workload.optimizer} (pass workload=Workload(...) to change), with a budget of"
        f" {format_bytes(plan.cluster.device_memory)} per device:\n{plan_table(plan)}"
    )


def offloads(cpu_offload: Any) -> bool:
    """Whether ``HybridFSDPStrategy(cpu_offload=...)`` (a bool or an offload policy) puts the state on CPU."""
    if isinstance(cpu_offload, bool):
        return cpu_offload
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(cpu_offload, CPUOffloadPolicy)
