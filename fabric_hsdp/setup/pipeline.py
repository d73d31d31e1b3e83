"""The setup pipeline, one step per lever, in torchtitan's order (``parallelize_llama``): float8 -> tensor parallelism
-> expert parallelism -> context parallelism -> activation checkpointing -> compile -> ``fully_shard``; and
:func:`set_up_module`, all of ``fabric.setup_module`` (the pipeline, then the local shards made real, replicas made
identical and tensor parallelism finished).

Each step takes the module and the sub-mesh it needs (tensor parallelism the ``tensor`` mesh, FSDP the
``(replicate, shard)`` mesh) and changes the model in place; parameter and state-dict names stay what the user's
model calls them (activation checkpointing inside the forward, ``Module.compile()`` rather than an ``OptimizedModule``
wrapper), so checkpoints saved with any lever load without it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fabric_hsdp.adapters.init import refuse_unsupported_adapters
from fabric_hsdp.adapters.quantized import refuse_quantized_base
from fabric_hsdp.agreement import fail_together
from fabric_hsdp.setup.activation_checkpointing import ActivationCheckpointingMode, apply_activation_checkpointing
from fabric_hsdp.setup.compile import CompileSpec, apply_compile
from fabric_hsdp.setup.float8 import Float8Spec, apply_float8, validate_float8
from fabric_hsdp.setup.fsdp import (
    FSDPSettings,
    ModulePolicy,
    apply_fsdp,
    hold_frozen_in_compute_dtype,
    is_sharded,
    mixed_precision_policy,
    module_matcher,
    offload_policy,
    sharded_units,
)
from fabric_hsdp.setup.materialize import make_replicas_identical, materialize_local_shards
from fabric_hsdp.topology import validate_tensor_parallel_size
from fabric_hsdp.versions import (
    async_collective_tensor,
    tree_map_only,
    wait_tensor,
)

if TYPE_CHECKING:
    from fabric_hsdp.tensor_parallel import AppliedPlan, TensorParallelPlan
    from fabric_hsdp.topology import ParallelMesh, Topology

_logger = logging.getLogger(__name__)


def validate_activation_checkpointing_mode(mode: ActivationCheckpointingMode) -> ActivationCheckpointingMode:
    if mode in ("full", "selective") or (isinstance(mode, int) and not isinstance(mode, bool) and mode >= 1):
        return mode
    raise ValueError(
        f"HybridFSDPStrategy(activation_checkpointing_mode={mode!r}) is not valid: pass 'full' (recompute each"
        " checkpointed block), 'selective' (save matmul, attention and collective outputs, recompute the rest) or an"
        " int k >= 1 (full recompute of every k-th checkpointed block)."
    )


def validate_compile(spec: CompileSpec) -> CompileSpec:
    if isinstance(spec, bool) or (isinstance(spec, dict) and all(isinstance(key, str) for key in spec)):
        return dict(spec) if isinstance(spec, dict) else spec
    raise ValueError(
        f"HybridFSDPStrategy(compile={spec!r}) is not valid: pass True, or a dict of torch.compile keyword arguments"
        " (e.g. {'mode': 'max-autotune'})."
    )


def validate_keep_gathered(keep: bool, reshard_after_forward: bool | int | None) -> bool | int | None:
    """The ``reshard_after_forward`` a run with ``keep_gathered_while_accumulating=keep`` shards with: ``False``
    when it keeps the units gathered (one gather per optimizer step: none again for the backward either).

    Raises:
        ValueError: ``keep`` is not a bool, or asks to keep the units gathered while ``reshard_after_forward``
            asks to free them after every forward.
    """
    if not isinstance(keep, bool):
        raise ValueError(
            f"HybridFSDPStrategy(keep_gathered_while_accumulating={keep!r}) is not valid: pass True or False."
        )
    if not keep:
        return reshard_after_forward
    if reshard_after_forward not in (None, False):
        raise ValueError(
            "HybridFSDPStrategy(keep_gathered_while_accumulating=True,"
            f" reshard_after_forward={reshard_after_forward!r}) asks to keep the gathered parameters for the whole"
            " step and to free them after every forward. Drop"
            " reshard_after_forward (keep_gathered_while_accumulating implies reshard_after_forward=False)."
        )
    return False


@dataclass(frozen=True)
class Levers:
    """What the strategy's arguments ask of the setup: the FSDP units and options, and every lever (read, never
    written, by the setup)."""

    sharded_modules: Callable[[str, nn.Module], bool] | None = None  # None: the layers of the model's ModuleLists
    reshard_after_forward: bool | int | None = None
    keep_gathered_while_accumulating: bool = False
    cpu_offload: bool | Any = False
    tensor_parallel_plan: TensorParallelPlan = "auto"
    activation_checkpointing: Callable[[str, nn.Module], bool] | None = None
    activation_checkpointing_mode: ActivationCheckpointingMode = "full"
    compile: CompileSpec = False
    float8: Float8Spec | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False


def levers_of(
    *,
    sharded_modules: ModulePolicy | None,
    reshard_after_forward: bool | int | None,
    cpu_offload: bool | Any,
    keep_gathered_while_accumulating: bool = False,
    tensor_parallel_size: int,
    tensor_parallel_plan: TensorParallelPlan,
    sequence_parallel: bool,
    loss_parallel: bool,
    activation_checkpointing: ModulePolicy | None,
    activation_checkpointing_mode: ActivationCheckpointingMode,
    compile: CompileSpec,
    float8: bool | str,
) -> Levers:
    """``HybridFSDPStrategy``'s setup arguments, validated (each error names the argument and what would do)."""
    from fabric_hsdp.tensor_parallel import validate_levers, validate_plan

    validate_levers(sequence_parallel, loss_parallel, validate_tensor_parallel_size(tensor_parallel_size))
    reshard_after_forward = validate_keep_gathered(keep_gathered_while_accumulating, reshard_after_forward)
    return Levers(
        sharded_modules=module_matcher(sharded_modules, "sharded_modules"),
        reshard_after_forward=reshard_after_forward,
        keep_gathered_while_accumulating=keep_gathered_while_accumulating,
        cpu_offload=cpu_offload,
        activation_checkpointing=module_matcher(activation_checkpointing, "activation_checkpointing"),
        tensor_parallel_plan=validate_plan(tensor_parallel_plan),
        activation_checkpointing_mode=validate_activation_checkpointing_mode(activation_checkpointing_mode),
        compile=validate_compile(compile),
        float8=validate_float8(float8),
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
    )


def set_up_module(
    module: nn.Module,
    mesh: ParallelMesh,
    topology: Topology,
    levers: Levers,
    *,
    precision: str,
    device: torch.device,
    global_rank: int,
) -> nn.Module:
    """``fabric.setup_module``'s work on every rank: apply the levers and shard ``module`` in place (every rank
    agreeing it could), then make its local shards real, its replicas identical, and finish tensor parallelism."""
    with fail_together("HybridFSDPStrategy.setup_module"):
        if is_sharded(module):
            raise ValueError(
                f"{type(module).__name__} was already sharded with fully_shard. Pass the plain model to"
                " fabric.setup_module(model); HybridFSDPStrategy applies fully_shard itself."
            )
        refuse_quantized_base(module, device)
        refuse_unsupported_adapters(module, tensor_parallel=mesh.tensor is not None)
        sharding = FSDPSettings(
            sharded_modules=levers.sharded_modules,
            reshard_after_forward=levers.reshard_after_forward,
            mp_policy=mixed_precision_policy(precision),
            offload_policy=offload_policy(levers.cpu_offload, device),
        )
        # the sizes tensor-parallel errors may suggest: those dividing a node and the shard group
        largest = math.gcd(topology.ranks_per_node, topology.shard_size)
        applied = parallelize(module, mesh, sharding, levers, largest)  # float8 -> TP -> AC -> compile -> shard
    # Collectives from here on: only after every rank got this far (fail_together's exchange must come first).
    materialize_local_shards(module, device, topology.position_in_copy(global_rank))
    make_replicas_identical(module, mesh)
    if mesh.tensor is not None:
        from fabric_hsdp.tensor_parallel import finish_tensor_parallel
        from fabric_hsdp.tensor_parallel.view_warning import hide_harmless_view_warning

        finish_tensor_parallel(module, applied, mesh.tensor, device)
        hide_harmless_view_warning(module)  # FSDP2's warning about the head's to_local() view, harmless there
    return module


def parallelize(
    module: nn.Module, mesh: ParallelMesh, settings: FSDPSettings, levers: Levers, largest_tensor_parallel_size: int
) -> AppliedPlan | None:
    """Apply every lever to ``module`` in place, then shard it; return what tensor parallelism did (``None``
    without it). ``largest_tensor_parallel_size``: the sizes tensor-parallel errors suggest divide it."""
    from fabric_hsdp.tensor_parallel import apply_tensor_parallel

    applied = experts = None
    units = sharded_units(module, settings.sharded_modules)  # the transformer blocks, before anything wraps them
    if levers.float8 is not None:
        apply_float8(
            module, levers.float8, compiled=levers.compile is not False, tensor_parallel=mesh.tensor is not None
        )
    if mesh.tensor is not None:
        applied = apply_tensor_parallel(
            module,
            levers.tensor_parallel_plan,
            mesh.tensor,
            sequence_parallel=levers.sequence_parallel,
            loss_parallel=levers.loss_parallel,
            largest_size=largest_tensor_parallel_size,
        )
        finish_collectives_before_units(module, units)
    if mesh.expert is not None:
        from fabric_hsdp.expert_parallel import apply_expert_parallel, expert_units

        split = apply_expert_parallel(module, mesh.expert)
        experts = expert_units(split, mesh.expert_fsdp, mesh.topology.expert_parallel_size)
    if mesh.context is not None:
        from fabric_hsdp.context_parallel import apply_context_parallel

        apply_context_parallel(module, mesh.context)
    if levers.activation_checkpointing is not None:
        apply_activation_checkpointing(module, levers.activation_checkpointing, levers.activation_checkpointing_mode)
    if levers.compile:
        apply_compile(module, units, levers.compile, tensor_parallel=mesh.tensor is not None)
    hold_frozen_in_compute_dtype(module, settings.mp_policy)  # a frozen base (LoRA) costs only its bf16 shards
    apply_fsdp(module, units, mesh.fsdp, settings, experts)
    if mesh.context is not None:
        divide_gradients_by_data_parallel_ranks(module, mesh.topology.data_parallel_size)
    return applied


def divide_gradients_by_data_parallel_ranks(module: nn.Module, data_parallel_size: int) -> None:
    """Under context parallelism each rank's loss is its share of its context group's (their sum is the group's
    mean, :func:`fabric_hsdp.context_parallel.cross_entropy`): every FSDP unit averages the gradients over the
    data-parallel ranks, not over all the ranks of its mesh (which counts each context group ``C`` times)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(float(data_parallel_size))


def finish_collectives_before_units(module: nn.Module, units: list[tuple[str, nn.Module]]) -> list[str]:
    """Outputs of tensor-parallel modules outside the units (the embedding, the head) leave as finished tensors.

    torch's ``RowwiseParallel``/``ColwiseParallel`` redistribute their output asynchronously, so ``to_local()``
    hands on an ``AsyncCollectiveTensor``. Fed into a compiled unit (``compile=True``, or a user's own
    ``block.compile()``), torch 2.13's AOTAutograd drops the gradient that flows back through it: under tensor
    parallelism litgpt's embedding got no gradient at all and training silently diverged from eager. A forward hook
    on each such module waits for the collective and hands on a plain tensor (same memory, gradient passed through).
    """
    from torch.distributed.tensor import DTensor

    inside = {id(sub) for _, unit in units for sub in unit.modules()}
    hooked = []
    for name, child in module.named_modules():
        if id(child) in inside or not any(isinstance(p, DTensor) for p in child.parameters(recurse=False)):
            continue
        child.register_forward_hook(_finished_output)
        hooked.append(name)
    return hooked


def _finished_output(module: nn.Module, args: Any, output: Any) -> Any:
    return tree_map_only(async_collective_tensor(), _WaitCollective.apply, output)


class _WaitCollective(torch.autograd.Function):
    """Wait for an ``AsyncCollectiveTensor``'s collective; the result is a plain tensor, the gradient unchanged."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return wait_tensor(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad
