"""Context parallelism for litgpt's ``GPT``: its attention over the gathered keys and values, RoPE at global positions.

litgpt has no attention registry and its forward takes no position ids (``input_pos`` turns on the KV cache), so
the rank's positions come from its place in the context group: the sequence cut by :func:`.sequence.shard_sequence`,
the rank holding :func:`.sequence.token_index`'s tokens. A packed sequence is read as litgpt's own forward reads it,
which has no document mask and numbers the tokens ``0 .. T - 1``: its documents attend across their borders and
RoPE does not restart (the position ids ``shard_sequence`` returns are not used). Two changes, both undone by nothing
a checkpoint sees:

- each attention's class becomes a subclass whose ``scaled_dot_product_attention`` gathers the keys and values over
  the context group and attends chunk by chunk (:func:`.attention.causal_attention`), with litgpt's own scale;
- a forward pre-hook on the ``GPT`` puts the RoPE rows of the rank's positions in ``cos``/``sin`` for the forward
  (``GPT.forward`` reads ``cos[:T]``), and a forward hook puts the whole tables back, also when the forward raises.

Refused: the KV cache (``input_pos``), attention logit
softcapping (litgpt's eager attention; no SDPA kernel takes it), sliding windows (litgpt builds a ``T x T`` mask of
the local tokens), and attention classes other than ``CausalSelfAttention`` (``MultiheadLatentAttention``).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fabric_hsdp.context_parallel.attention import causal_attention, gather_keys_values
from fabric_hsdp.context_parallel.sequence import token_index


def is_litgpt_model(module: nn.Module) -> bool:
    litgpt_model = sys.modules.get("litgpt.model")  # no import: a litgpt model means litgpt is imported already
    return litgpt_model is not None and isinstance(module, litgpt_model.GPT)


def apply_to_litgpt(module: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Split litgpt's ``GPT`` ``module``'s sequences over the context group ``group``; return its attentions' names.

    Raises:
        ValueError: The config uses attention logit softcapping or sliding windows, or an attention is not a
            ``CausalSelfAttention``.
    """
    from litgpt.model import CausalSelfAttention

    size = dist.get_world_size(group)
    config = module.config
    unsupported = {
        "attention_logit_softcapping": config.attention_logit_softcapping,
        "sliding_window_size": config.sliding_window_size,
    }
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(
                f"HybridFSDPStrategy(context_parallel_size={size}) does not split litgpt's attention with"
                f" {name}={value} (config {config.name!r}): use context_parallel_size=1, or a transformers model."
            )
    attentions = [(f"transformer.h.{index}.attn", block.attn) for index, block in enumerate(module.transformer.h)]
    for name, attention in attentions:
        if not isinstance(attention, CausalSelfAttention):
            raise ValueError(
                f"HybridFSDPStrategy(context_parallel_size={size}) splits litgpt's CausalSelfAttention only;"
                f" '{name}' is a {type(attention).__name__}: use context_parallel_size=1."
            )
        attention.context_group = group
        attention.__class__ = context_parallel_class(type(attention))
    rope = _RopeAtRankPositions(dist.get_rank(group), size)
    module.register_forward_pre_hook(rope.before, with_kwargs=True)
    module.register_forward_hook(rope.after, always_call=True)
    return [name for name, _ in attentions]


@functools.cache
def context_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of litgpt's attention class ``cls`` whose ``scaled_dot_product_attention`` attends this rank's
    queries to the whole sequence's keys and values; one class per attention class, as ``fully_shard`` makes its own.
    """

    def scaled_dot_product_attention(
        self: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # mask: None without the KV cache and sliding windows, both refused; the causal mask is the global one here
        group: dist.ProcessGroup = self.context_group
        # litgpt repeats each query group's keys and values per query head before this call: gather each group's once
        per_group = k.shape[1] // self.config.n_query_groups
        keys, values, key_index = gather_keys_values(k[:, ::per_group], v[:, ::per_group], group)
        scale = self.mscale**2 / math.sqrt(self.config.attention_scores_scalar or self.config.head_size)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return causal_attention(q, keys, values, key_index, rank, size, scale, 0.0)

    methods = {"scaled_dot_product_attention": scaled_dot_product_attention}
    return type(f"ContextParallel{cls.__name__}", (cls,), methods)


class _RopeAtRankPositions:
    """``GPT.forward`` applies RoPE with ``cos[:T]``/``sin[:T]``, positions ``0 .. T - 1`` of its ``T`` local tokens;
    for the forward the tables hold the rows of this rank's positions in the whole sequence instead."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if (args[1:2] or [kwargs.get("input_pos")])[0] is not None:
            raise ValueError(
                f"Under context_parallel_size={self.size} litgpt's GPT trains without its KV cache: call"
                " `model(input_ids)` with the ids from `strategy.shard_sequence`, without input_pos."
            )
        tokens = (args[0] if args else kwargs["idx"]).shape[1]
        if tokens * self.size > module.max_seq_length:
            raise ValueError(
                f"Under context_parallel_size={self.size} a rank's {tokens} tokens are part of a sequence of"
                f" {tokens * self.size}, longer than the model's max_seq_length ({module.max_seq_length})."
            )
        self.tables = (module.cos, module.sin)
        positions = token_index(tokens, self.rank, self.size, module.cos.device)
        module.cos, module.sin = module.cos[positions], module.sin[positions]

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.tables is not None:
            module.cos, module.sin = self.tables
            self.tables = None
