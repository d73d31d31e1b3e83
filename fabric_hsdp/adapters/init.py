"""Adapters made real from the meta device get the values their library's own init gives.

The materialisation re-initialises every module that held meta tensors as its model would (``reset_parameters()``,
or a transformers model's ``_init_weights``): for peft's ``lora_A``/``lora_B`` (plain ``nn.Linear`` inside a
transformers model) that is a normal(0, 0.02) draw, so ``B`` is not zero and the model at step 0 is not the base
model. Here each adapter is initialised as its library does when it creates it: peft's layers with ``nn.Linear``'s
init then the layer's ``reset_lora_parameters(adapter, init_lora_weights)`` (``B = 0``); litgpt's ``LoRALinear`` with
its ``reset_parameters()``.
"""

from __future__ import annotations

import sys

from torch import nn

from fabric_hsdp.models.lora import Wrapper, wrappers_of

# init_lora_weights values that need no base weights (random draws, constants): the ones possible on the meta device
_PEFT_RANDOM_INITS = (True, False, "gaussian")


def _peft_configs(module: nn.Module) -> dict:
    for sub in module.modules():
        configs = getattr(sub, "peft_config", None)
        if isinstance(configs, dict) and configs:
            return configs
    return {}


def _meta_adapters(layer: nn.Module, wrapper: Wrapper) -> bool:
    for attribute in wrapper.adapter_attributes:
        held = getattr(layer, attribute, None)
        tensors = [held] if not isinstance(held, nn.Module) else [*held.parameters(), *held.buffers()]
        if any(getattr(tensor, "is_meta", False) for tensor in tensors):
            return True
    return False


def refuse_unsupported_adapters(module: nn.Module, tensor_parallel: bool) -> None:
    """Raise before sharding what cannot be set up right: LoRA under tensor parallelism, and peft inits that need
    the base weights (PiSSA, OLoRA, LoftQ, EVA, DoRA's magnitudes, ...) on a model built on the meta device.

    Raises:
        ValueError: naming the layer, the setting and what works instead.
    """
    _refuse_copies_of_base_modules(module)
    wrappers = wrappers_of(module)
    if not wrappers:
        return
    name, (_, wrapper) = next(iter(wrappers.items()))
    if tensor_parallel:
        raise ValueError(
            f"HybridFSDPStrategy(tensor_parallel_size>1) does not support LoRA models yet ({len(wrappers)}"
            f" {wrapper.library} LoRA layers, e.g. {name!r}): tensor parallelism would split the base layers but not"
            " their adapters, whose outputs would then not match. Use tensor_parallel_size=1 (FSDP/HSDP shards the"
            " base and the adapters; a frozen base costs only its shards)."
        )
    configs = _peft_configs(module)
    for name, (layer, wrapper) in wrappers.items():
        if wrapper.library != "peft" or not _meta_adapters(layer, wrapper):
            continue
        for adapter in getattr(layer, "lora_A", {}):
            config = configs.get(adapter)
            init = getattr(config, "init_lora_weights", True)
            if init not in _PEFT_RANDOM_INITS or getattr(config, "use_dora", False):
                setting = "use_dora=True" if getattr(config, "use_dora", False) else f"init_lora_weights={init!r}"
                raise ValueError(
                    f"peft's LoraConfig({setting}) computes the adapter {adapter!r} of {name!r} from the base weights,"
                    " which fabric.init_module(empty_init=True) leaves on the meta device until fabric.load_raw: it"
                    " cannot be initialised at setup. Use init_lora_weights=True or 'gaussian', or build the model"
                    " with its weights loaded (empty_init=False)."
                )


def _refuse_copies_of_base_modules(module: nn.Module) -> None:
    """peft's ``modules_to_save`` and ``trainable_token_indices`` train a copy of a base module, taken when the
    model is wrapped: on the meta device that copy has no values, and the base's are loaded into the original only."""
    peft_other = sys.modules.get("peft.utils.other")
    wrapper_class = getattr(peft_other, "AuxiliaryTrainingWrapper", None)
    if wrapper_class is None:
        return
    for name, sub in module.named_modules():
        if isinstance(sub, wrapper_class) and any(t.is_meta for t in sub.parameters()):
            raise ValueError(
                f"peft's {type(sub).__name__} at {name!r} (LoraConfig(modules_to_save=...) or trainable_token_indices)"
                " trains a copy of a base module taken when the model was wrapped, which on the meta device"
                " (fabric.init_module(empty_init=True)) holds no values and is not filled by fabric.load_raw. Leave"
                " modules_to_save out (train adapters only), or build the model with empty_init=False."
            )


def initialize_adapters(module: nn.Module, owners: list[nn.Module]) -> list[str]:
    """Give the adapters among ``owners`` (modules just made real) their library's init; return the layers done."""
    owner_ids = {id(owner) for owner in owners}
    configs = _peft_configs(module)
    done = []
    for name, (layer, wrapper) in wrappers_of(module).items():
        if wrapper.library == "peft":
            adapters = [
                child
                for attribute in wrapper.adapter_attributes
                if isinstance(getattr(layer, attribute, None), nn.Module)
                for child in getattr(layer, attribute).modules()
                if id(child) in owner_ids
            ]
            if not adapters:
                continue
            for child in adapters:  # as peft created them: nn.Linear / nn.Embedding's own init
                if callable(getattr(child, "reset_parameters", None)):
                    child.reset_parameters()
            for adapter in getattr(layer, "lora_A", {}):
                layer.reset_lora_parameters(adapter, getattr(configs.get(adapter), "init_lora_weights", True))
            done.append(name)
        elif id(layer) in owner_ids:  # litgpt: lora_A and lora_B are the layer's own parameters
            layer.reset_parameters()
            done.append(name)
    return done
