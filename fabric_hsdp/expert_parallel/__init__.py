"""Expert parallelism: each mixture-of-experts layer's experts split over the ``expert`` dim, tokens exchanged.

With ``expert_parallel_size=N`` every ``experts`` module of a transformers 5 model (fused ``gate_up_proj``
``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, in :mod:`fabric_hsdp.models.experts`) keeps ``E / N`` experts per rank:
its parameters become DTensors ``Shard(0)`` on the ``expert`` mesh, and its forward sends each routed token to the
rank holding its expert and back (:mod:`.dispatch`), running the model's own experts forward (eager or grouped_mm)
on the local experts in between. Router, auxiliary loss and shared experts are untouched; every rank keeps its own
batch (the expert ranks are data-parallel ranks). The experts are an FSDP unit of their own over ``(replicate,
expert_shard)``; their gradients, which sum the tokens of ``N`` ranks, are divided by ``N`` on their way to the
weights, so FSDP's average over ``(replicate, expert_shard)`` makes them the average over all data-parallel ranks
like every other gradient. (Not FSDP's ``set_gradient_divide_factor``: with one rank per expert shard, torch
2.8-2.14 divides by it twice when the reduction is forced to sums, as on gloo.)

Checkpoints see the experts' global ``[E, ...]`` shapes, so a save at any ``N`` loads at any other.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fabric_hsdp.expert_parallel.dispatch import combine, dispatch
from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.models.experts import expert_count, expert_modules
from fabric_hsdp.versions import module_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_logger = logging.getLogger(__name__)


@dataclass
class ExpertUnits:
    """The experts modules to shard as FSDP units of their own, over ``mesh`` (``(replicate, expert_shard)``).

    ``by_rows``: FSDP shards them by their second dim (rows of each expert, ``Shard(1)``), as torchtitan does when
    the expert shards outnumber a rank's experts (``expert_shard * N > E``), where ``Shard(0)`` would leave ranks
    holding padding only."""

    modules: list[nn.Module]
    mesh: DeviceMesh
    by_rows: bool = False


def expert_units(experts: list[tuple[str, nn.Module]], mesh: DeviceMesh, expert_parallel_size: int) -> ExpertUnits:
    """The split ``experts`` as FSDP units over ``mesh``, by rows where its ranks outnumber a rank's experts."""
    count = expert_count(experts[0][1])
    by_rows = mesh.size(-1) * expert_parallel_size > count
    return ExpertUnits([module for _, module in experts], mesh, by_rows)


def apply_expert_parallel(module: nn.Module, expert_mesh: DeviceMesh) -> list[tuple[str, nn.Module]]:
    """Split every experts module of ``module`` over ``expert_mesh`` in place; return them by name.

    Raises:
        ValueError: The model has no experts, keeps them as a list of modules (litgpt's ``LLaMAMoE``), carries LoRA
            adapters on them, has experts of another forward than transformers' routed one, or a layer's experts do
            not divide by the expert-parallel size.
    """
    size = expert_mesh.size()
    experts = expert_modules(module)
    if not experts:
        raise ValueError(
            f"HybridFSDPStrategy(expert_parallel_size={size}) splits mixture-of-experts layers, but"
            f" {type(module).__name__} has no module named 'experts'. Drop expert_parallel_size for a dense model."
        )
    for name, experts_module in experts:
        _check_splittable(name, experts_module, size)
    for _, experts_module in experts:
        _split(experts_module, expert_mesh)
    info_on_rank_zero(
        _logger,
        "expert parallelism (%d): %d layers' experts split, %d of %d experts per rank",
        size,
        len(experts),
        expert_count(experts[0][1]) // size,
        expert_count(experts[0][1]),
    )
    return experts


def _check_splittable(name: str, experts: nn.Module, size: int) -> None:
    what = f"HybridFSDPStrategy(expert_parallel_size={size}): {name} ({type(experts).__name__})"
    if isinstance(experts, nn.ModuleList):
        raise ValueError(
            f"{what} holds its experts as a list of modules (litgpt's LLaMAMoE), whose forward loops over them on"
            " every rank; expert parallelism needs them fused as transformers 5 models keep them (gate_up_proj,"
            " down_proj). expert_parallel_size=1 works: the experts are sharded by FSDP inside each layer."
        )
    if any("lora_" in param_name for param_name, _ in experts.named_parameters()) or hasattr(experts, "base_layer"):
        raise ValueError(
            f"{what} carries LoRA adapters, which would need the same split and token exchange as the experts. Train"
            " adapters on the attention and dense layers only (peft target_modules without the experts), or"
            " expert_parallel_size=1."
        )
    if not _routed_forward(experts):
        raise ValueError(
            f"{what} is not an experts module expert parallelism knows: its forward takes"
            f" {_forward_arguments(experts)}, not the (hidden_states, top_k_index, top_k_weights) of transformers 5's"
            " @use_experts_implementation experts (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, ...)."
            " expert_parallel_size=1 works: the experts are sharded by FSDP inside each layer."
        )
    count = expert_count(experts)
    if count == 0 or count % size != 0:
        raise ValueError(
            f"{what} holds {count} experts, which do not divide by expert_parallel_size({size}): each rank of the"
            f" group holds the same number of experts. Choose a divisor of {count} that divides the ranks per node."
        )


ROUTED_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


def _forward_arguments(experts: nn.Module) -> tuple[str, ...]:
    import inspect

    return tuple(inspect.signature(type(experts).forward).parameters)[1:]


def _routed_forward(experts: nn.Module) -> bool:
    """Whether ``experts`` computes routed rows as transformers 5's decorated experts do (21 classes in 5.3): forward
    ``(hidden_states, top_k_index, top_k_weights)``, the experts implementations' ``_apply_gate`` set. Not GPT-OSS's
    ``(hidden_states, router_indices, routing_weights)``, Llama 4's pre-dispatched rows, Granite's ``expert_size``."""
    return _forward_arguments(experts) == ROUTED_ARGUMENTS and hasattr(type(experts), "_apply_gate")


def _split(experts: nn.Module, expert_mesh: DeviceMesh) -> None:
    """Keep this rank's ``E / N`` experts of each fused parameter (a DTensor ``Shard(0)`` on ``expert_mesh``) and
    swap in the expert-parallel forward. Like ``fully_shard``, each rank slices its own tensor: no communication."""
    from torch.distributed.tensor import DTensor, Shard

    count, size, rank = expert_count(experts), expert_mesh.size(), expert_mesh.get_local_rank()
    local = count // size
    parameters = module_parameters(experts)
    for name, param in list(parameters.items()):
        if param is None or param.ndim == 0 or param.shape[0] != count:
            continue
        shard = param.data[rank * local : (rank + 1) * local].clone()
        tensor = DTensor.from_local(shard, expert_mesh, [Shard(0)], run_check=False)
        parameters[name] = nn.Parameter(tensor, requires_grad=param.requires_grad)
    experts.expert_group = expert_mesh.get_group()
    experts.__class__ = expert_parallel_class(type(experts))


@functools.cache
def expert_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``cls`` whose forward exchanges the tokens around ``cls.forward`` on the local experts (one
    class per experts class, as ``fully_shard`` makes its own)."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return expert_parallel_forward(self, cls.forward, hidden_states, top_k_index, top_k_weights)

    return type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": forward})


# left eager in a compiled block, as torchtitan leaves its dispatch: its sizes come from the counts (.tolist()), where
# dynamo would break the graph anyway (the compiled test's gradients were the same without this decorator)
@torch.compiler.disable
def expert_parallel_forward(
    experts: nn.Module,
    forward: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Dispatch the routed rows, run ``forward`` (the model's own experts forward) on the local experts with each
    row's local expert and weight 1, and combine the results with the routing weights."""
    group = experts.expert_group
    rows, local_ids, route = dispatch(hidden_states, top_k_index, _global_count(experts), group)
    with _local_experts(experts) as weights:
        ones = torch.ones(local_ids.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = forward(experts, rows, local_ids.unsqueeze(-1), ones)
        if rows.shape[0] == 0:
            # no row for this rank's experts: the model's forward may then use neither the rows nor the weights (the
            # eager loop skips experts without rows). The empty output tied to both, backward still runs the rows'
            # exchange and the experts' gradient reduction (of zeros) here, as on every other rank of the group
            out = out + (rows.sum() + sum(weight.sum() for weight in weights)) * 0
    return combine(out, route, top_k_weights, group)


def _global_count(experts: nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    fused = next(p for p in experts.parameters(recurse=False) if isinstance(p, DTensor))
    return fused.shape[0]


@contextmanager
def _local_experts(experts: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside: the experts' DTensor parameters read as their local tensors (this rank's experts, gradients flowing
    to the DTensors, divided by the group's size) and ``num_experts`` as the local count, for the model's own
    forward."""
    from torch.distributed.tensor import DTensor

    size = experts.expert_group.size()
    shadowed = {
        name: _ScaleGradient.apply(p.to_local(), 1 / size)
        for name, p in module_parameters(experts).items()
        if isinstance(p, DTensor)
    }
    had_count = "num_experts" in vars(experts)
    count = vars(experts).get("num_experts")
    vars(experts).update(shadowed)  # an instance attribute is found before nn.Module's __getattr__ looks up parameters
    if had_count:
        vars(experts)["num_experts"] = next(iter(shadowed.values())).shape[0]
    try:
        yield list(shadowed.values())
    finally:
        for name in shadowed:
            del vars(experts)[name]
        if had_count:
            vars(experts)["num_experts"] = count


class _ScaleGradient(torch.autograd.Function):
    """The tensor unchanged; its gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None
