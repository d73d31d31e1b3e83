"""Attention over a sequence split among the context group: queries local, keys and values all-gathered.

Each rank holds the queries, keys and values of its head-tail chunks (:mod:`.sequence`). The keys and values of the
whole sequence are all-gathered over the context group (backward reduce-scatters their gradients) and every query
attends to them under a mask built from global token indices: causal, within its document (packed sequences: the
position ids restart at each document, read as transformers reads them), and within the layer's sliding window if it
has one. The attention itself
is transformers' own SDPA function with that mask. torchtitan's current CP does the same (its ring attention is gone);
torch's ring CP runs only CUDA kernels and takes no explicit mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fabric_hsdp.context_parallel.sequence import token_index
from fabric_hsdp.versions import all_gather_tensor, all_gather_tensor_autograd

NAME = "fabric_hsdp_context_parallel"


def context_parallel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: ``query``/``key``/``value`` ``[batch, heads, tokens, head_dim]``
    of this rank's tokens; ``position_ids`` ``[batch, tokens]`` theirs in the whole sequence."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    group: dist.ProcessGroup = module.context_group
    keys = all_gather_tensor_autograd(key.contiguous(), 2, group)
    values = all_gather_tensor_autograd(value.contiguous(), 2, group)
    mask = allowed_keys(position_ids, query.shape[2], group, getattr(module, "sliding_window", None))
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, keys, values, mask, is_causal=False, **kwargs)


def allowed_keys(
    position_ids: torch.Tensor, tokens: int, group: dist.ProcessGroup, sliding_window: int | None
) -> torch.Tensor:
    """``[batch, 1, tokens, size * tokens]``: which of the gathered keys (in rank order) each local query sees."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = position_ids.device
    queries = token_index(tokens, rank, size, device)
    keys = torch.cat([token_index(tokens, other, size, device) for other in range(size)])
    documents = _documents(all_gather_tensor(position_ids.contiguous(), 1, group), keys)
    mask = keys[None, :] <= queries[:, None]
    if sliding_window:
        mask &= queries[:, None] - keys[None, :] < sliding_window
    same_document = documents[:, queries, None] == documents[:, None, keys]
    return (mask[None] & same_document).unsqueeze(1)


def _documents(gathered_positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[batch, T]``: the document of each token of the whole sequence, by its index: transformers' own reading of
    packed position ids (``find_packed_sequence_indices``: a new document where a position is not the previous
    one's + 1), all in one document when nothing is packed."""
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.empty_like(gathered_positions)
    positions[:, keys] = gathered_positions
    documents = find_packed_sequence_indices(positions)
    return torch.zeros_like(positions) if documents is None else documents
