"""What the package knows of transformers models: the ``PreTrainedModel`` inside a module, asked only when
transformers is imported (a model of its classes exists only then), and their KV cache turned off for training.

Two questions, two answers: :func:`pretrained_model_of` is the outermost one (whose conversion mapping a checkpoint
load follows); :func:`pretrained_owners` gives every submodule its innermost one (whose ``_init_weights`` initialises
it; composite models nest them).
"""

from __future__ import annotations

import logging
import sys

from torch import nn

from fabric_hsdp.logs import info_on_rank_zero

_logger = logging.getLogger(__name__)


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
