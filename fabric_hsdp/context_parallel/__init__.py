"""Context parallelism: each sequence split over the ``context`` dim, keys and values all-gathered in attention.

With ``context_parallel_size=C`` the ``C`` ranks of a context group take the same micro-batch and each computes on
``T / C`` of its tokens (:func:`.sequence.shard_sequence`, head-tail chunks), so each rank's activations are those of
``T / C`` tokens. Everything but attention is per token; attention gathers the whole sequence's keys and values
(:mod:`.attention`). transformers models run it through their own attention registry (``AttentionInterface``): no
model code changes; litgpt's ``GPT`` through its attention classes and RoPE tables (:mod:`.litgpt`, a packed
sequence read as one, as litgpt reads it). The loss of a rank is its tokens' share of the sequence's mean
(:func:`cross_entropy`); FSDP then divides gradients by the data-parallel ranks only
(``setup.pipeline.divide_gradients_by_data_parallel_ranks``), so a run at ``C`` trains as the unsplit run. Parameters
are sharded over ``shard`` as without it: checkpoints are unchanged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fabric_hsdp.context_parallel.attention import NAME, context_parallel_attention
from fabric_hsdp.context_parallel.litgpt import apply_to_litgpt, is_litgpt_model
from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.versions import all_reduce

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_logger = logging.getLogger(__name__)


def apply_context_parallel(module: nn.Module, context_mesh: DeviceMesh) -> list[str]:
    """Route every attention of ``module`` through context-parallel attention over ``context_mesh``; return the
    attention modules' names. A transformers model through its attention registry (packed documents read from the
    position ids, which every forward must pass); litgpt's ``GPT`` through :mod:`.litgpt` (no position ids:
    a packed sequence read as one, as litgpt's own forward reads it).

    Raises:
        ValueError: ``module`` is neither a transformers model nor litgpt's ``GPT``, or a litgpt config this does
            not split (:func:`.litgpt.apply_to_litgpt`).
    """
    size = context_mesh.size()
    if is_litgpt_model(module):
        attentions = apply_to_litgpt(module, context_mesh.get_group())
        info_on_rank_zero(_logger, "context parallelism (%d): %d litgpt attention modules", size, len(attentions))
        return attentions
    if not hasattr(module, "set_attn_implementation"):
        raise ValueError(
            f"HybridFSDPStrategy(context_parallel_size={size}) splits attention through transformers' attention"
            f" registry or litgpt's GPT, and {type(module).__name__} is neither. Use a transformers model"
            " (AutoModelForCausalLM) or litgpt's GPT, or context_parallel_size=1."
        )
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, context_parallel_attention)
    module.set_attn_implementation(NAME)
    group = context_mesh.get_group()
    attentions = [(name, sub) for name, sub in module.named_modules() if _is_attention(sub)]
    for _, attention in attentions:
        attention.context_group = group
    module.register_forward_pre_hook(_require_positions, with_kwargs=True)
    info_on_rank_zero(_logger, "context parallelism (%d): %d attention modules", size, len(attentions))
    return [name for name, _ in attentions]


def _is_attention(module: nn.Module) -> bool:
    # transformers' attention modules: what calls the attention function, with its scaling and its layer's index
    return hasattr(module, "scaling") and hasattr(module, "layer_idx") and hasattr(module, "config")


def _require_positions(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Each rank holds chunks from the middle of the sequence: without the position ids of its tokens the model
    would number them ``0 .. T / C - 1`` (RoPE and the mask both wrong), silently."""
    if kwargs.get("position_ids") is None:
        raise ValueError(
            "Under context_parallel_size > 1 pass the model the position ids of this rank's tokens:"
            " `input_ids, labels, position_ids = strategy.shard_sequence(input_ids, labels)`, then"
            " `model(input_ids, position_ids=position_ids)`."
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(torch.all(mask)):
        raise ValueError(
            "Under context_parallel_size > 1 the attention mask comes from the position ids: pack documents with"
            " position ids restarting at 0 and mark padding with labels -100, instead of attention_mask."
        )


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup | None, ignore_index: int = -100
) -> torch.Tensor:
    """This rank's share of the mean cross-entropy of its context group's sequences: the sum over its tokens divided
    by the labelled tokens of the whole sequences (``group``: the context group; ``None``: this rank alone)."""
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    count = (labels != ignore_index).sum()
    if group is not None:
        count = all_reduce(count, "sum", group)
    return total / count.clamp_min(1)
