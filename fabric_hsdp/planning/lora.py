"""LoRA on a planned model (``fabric-hsdp plan --lora_r R``): the base frozen, adapters on its linear layers.

Each targeted linear layer (a 2-D ``<module>.weight`` of ``out x in``) gets two trainable matrices, ``lora_A``
(``r x in``) and ``lora_B`` (``out x r``), in the FSDP unit of the layer they adapt, as peft's ``LoraConfig`` and
litgpt's ``lora.GPT`` make them; litgpt's fused ``qkv`` projection with query, key and value adapted holds one
``lora_A`` of ``3r x in``. Every other parameter is frozen. The default targets are every linear layer of the blocks
(peft's ``target_modules="all-linear"``, litgpt's ``lora_query/key/value/projection/mlp``: what
``examples/finetune.py --lora_r`` trains). :mod:`~fabric_hsdp.planning.memory` then holds the adapters in the state
dtype (fp32 under mixed precision) with gradients and optimizer state, the base in the compute dtype without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fabric_hsdp.planning.model import ModelShape, ParameterShape

# litgpt's fused projection: query, key and value each get r rows of lora_A (LoRAQKVLinear)
_FUSED_ADAPTERS = {"qkv": 3}


def with_lora(model: ModelShape, rank: int, targets: Sequence[str] | None = None) -> ModelShape:
    """``model`` with its parameters frozen and LoRA adapters of rank ``rank`` on the targeted linear layers.

    Args:
        rank: The adapters' rank ``r``.
        targets: Module names as peft's ``target_modules`` takes them (``"q_proj"`` matches every
            ``....q_proj``); None: every linear layer of the blocks.

    Raises:
        ValueError: ``rank`` is not positive, or the targets match no linear layer (the message lists the names).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_r={rank!r} must be a positive rank (e.g. 16).")
    linear = [p for p in model.parameters if len(p.shape) == 2 and p.name.endswith(".weight")]
    if targets is None:
        chosen = [p for p in linear if p.unit]
    else:
        chosen = [p for p in linear if any(_matches(_module(p), target) for target in targets)]
    if not chosen:
        names = sorted({_module(p).split(".")[-1] for p in linear})
        raise ValueError(
            f"lora_targets={list(targets) if targets is not None else None} match no linear layer of"
            f" {model.description}; its linear layers are named {names}. Pass some of those."
        )
    parameters = [replace(p, trainable=False) for p in model.parameters]
    for weight in chosen:
        module, (rows, columns) = _module(weight), weight.shape
        fused = _FUSED_ADAPTERS.get(module.split(".")[-1], 1)
        parameters.append(ParameterShape(f"{module}.lora_A", (fused * rank, columns), weight.unit, None))
        parameters.append(ParameterShape(f"{module}.lora_B", (rows, rank), weight.unit, None))
    adapters = f"LoRA r={rank} on {len(chosen)} linear layers"
    return replace(
        model, description=f"{model.description} + {adapters}", parameters=tuple(parameters), adapters=adapters
    )


def _module(weight: ParameterShape) -> str:
    return weight.name.removesuffix(".weight")


def _matches(module: str, target: str) -> bool:
    return module == target or module.endswith(f".{target}")
