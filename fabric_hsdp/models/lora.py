"""The names a LoRA model's tensors have in its base model's checkpoint.

A LoRA library wraps the layers it adapts, and its wrappers enter the parameter names: peft puts the whole model under
``base_model.model.`` and each adapted layer's own weight under ``.base_layer.``
(``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``); litgpt's ``lora.GPT`` under ``.linear.``
(``transformer.h.0.attn.qkv.linear.weight``). A base checkpoint knows none of them. The wrappers are found in the
model itself (peft's ``BaseTunerLayer``, litgpt's ``LoRALayer``), never guessed from names, and the adapter tensors they
add (``lora_A``, ``lora_B``, ...) are told apart from the base's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Wrapper:
    """One adapted layer: the child holding the base layer and the attributes holding the adapter tensors."""

    library: str  # "peft" or "litgpt"
    inner: str  # the child that is the base layer: "base_layer" (peft), "linear" (litgpt)
    adapter_attributes: tuple[str, ...]  # children or parameters holding adapter tensors


def user_module(module: nn.Module) -> nn.Module:
    """The module the user built, inside the wrapper ``fabric.setup_module`` returns (whose names start with
    ``_forward_module.``, so no name of it is the base checkpoint's)."""
    from lightning.fabric.wrappers import _FabricModule

    return module.module if isinstance(module, _FabricModule) else module


def wrapper_of(module: nn.Module) -> Wrapper | None:
    """``module`` as a LoRA wrapper of a base layer, or ``None``. Only libraries already imported are looked at."""
    peft_tuners = sys.modules.get("peft.tuners.tuners_utils")
    if peft_tuners is not None and isinstance(module, peft_tuners.BaseTunerLayer):
        return Wrapper("peft", "base_layer", tuple(module.adapter_layer_names))
    litgpt_lora = sys.modules.get("litgpt.lora")
    if litgpt_lora is not None and isinstance(module, litgpt_lora.LoRALayer):
        return Wrapper("litgpt", "linear", ("lora_A", "lora_B"))
    return None


def wrappers_of(module: nn.Module) -> dict[str, tuple[nn.Module, Wrapper]]:
    """Every LoRA wrapper in ``module``, by module name."""
    found = {}
    for name, sub in module.named_modules():
        wrapper = wrapper_of(sub)
        if wrapper is not None:
            found[name] = (sub, wrapper)
    return found


def base_model_prefix(module: nn.Module) -> str:
    """The name prefix of the base model inside a peft model (``"base_model.model."`` for ``get_peft_model``'s
    ``PeftModel``, ``"model."`` for a bare ``LoraModel``); ``""`` for anything else."""
    get_base_model = getattr(module, "get_base_model", None)
    peft = sys.modules.get("peft")
    if peft is None or not callable(get_base_model):
        return ""
    base = get_base_model()
    for name, sub in module.named_modules():
        if sub is base and name:
            return name + "."
    return ""


def base_names(module: nn.Module) -> dict[str, str | None]:
    """Each state-dict key of ``module`` -> its name in the base model's checkpoint, or ``None`` for an adapter tensor.

    Empty when ``module`` holds no LoRA wrapper (its names are the base model's). ``module`` may be the one
    ``fabric.setup_module`` returned.
    """
    module = user_module(module)
    wrappers = {name: wrapper for name, (_, wrapper) in wrappers_of(module).items()}
    if not wrappers:
        return {}
    prefix = base_model_prefix(module)
    names: dict[str, str | None] = {}
    for key in module.state_dict(keep_vars=True):
        names[key] = _base_name(key, wrappers, prefix)
    return names


def _base_name(key: str, wrappers: dict[str, Wrapper], prefix: str) -> str | None:
    parts = key.split(".")
    kept: list[str] = []
    path = ""
    for part in parts:
        wrapper = wrappers.get(path)
        if wrapper is not None:
            if part in wrapper.adapter_attributes:
                return None
            if part != wrapper.inner:
                kept.append(part)
        else:
            kept.append(part)
        path = f"{path}.{part}" if path else part
    name = ".".join(kept)
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def adapter_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of ``module``'s adapter tensors, in model order (empty without LoRA wrappers); ``module``
    may be the one ``fabric.setup_module`` returned (the keys are then the user's model's)."""
    return [key for key, name in base_names(module).items() if name is None]
