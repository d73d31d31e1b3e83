"""Activation checkpointing, a step of the setup pipeline: recompute the selected modules' activations in backward,
whole (``"full"``), by op (``"selective"``: torchtitan's policy) or every ``k``-th module."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Literal

from torch import nn
from torch.utils.checkpoint import checkpoint

from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.models.transformers import disable_kv_cache
from fabric_hsdp.versions import c10d_functional_ops

_logger = logging.getLogger(__name__)
ActivationCheckpointingMode = Literal["full", "selective"] | int


def apply_activation_checkpointing(
    module: nn.Module, selected: Callable[[str, nn.Module], bool], mode: ActivationCheckpointingMode
) -> list[str]:
    """Recompute the activations of the modules ``selected`` picks in backward; return their names.

    ``"full"``: each selected module keeps only its input and recomputes its forward in backward. ``"selective"``:
    torchtitan's op-level policy -- the outputs of matmuls, attention and collectives are saved, everything else
    (norms, activation functions, elementwise ops, RoPE) is recomputed. An int ``k``: full recompute of every
    ``k``-th selected module (the ``k``-th, ``2k``-th, ...), the others keep their activations.

    The checkpoint runs inside each module's forward (:func:`checkpointed_class`), as torchtitan's
    ``checkpoint_wrapper`` does but without a wrapper module, so parameter names (and checkpoints) are unchanged.
    """
    checkpointed = [(name, child) for name, child in module.named_modules() if name and selected(name, child)]
    if isinstance(mode, int):
        checkpointed = [pair for index, pair in enumerate(checkpointed, start=1) if index % mode == 0]
    for _, child in checkpointed:
        child.__class__ = checkpointed_class(type(child), selective=mode == "selective")
    if checkpointed:
        disable_kv_cache(module, "activation checkpointing")
        info_on_rank_zero(_logger, "activation checkpointing (%s): %d modules", mode, len(checkpointed))
    return [name for name, _ in checkpointed]


@functools.cache
def checkpointed_class(cls: type[nn.Module], *, selective: bool) -> type[nn.Module]:
    """A subclass of ``cls`` whose forward runs ``cls.forward`` under ``torch.utils.checkpoint`` (selective: with
    :func:`selective_checkpoint_contexts`); one class per block class and mode, as ``fully_shard`` makes its own.

    Inside the forward, not hooks around it: ``torch.compile`` of the block then traces the checkpoint and applies
    the policy in its graph. With hooks around a compiled block (the composable ``checkpoint``), backward reran the
    whole compiled forward whatever the mode: 4 compiled MLP blocks ran 32 matmuls in backward under ``selective``
    (16 without activation checkpointing; 16 now).
    """

    # the context function named directly, not through a closure: dynamo refuses a context_fn it cannot see
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

    def selective_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            cls.forward, self, *args, use_reentrant=False, context_fn=selective_checkpoint_contexts, **kwargs
        )

    mode = "Selective" if selective else ""
    return type(f"{mode}Checkpointed{cls.__name__}", (cls,), {"forward": selective_forward if selective else forward})


def saved_ops() -> list[Any]:
    """The ops whose outputs selective activation checkpointing keeps (torchtitan's list, plus the CPU kernels and
    expert parallelism's token exchange)."""
    import torch

    aten, names = torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "max")
    # _scaled_mm: float8's matmuls; max: float8's amax (its scales), else every float8 matmul is recomputed
    ops = [getattr(aten, name).default for name in names]
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            ops.append(getattr(aten, name).default)
    functional = c10d_functional_ops()
    for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor", "all_to_all_single"):
        if hasattr(functional, name):
            ops.append(getattr(functional, name).default)
    return ops


def selective_checkpoint_contexts() -> tuple[Any, Any]:
    """A fresh pair of selective-checkpoint contexts (one per forward): save :func:`saved_ops`, recompute the rest."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(saved_ops())
