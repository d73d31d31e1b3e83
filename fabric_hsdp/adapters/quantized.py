"""QLoRA bases (bitsandbytes 4-bit and 8-bit layers) are refused at ``setup_module``, with what works instead.

A QLoRA model (transformers' ``BitsAndBytesConfig(load_in_4bit=True)``, peft's ``prepare_model_for_kbit_training``)
holds its base in ``bitsandbytes.nn.Linear4bit`` modules whose weights are ``Params4bit``: packed 4-bit values in a
``quant_storage`` dtype (``uint8`` unless set) with their scales in a ``quant_state`` beside the tensor. Under FSDP2
the mixed-precision policy casts every parameter of a unit to its ``param_dtype`` for the all-gather, and the
strategy holds a frozen base in the compute dtype (``fsdp.hold_frozen_in_compute_dtype``): both would convert the
packed bytes as numbers. Whether ``fully_shard`` over ``Params4bit`` works with a matching ``quant_storage`` is not
tested by this project, so such a base is refused on every device. Found by class name: bitsandbytes is not imported.
"""

from __future__ import annotations

import torch
from torch import nn

_QUANTIZED_PARAMETERS = {"Params4bit": "4-bit", "Int8Params": "8-bit"}
_QUANTIZED_MODULES = {"Linear4bit": "4-bit", "LinearFP4": "4-bit", "LinearNF4": "4-bit", "Linear8bitLt": "8-bit"}


def _quantized(module: nn.Module) -> tuple[str, str, str] | None:
    """The first quantized layer of ``module``: its name, what it is, and its bits."""
    for name, sub in module.named_modules():
        for leaf, parameter in sub.named_parameters(recurse=False):
            for cls in type(parameter).__mro__:
                if cls.__name__ in _QUANTIZED_PARAMETERS:
                    what = f"{type(sub).__name__} with a {cls.__name__} {leaf!r}"
                    return name, what, _QUANTIZED_PARAMETERS[cls.__name__]
        for cls in type(sub).__mro__:
            if cls.__name__ in _QUANTIZED_MODULES:
                return name, cls.__name__, _QUANTIZED_MODULES[cls.__name__]
    return None


def refuse_quantized_base(module: nn.Module, device: torch.device) -> None:
    """Raise when ``module`` holds bitsandbytes-quantized layers (a QLoRA base).

    Raises:
        ValueError: naming the first quantized layer, why it cannot be set up on ``device``, and what works.
    """
    found = _quantized(module)
    if found is None:
        return
    name, what, bits = found
    if device.type == "cpu":
        # recent bitsandbytes (0.50 read) has CPU kernels too; QLoRA training is a CUDA method: say so, not "impossible"
        reason = (
            "this run is on CPU, and bitsandbytes' quantized training is made for a CUDA GPU (its CPU kernels are"
            " recent and untested here); on any device HybridFSDPStrategy"
        )
    else:
        reason = "HybridFSDPStrategy"
    raise ValueError(
        f"{name!r} ({what}) is a bitsandbytes {bits} layer, a QLoRA base: {reason} does not support quantized bases"
        " yet (FSDP2's mixed precision and the strategy's frozen base in the compute dtype would cast the packed"
        " weights as numbers; fully_shard over bitsandbytes' parameters is not tested here). What works: load the"
        " base unquantized (no BitsAndBytesConfig) with LoRA adapters and precision='bf16-mixed': the frozen base"
        " costs its bf16 shards only, no gradients or optimizer state (`fabric-hsdp plan MODEL --lora_r 16` shows"
        " the bytes per device)."
    )
