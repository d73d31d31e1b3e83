"""The transformers ``PreTrainedModel`` inside a module, asked only when transformers is imported (a model of its
classes exists only then).

Two questions, two answers: :func:`pretrained_model_of` is the outermost one (whose conversion mapping a checkpoint
load follows); :func:`pretrained_owners` gives every submodule its innermost one (whose ``_init_weights`` initialises
it; composite models nest them).
"""

from __future__ import annotations

import sys

from torch import nn


def pretrained_model_of(module: nn.Module) -> nn.Module | None:
    """The transformers ``PreTrainedModel`` that ``module`` is (or holds first), or ``None``."""
    if "transformers" not in sys.modules:  # a model built with transformers has imported it
        return None
    from transformers import PreTrainedModel

    return next((sub for sub in module.modules() if isinstance(sub, PreTrainedModel)), None)


def pretrained_owners(module: nn.Module) -> dict[int, nn.Module]:
    """``id(submodule)`` -> the innermost transformers ``PreTrainedModel`` holding it (composite models nest them)."""
    transformers = sys.modules.get("transformers")  # a model of that class exists only if transformers is imported
    if transformers is None:
        return {}
    owner_of: dict[int, nn.Module] = {}

    def walk(sub: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(sub, transformers.PreTrainedModel):
            owner = sub
        if owner is not None:
            owner_of[id(sub)] = owner
        for child in sub.children():
            walk(child, owner)

    walk(module, None)
    return owner_of
