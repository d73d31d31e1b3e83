"""Mixture-of-experts layers: finding them, and what the strategy does not split.

A model's experts are the modules named ``experts``: transformers 5 keeps them as fused parameters
(``gate_up_proj`` of ``[experts, 2 * intermediate, hidden]``), litgpt's ``LLaMAMoE`` as an ``nn.ModuleList`` of MLPs.
Under HSDP each decoder layer is one FSDP unit and its experts are sharded like any parameter (``Shard(0)`` of the
fused tensors is a range of experts); every rank routes its own tokens through the gathered experts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

# what transformers 5 records the routers' outputs under (``_can_record_outputs``), for the load-balancing loss
ROUTER_LOGITS = "router_logits"


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding a layer's experts (named ``experts``), by name, in model order."""
    return [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"]


def expert_count(experts: nn.Module) -> int:
    """How many experts ``experts`` holds: its length (a ModuleList) or the leading dim of its fused parameters."""
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    fused = [param for param in experts.parameters(recurse=False) if param.ndim == 3]
    return fused[0].shape[0] if fused else 0


def recorded_routers(model: nn.Module, within: nn.Module) -> list[nn.Module]:
    """The modules below ``within`` (not it) whose outputs a transformers 5 ``model`` records as ``router_logits``.

    Matched as transformers' ``install_all_output_capturing_hooks`` matches its ``_can_record_outputs`` entries: an
    ``OutputRecorder``'s class (inside its ``layer_name`` when it gives one), a bare class, or a name suffix.
    """
    specs = getattr(model, "_can_record_outputs", None) or {}
    entries = specs.get(ROUTER_LOGITS, [])
    entries = entries if isinstance(entries, list) else [entries]
    found = []
    for name, module in within.named_modules():
        if module is within:
            continue
        for entry in entries:
            target = getattr(entry, "target_class", entry)
            suffix = entry if isinstance(entry, str) else getattr(entry, "class_name", None)
            layer_name = getattr(entry, "layer_name", None)
            by_class = isinstance(target, type) and isinstance(module, target)
            if (by_class or (suffix is not None and name.endswith(suffix))) and (not layer_name or layer_name in name):
                found.append(module)
                break
    return found


def refuse_tensor_parallel(model: nn.Module) -> None:
    """Raise for ``tensor_parallel_plan="auto"`` on a model with experts, saying what works instead (the planner then
    guesses split dims by name)."""
    experts = expert_modules(model)
    if not experts:
        return
    name, module = experts[0]
    raise ValueError(
        f"HybridFSDPStrategy(tensor_parallel_plan='auto') has no plan for mixture-of-experts layers ({name}:"
        f" {type(module).__name__} with {expert_count(module)} experts, {len(experts)} such layers): splitting each"
        " expert's projections over tensor-parallel ranks would need the router's token dispatch split with them."
        " tensor_parallel_size=1 works: each decoder layer is an FSDP unit whose experts are sharded by expert over"
        " the shard dim (shard_size), replicated over the replicas. Or pass your own plan (a dict or a callable)."
    )


# config names of the experts each token is routed to, and of the experts per layer (transformers, litgpt)
TOP_K_NAMES = ("num_experts_per_tok", "n_expert_per_token")
EXPERTS_NAMES = ("num_experts", "num_local_experts", "n_expert")


def active_parameters(named_shapes: Iterable[tuple[str, Sequence[int]]], config: Any) -> int | None:
    """Parameters one token passes through: everything but the experts, plus ``top_k / experts`` of the experts'
    (``None`` for a model whose config names no routed experts)."""
    top_k, experts = _config_int(config, TOP_K_NAMES), _config_int(config, EXPERTS_NAMES)
    if not top_k or not experts:
        return None
    total = 0
    for name, shape in named_shapes:
        numel = math.prod(shape)
        total += numel * top_k // experts if ".experts." in name else numel
    return total


def _config_int(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
