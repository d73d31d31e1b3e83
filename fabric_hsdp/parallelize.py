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

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fabric_hsdp.adapters.init import refuse_unsupported_adapters
from fabric_hsdp.adapters.quantized import refuse_quantized_base
from fabric_hsdp.agreement import fail_together
from fabric_hsdp.float8 import Float8Spec, apply_float8, validate_float8
from fabric_hsdp.fsdp import (
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
from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.materialize import make_replicas_identical, materialize_local_shards
from fabric_hsdp.models.experts import recorded_routers
from fabric_hsdp.topology import validate_tensor_parallel_size
from fabric_hsdp.versions import (
    async_collective_tensor,
    c10d_functional_ops,
    tree_map_only,
    wait_tensor,
)

if TYPE_CHECKING:
    from fabric_hsdp.tensor_parallel import AppliedPlan, TensorParallelPlan
    from fabric_hsdp.topology import ParallelMesh, Topology

_logger = logging.getLogger(__name__)

ActivationCheckpointingMode = Literal["full", "selective"] | int
CompileSpec = bool | dict[str, Any]


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


def apply_activation_checkpointing(
    module: nn.Module, selected: Callable[[str, nn.Module], bool], mode: ActivationCheckpointingMode
) -> list[str]:
    """Recompute the activations of the modules ``selected`` picks in backward; return their names.

    ``"full"``: each selected module keeps only its input and recomputes its forward in backward. ``"selective"``:
    torchtitan's op-level policy -- the outputs of matmuls, attention and collectives are saved, everything else
    (norms, activation functions, elementwise ops, RoPE) is recomputed. An int ``k``: full recompute of every
    ``k``-th selected module (the ``k``-th, ``2k``-th, ...), the others keep their activations.

    The checkpoint runs inside each module's forward (:func:`checkpointed_class`), as torchtitan's
    ``checkpoint_wrapper`` does but without a wrapper module, so parameter names (and checkpoints) are unchanged.
    """
    checkpointed = [(name, child) for name, child in module.named_modules() if name and selected(name, child)]
    if isinstance(mode, int):
        checkpointed = [pair for index, pair in enumerate(checkpointed, start=1) if index % mode == 0]
    for _, child in checkpointed:
        child.__class__ = checkpointed_class(type(child), selective=mode == "selective")
    if checkpointed:
        disable_kv_cache(module, "activation checkpointing")
        info_on_rank_zero(_logger, "activation checkpointing (%s): %d modules", mode, len(checkpointed))
    return [name for name, _ in checkpointed]


@functools.cache
def checkpointed_class(cls: type[nn.Module], *, selective: bool) -> type[nn.Module]:
    """A subclass of ``cls`` whose forward runs ``cls.forward`` under ``torch.utils.checkpoint`` (selective: with
    :func:`selective_checkpoint_contexts`); one class per block class and mode, as ``fully_shard`` makes its own.

    Inside the forward, not hooks around it: ``torch.compile`` of the block then traces the checkpoint and applies
    the policy in its graph. With hooks around a compiled block (the composable ``checkpoint``), backward reran the
    whole compiled forward whatever the mode: 4 compiled MLP blocks ran 32 matmuls in backward under ``selective``
    (16 without activation checkpointing; 16 now).
    """

    # the context function named directly, not through a closure: dynamo refuses a context_fn it cannot see
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

    def selective_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            cls.forward, self, *args, use_reentrant=False, context_fn=selective_checkpoint_contexts, **kwargs
        )

    mode = "Selective" if selective else ""
    return type(f"{mode}Checkpointed{cls.__name__}", (cls,), {"forward": selective_forward if selective else forward})


def saved_ops() -> list[Any]:
    """The ops whose outputs selective activation checkpointing keeps (torchtitan's list, plus the CPU kernels and
    expert parallelism's token exchange)."""
    import torch

    aten, names = torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "max")
    # _scaled_mm: float8's matmuls; max: float8's amax (its scales), else every float8 matmul is recomputed
    ops = [getattr(aten, name).default for name in names]
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            ops.append(getattr(aten, name).default)
    functional = c10d_functional_ops()
    for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor", "all_to_all_single"):
        if hasattr(functional, name):
            ops.append(getattr(functional, name).default)
    return ops


def selective_checkpoint_contexts() -> tuple[Any, Any]:
    """A fresh pair of selective-checkpoint contexts (one per forward): save :func:`saved_ops`, recompute the rest."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(saved_ops())


def apply_compile(
    module: nn.Module, units: list[tuple[str, nn.Module]], spec: CompileSpec, *, tensor_parallel: bool = False
) -> list[str]:
    """``torch.compile`` each FSDP unit (transformer block) of ``module`` on its own, in place (``Module.compile``),
    with ``spec``'s options (``True``: torch's defaults); return the units' names.

    Compiling per block keeps graphs small and lets identical blocks share one compiled graph (dynamo inlines the
    module and treats its parameters as inputs); compiling in place keeps the module tree, so no ``_orig_mod.``
    enters parameter names or checkpoints. A transformers MoE block's routers are called eagerly inside it
    (:func:`eager_call_class`), the rest of the block compiled. Turns transformers' KV cache off
    (:func:`disable_kv_cache`).
    """
    options = {} if spec is True else dict(spec)
    if tensor_parallel:
        # static shapes under TP unless asked otherwise: DTensor failed on the symbolic shapes that automatic dynamic
        # brings after a shape change ("unhashable type: non-nested SymInt" in a transformers Llama's norm with
        # sequence_parallel, while the first-layer split was traced); not reproduced since (the levers test trains at
        # a second length with it off), kept as the cautious default: a new shape recompiles (up to recompile_limit)
        options.setdefault("dynamic", False)
    for _, child in units:
        for router in recorded_routers(module, within=child):
            router.__class__ = eager_call_class(type(router))
        child.compile(**options)
    info_on_rank_zero(_logger, "torch.compile: %d modules compiled one by one (%s)", len(units), options or "defaults")
    disable_kv_cache(module, "torch.compile")
    return [name for name, _ in units]


@functools.cache
def eager_call_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``cls`` whose calls (forward and hooks) dynamo leaves eager: a graph break in a compiled block.

    For the routers whose logits transformers 5.3 records for the load-balancing loss (``output_router_logits=True``):
    its forward hook reads the collector with ``CompileableContextVar.get`` (``utils/output_capturing.py:108``),
    which under dynamo returns the global (:76-79) that ``set`` fills only when it runs compiled itself (:82-86,
    the whole model compiled). The model's forward sets the collector eagerly (:249), around our compiled blocks, so
    the traced hook saw ``None`` and recorded nothing: ``out.router_logits == ()`` and ``load_balancing_loss_func``
    raised ``IndexError`` at ``gate_logits[0]`` (``models/qwen3_moe/modeling_qwen3_moe.py:571``); the same with
    ``Module.compile`` of each layer of a plain transformers model. Dynamo calls ``type(module).__call__``
    (``torch/_dynamo/variables/nn_module.py``, ``UnspecializedNNModuleVariable.call_function``), so this class's
    disabled ``__call__`` runs the router and its hook eagerly, where the hook reads the context variable.
    """
    return type(f"EagerCall{cls.__name__}", (cls,), {"__call__": torch.compiler.disable(cls.__call__)})


def disable_kv_cache(module: nn.Module, lever: str) -> None:
    """Turn off a transformers model's KV cache for training (``config.use_cache=False``), for two levers.

    Activation checkpointing (as transformers' ``gradient_checkpointing`` does): the recomputation would append the
    keys and values to the cache a second time. Compile: the cache's update is indexed by each layer's
    ``layer_idx``, which dynamo guards on, so every block recompiles its own graph, and past dynamo's
    ``recompile_limit`` (8) the remaining blocks run uncompiled (a 12-layer Llama: 8 graphs, 4 blocks eager;
    with the cache off, 1 graph for all 12). An explicit ``model(..., use_cache=True)`` still uses it.
    """
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
        info_on_rank_zero(_logger, "%s: set %s.config.use_cache=False", lever, type(module).__name__)
