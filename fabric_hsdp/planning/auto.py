"""``shard_size="auto"``: plan with the real model and the devices' memory, and take the recommended layout.

At ``setup_module`` the run's topology (:meth:`fabric_hsdp.processes.run_topology.RunTopology.choose`) calls
:func:`smallest_budget` (the smallest of the ranks' budgets: explicit, or the free CUDA memory), then
:func:`auto_topology`, so every rank plans with the same numbers and picks the same layout. The plan is
:func:`~fabric_hsdp.planning.plan.make_plan`'s, the same as ``fabric-hsdp plan`` prints; :func:`planner_training`
says how the planner sees the strategy's options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric_hsdp.planning.memory import Training, Workload
from fabric_hsdp.planning.model import model_shape_of_module
from fabric_hsdp.planning.plan import DEFAULT_SAFETY_MARGIN, Cluster, Plan, make_plan, recommended_layout
from fabric_hsdp.planning.report import plan_table
from fabric_hsdp.topology import Topology
from fabric_hsdp.units import format_bytes

if TYPE_CHECKING:
    from fabric_hsdp.setup.pipeline import Levers


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


def planner_training(precision: str, workload: Workload | None, levers: Levers) -> Training:
    """How the planner sees a strategy's training (precision, levers, offload) for ``workload``: what
    ``shard_size="auto"`` chooses with and the dry run's report compares against."""
    from fabric_hsdp.setup.fsdp import offloads

    reshard = levers.reshard_after_forward
    return Training(
        precision=precision,
        workload=workload or Workload(),
        activation_checkpointing=levers.activation_checkpointing is not None,
        activation_checkpointing_mode=levers.activation_checkpointing_mode,
        cpu_offload=offloads(levers.cpu_offload),
        reshard_after_forward=None if reshard is None else bool(reshard),
        sequence_parallel=levers.sequence_parallel,
        loss_parallel=levers.loss_parallel,
        keep_gathered_while_accumulating=levers.keep_gathered_while_accumulating,
    )


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
    expert_parallel_size: int | None = None,
    context_parallel_size: int | None = None,
) -> tuple[Topology, Plan]:
    """Plan ``module`` with ``budget`` bytes per device; return the topology of the recommended layout and the plan.

    The tensor-parallel size is the strategy's; the split dims come from its ``tensor_parallel_plan``. The plan
    varies ``shard_size``, for a mixture-of-experts model the expert-parallel size (``expert_parallel_size``:
    only that one), and the context-parallel size (``context_parallel_size``: only that one; a size the planner
    chooses changes the data-parallel ranks to ``world / C``). ``training`` is the strategy's
    (:func:`planner_training`): the levers (AC mode, sequence and loss parallel) change the activation estimate as
    ``fabric-hsdp plan``'s options do. The ranking is the plan's, at the strategy's micro-batch and checkpointing
    (``adapt=False``: the script's batch is what it is). No collectives.

    Raises:
        NoLayoutFitsError: Nothing fits the budget; the message gives the smallest total and what would fit.
    """
    cluster = Cluster(num_nodes, ranks_per_node, budget, backend="gloo" if backend == "gloo" else "nccl")
    model = model_shape_of_module(module, tensor_parallel_plan=tensor_parallel_plan)
    # the script's micro-batch and checkpointing are fixed: the rows differ only in shard_size (adapt=False)
    experts = None if expert_parallel_size is None else [expert_parallel_size]
    contexts = None if context_parallel_size is None else [context_parallel_size]
    plan = make_plan(
        model, cluster, training, DEFAULT_SAFETY_MARGIN, [tensor_parallel_size], adapt=False,
        expert_parallel_sizes=experts, context_parallel_sizes=contexts,
    )  # fmt: skip
    chosen = recommended_layout(plan, tensor_parallel_size).layout
    # the plan only holds layouts Topology.resolve accepted; resolving again keeps one source of truth
    world = num_nodes * ranks_per_node
    sizes = (tensor_parallel_size, chosen.expert_parallel_size, chosen.context_parallel_size)
    return Topology.resolve(chosen.shard_size, num_nodes, ranks_per_node, world, *sizes), plan


def describe_choice(plan: Plan) -> str:
    """What the log says: the workload and budget it planned for, then the table with the recommendation."""
    workload = plan.training.workload
    return (
        f"HybridFSDPStrategy(shard_size='auto') planned for {workload.micro_batch_size} x {workload.seq_len} tokens"
        f" per rank and {workload.optimizer} (pass workload=Workload(...) to change), with a budget of"
        f" {format_bytes(plan.cluster.device_memory)} per device:\n{plan_table(plan)}"
    )
