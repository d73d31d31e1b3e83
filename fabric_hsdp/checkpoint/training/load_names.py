"""The names a raw load matches a checkpoint's tensors against: a LoRA model's base tensors by the base checkpoint's
names (:mod:`fabric_hsdp.models.lora`), its adapters by their own and optional; the model's own names otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fabric_hsdp.checkpoint.core.keys import KeyMapSpec, make_key_map
from fabric_hsdp.models.lora import base_names


@dataclass
class LoadNames:
    """How a raw load names a model's tensors: a LoRA model's base tensors by the base checkpoint's names, its adapters
    by their own and optional (absent from a base checkpoint, they keep their init). Identity for other models."""

    targets: dict[str, torch.Tensor]  # by load name
    tied: dict[str, str]
    fused: dict
    key_map: KeyMapSpec
    optional: set[str] = field(default_factory=set)
    model_key: dict[str, str] = field(default_factory=dict)  # load name -> state-dict key, where they differ

    def model_result(self, result: Any) -> Any:
        """``result`` (a raw load's ``LoadResult``) with the model's own state-dict keys."""
        for attribute in ("loaded", "missing", "mismatched"):
            setattr(result, attribute, [self.model_key.get(name, name) for name in getattr(result, attribute)])
        return result


def load_names(
    module: nn.Module, targets: dict[str, torch.Tensor], tied: dict[str, str], fused: dict, key_map: KeyMapSpec
) -> LoadNames:
    """The names a raw load of ``module`` matches a checkpoint's against (see :class:`LoadNames`).

    A checkpoint of the LoRA model itself (its own wrapped names: a full save, an adapter-only one) matches too: its
    keys are renamed like the model's before matching, after ``key_map``.
    """
    names = base_names(module)
    if not names:
        return LoadNames(targets, tied, fused, key_map)
    load_name = {key: key if name is None else name for key, name in names.items()}
    model_key = {name: key for key, name in load_name.items() if name != key}
    if len(set(load_name.values())) != len(load_name):
        twice = sorted({name for name in load_name.values() if list(load_name.values()).count(name) > 1})
        raise ValueError(
            f"{type(module).__name__}: several tensors have the same base-model name once the LoRA wrappers' names"
            f" are dropped ({twice[:3]}): which one a base checkpoint fills is ambiguous. Pass key_map= to load it."
        )
    rename = make_key_map(key_map)

    def to_load_name(key: str) -> str | None:
        renamed = rename(key)
        return None if renamed is None else load_name.get(renamed, renamed)

    return LoadNames(
        targets={load_name[key]: tensor for key, tensor in targets.items()},
        tied={load_name[key]: load_name[first] for key, first in tied.items()},
        fused={load_name[key]: rows for key, rows in fused.items()},
        key_map=to_load_name,
        optional={key for key, name in names.items() if name is None},
        model_key=model_key,
    )
