"""Why a checkpoint does not fit a model, in one sentence a user can act on.

A list of missing and unexpected tensors says *what* differs; the fix depends on *why*: the checkpoint uses another
project's names (litgpt vs transformers), it is of another model (``model_type`` of its ``config.json``), it holds
only LoRA adapters (saved with ``filter=``), or the model was built with another config (which field). "Pass
strict=False" is the right hint for none of these: it loads what matches and leaves the rest at its init.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

Shapes = tuple[Sequence[int], Sequence[int]]  # (the model's shape, the checkpoint's) of one tensor
_SHOWN_FIELDS = 3
# Config entries that say nothing about the shapes or names of a model's tensors.
_NOT_SHAPES = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "bos_token_id"}
_NOT_SHAPES |= {"eos_token_id", "pad_token_id", "max_position_embeddings", "block_size", "rope_theta"}
# Fields that set tensors' shapes in transformers' and litgpt's configs: named first when configs differ.
_SHAPE_FIELDS = ("vocab_size", "padded_vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer")
_SHAPE_FIELDS += ("intermediate_size", "moe_intermediate_size", "num_attention_heads", "n_head", "num_key_value_heads")
_SHAPE_FIELDS += ("n_query_groups", "head_dim", "head_size", "num_experts", "num_local_experts", "n_expert")
# Parts of a tensor name that only LoRA adapters have (peft's and litgpt's).
_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass(frozen=True)
class Configs:
    """The configs a load can compare: the model's, and the checkpoint's with the file it was read from."""

    model: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    checkpoint_file: str | None = None


def model_config(module: nn.Module) -> dict[str, Any] | None:
    """The config the model was built with: a transformers ``PretrainedConfig`` or a litgpt ``Config`` (the first
    module that holds one, so a peft model gives its base model's), as a dict; ``None`` without one."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if callable(getattr(config, "to_dict", None)):
            return config.to_dict()
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return dataclasses.asdict(config)
    return None


def checkpoint_config(path: Path) -> tuple[dict[str, Any], str] | None:
    """The config saved with a checkpoint: ``config.json`` (transformers) or ``model_config.yaml`` (litgpt) in the
    checkpoint's directory (or next to its file), with its path; ``None`` when there is none or it cannot be read."""
    directory = path if path.is_dir() else path.parent
    for name in ("config.json", "model_config.yaml"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            text = file.read_text()
            if name.endswith(".json"):
                loaded = json.loads(text)
            else:
                import yaml

                loaded = yaml.safe_load(text)
        except (OSError, ValueError, ImportError):
            return None
        return (loaded, str(file)) if isinstance(loaded, dict) else None
    return None


def is_adapter_name(key: str) -> bool:
    """Whether ``key`` names a LoRA adapter tensor (peft's ``lora_A``/``lora_B``..., litgpt's ``lora_A``)."""
    return any(part in _ADAPTER_PARTS for part in key.split("."))


def reason(
    missing: Sequence[str], unexpected: Sequence[str], mismatched: Sequence[Shapes], configs: Configs | None = None
) -> str | None:
    """The one sentence that says why the checkpoint does not fit and what to do, or ``None`` when none is known.

    Args:
        missing: model keys the checkpoint has no tensor for.
        unexpected: checkpoint keys no model key uses.
        mismatched: ``(model shape, checkpoint shape)`` of each tensor both have with different shapes.
        configs: the model's and the checkpoint's configs, where known.
    """
    configs = configs or Configs()
    return (
        other_naming(missing, unexpected)
        or _adapter_only(missing, unexpected)
        or _other_model(configs)
        or _other_config(configs)
        or (None if missing or unexpected else _other_size(mismatched, configs))
    )


# how each project names a Llama's layers; a checkpoint of one loaded into a model of the other matches nothing useful
_NAMINGS = {
    "litgpt": ("transformer.h.", "transformer.wte."),
    "transformers": ("model.layers.", "model.embed_tokens."),
}
_CONVERT = {
    ("litgpt", "transformers"): (
        "convert it to litgpt's layout with `litgpt convert_to_litgpt` (its convert_hf_checkpoint), or build the"
        " transformers model (AutoModelForCausalLM.from_config) instead"
    ),
    ("transformers", "litgpt"): (
        "convert it with `litgpt convert_from_litgpt` (its convert_lit_checkpoint), or build litgpt's GPT instead"
    ),
}


def other_naming(missing: Sequence[str], unexpected: Sequence[str]) -> str | None:
    """When the model uses one project's names and the checkpoint the other's (litgpt vs transformers), what to do."""
    for model_side, checkpoint_side in _CONVERT:
        model_prefixes, checkpoint_prefixes = _NAMINGS[model_side], _NAMINGS[checkpoint_side]
        if any(key.startswith(model_prefixes) for key in missing) and any(
            key.startswith(checkpoint_prefixes) for key in unexpected
        ):
            return (
                f"The model uses {model_side}'s parameter names and the checkpoint {checkpoint_side}'s (their q/k/v"
                f" and MLP weights are also laid out differently, so no key_map fixes it, and strict=False would"
                f" train from random weights): {_CONVERT[(model_side, checkpoint_side)]}."
            )
    return None


def _adapter_only(missing: Sequence[str], unexpected: Sequence[str]) -> str | None:
    if not missing or not unexpected or not all(is_adapter_name(key) for key in unexpected):
        return None
    return (
        f"The checkpoint holds LoRA adapters only ({len(unexpected)} tensors such as {unexpected[0]!r}: an"
        " adapter-only checkpoint, as fabric.save(filter=) or peft's save_pretrained write), and the model has no"
        " adapters. Build the model with its adapters (peft's get_peft_model, litgpt's lora.GPT), load the base"
        " weights with fabric.load_raw(base, model), then this checkpoint with strict=False."
    )


def _other_model(configs: Configs) -> str | None:
    model_type = (configs.model or {}).get("model_type")
    saved_type = (configs.checkpoint or {}).get("model_type")
    if not model_type or not saved_type or model_type == saved_type:
        return None
    return (
        f"It is a checkpoint of another model: its config ({configs.checkpoint_file}) says model_type {saved_type!r},"
        f" the model is {model_type!r}. Build the model from the checkpoint's config (AutoModelForCausalLM.from_config("
        "AutoConfig.from_pretrained(directory))), or load a checkpoint of this model."
    )


def differing_fields(model: dict[str, Any], saved: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, model value, saved value)`` of the config fields both have that set a tensor's shape or presence
    (integers, and whether the embeddings are tied), where they differ."""
    fields = []
    for name, value in model.items():
        if name in _NOT_SHAPES or name not in saved or saved[name] == value:
            continue
        if name == "tie_word_embeddings" or (type(value) is int and type(saved[name]) is int):
            fields.append((name, value, saved[name]))
    return sorted(fields, key=lambda field: field[0] not in _SHAPE_FIELDS)


def _other_config(configs: Configs) -> str | None:
    if configs.model is None or configs.checkpoint is None:
        return None
    fields = differing_fields(configs.model, configs.checkpoint)
    if not fields:
        return None
    shown = ", ".join(f"{name} {saved!r} (the model: {value!r})" for name, value, saved in fields[:_SHOWN_FIELDS])
    more = f" and {len(fields) - _SHOWN_FIELDS} more" if len(fields) > _SHOWN_FIELDS else ""
    return (
        f"The model was built with another config: the checkpoint's ({configs.checkpoint_file}) has {shown}{more}."
        " Build the model with the checkpoint's config, or load a checkpoint of this configuration."
    )


def _other_size(mismatched: Sequence[Shapes], configs: Configs) -> str | None:
    """Every mismatched shape differs in one size the same way (e.g. 256 -> 320 rows): name the config fields of the
    model that hold the model's size."""
    pairs = set()
    for model_shape, saved_shape in mismatched:
        if len(model_shape) != len(saved_shape):
            return None
        pairs |= {(a, b) for a, b in zip(model_shape, saved_shape) if a != b}
    if len(pairs) != 1:
        return None
    ((size, saved_size),) = pairs
    fields = [name for name, value in (configs.model or {}).items() if type(value) is int and value == size]
    named = f" (the model's {' and '.join(fields[:_SHOWN_FIELDS])})" if fields else ""
    return (
        f"The model was built with another config: its tensors have {size}{named} where the checkpoint's have"
        f" {saved_size}. Build the model with the configuration the checkpoint was saved from."
    )
