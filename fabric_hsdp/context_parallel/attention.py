"""Attention over a sequence split among the context group: queries local, keys and values all-gathered.

Each rank holds the queries, keys and values of its head-tail chunks (:mod:`.sequence`). The keys and values of the
whole sequence are all-gathered over the context group (backward reduce-scatters their gradients) and every query
attends to them under a mask built from global token indices: causal, within its document (packed sequences: the
position ids restart at each document, read as transformers reads them), and within the layer's sliding window if it
has one, through transformers' own SDPA function. Without documents or a window each of the rank's two chunks
attends to the keys before its end with torch's bottom-right causal bias, which makes no ``queries x keys`` mask where
the kernel knows the pattern (a 128k sequence over 4 ranks would need 32k x 128k per layer). torchtitan's current CP
gathers keys and values the same way (its ring attention is gone); torch's ring CP runs only CUDA kernels and takes
no explicit mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fabric_hsdp.context_parallel.sequence import token_index
from fabric_hsdp.versions import all_gather_tensor, all_gather_tensor_autograd, causal_lower_right

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

    group: dist.ProcessGroup | None = getattr(module, "context_group", None)
    if group is None:
        raise ValueError(
            f"{type(module).__name__} calls the context-parallel attention but was not recognised as an attention"
            " module at setup_module (it lacks transformers' `scaling`, `layer_idx` or `config`): its keys would not"
            " be gathered. Use context_parallel_size=1 for this model."
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    keys, values, key_index = gather_keys_values(key, value, group)
    tokens, device = query.shape[2], query.device
    documents = _documents(all_gather_tensor(position_ids.contiguous(), 1, group), key_index)
    window = getattr(module, "sliding_window", None)
    kwargs.pop("is_causal", None)
    if documents is None and not window:
        scaling, dropout = kwargs.get("scaling"), kwargs.get("dropout", 0.0)
        return causal_attention(query, keys, values, key_index, rank, size, scaling, dropout), None
    mask = allowed_keys(token_index(tokens, rank, size, device), key_index, documents, window)
    return sdpa_attention_forward(module, query, keys, values, mask, is_causal=False, **kwargs)


def gather_keys_values(
    key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values ``[batch, heads, tokens, head_dim]`` of the whole sequence, all-gathered over the context
    group ``group`` in rank order (backward reduce-scatters their gradients), and each gathered token's index in it."""
    size = dist.get_world_size(group)
    keys = all_gather_tensor_autograd(key.contiguous(), 2, group)
    values = all_gather_tensor_autograd(value.contiguous(), 2, group)
    tokens, device = key.shape[2], key.device
    return keys, values, torch.cat([token_index(tokens, other, size, device) for other in range(size)])


def causal_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_index: torch.Tensor,
    rank: int,
    size: int,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """One document per sequence, no window: each of this rank's two chunks attends to the keys up to its own end,
    causal aligned bottom-right (torch's ``causal_lower_right``: no mask is made where the kernel has the pattern,
    the CUDA memory-efficient one). Output ``[batch, tokens, heads, head_dim]``, as transformers' SDPA and litgpt's
    ``scaled_dot_product_attention`` return it."""
    order = torch.argsort(key_index)  # the gathered keys in sequence order
    keys, values = keys.index_select(2, order), values.index_select(2, order)
    chunk = query.shape[2] // 2
    outputs = []
    for part, start in enumerate((rank * chunk, (2 * size - 1 - rank) * chunk)):
        end = start + chunk
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, part * chunk : (part + 1) * chunk],
                keys[:, :, :end],
                values[:, :, :end],
                attn_mask=causal_lower_right(chunk, end),
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=query.shape[1] != keys.shape[1],
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def allowed_keys(
    query_index: torch.Tensor, key_index: torch.Tensor, documents: torch.Tensor | None, sliding_window: int | None
) -> torch.Tensor:
    """``[batch or 1, 1, queries, keys]``: which of the gathered keys each local query sees, by their indices in the
    whole sequence: earlier or itself, in its document, inside the window."""
    mask = key_index[None, :] <= query_index[:, None]
    if sliding_window:
        mask &= query_index[:, None] - key_index[None, :] < sliding_window
    if documents is None:
        return mask[None, None]
    same_document = documents[:, query_index, None] == documents[:, None, key_index]
    return (mask[None] & same_document).unsqueeze(1)


def _documents(gathered_positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """``[batch, T]``: the document of each token of the whole sequence, by its index: transformers' own reading of
    packed position ids (``find_packed_sequence_indices``: a new document where a position is not the previous
    one's + 1); ``None`` when no sequence of the batch is packed."""
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.empty_like(gathered_positions)
    positions[:, keys] = gathered_positions
    return find_packed_sequence_indices(positions)
