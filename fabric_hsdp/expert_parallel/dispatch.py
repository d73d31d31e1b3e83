"""Tokens to the rank holding their expert and back: the two all-to-alls of one mixture-of-experts layer.

Each rank routes its own tokens. :func:`dispatch` sorts the (token, choice) pairs by expert, tells every rank of the
expert-parallel group how many rows it will receive for each of its experts (one all-to-all of ``E`` counts), and
sends the rows (one all-to-all with uneven splits). The receiving rank computes its experts on what it got, rank by
rank; :func:`combine` sends the results back the same way and adds them to their tokens, weighted by the router in
fp32. Both all-to-alls are differentiable (torch's functional collectives): backward sends the gradients the
opposite way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fabric_hsdp.versions import all_to_all_single, all_to_all_single_autograd


@dataclass
class Route:
    """Where one layer's rows went, to bring them back (:func:`combine`).

    Attributes:
        order: The (token, choice) pairs sorted by expert, as indices into ``top_k_index.flatten()``.
        sent: Rows sent to each rank of the group (in rank order).
        received: Rows received from each rank of the group.
    """

    order: torch.Tensor
    sent: list[int]
    received: list[int]


def dispatch(
    hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Send each (token, choice) row of ``hidden`` (``[tokens, hidden]``) to the rank holding its expert.

    Expert ``e`` lives on rank ``e // (num_experts / group size)`` of ``group``. Returns the rows this rank received
    (from rank 0's first, each rank's sorted by expert), the local index of the expert each is for, and the route.
    """
    ranks = dist.get_world_size(group)
    local_experts = num_experts // ranks
    choices = top_k_index.reshape(-1)
    order = torch.argsort(choices, stable=True)
    rows = hidden[order // top_k_index.shape[-1]]
    counts = torch.bincount(choices, minlength=num_experts)  # rows for each expert of the group, in expert order
    counts_in = all_to_all_single(counts, None, None, group)  # rows for each local expert, from each rank
    sent = counts.view(ranks, local_experts).sum(1).tolist()
    received_counts = counts_in.view(ranks, local_experts)
    received = received_counts.sum(1).tolist()
    received_rows = all_to_all_single_autograd(rows, received, sent, group)
    local_ids = torch.arange(local_experts, device=hidden.device).repeat(ranks)
    expert_of_row = torch.repeat_interleave(local_ids, received_counts.reshape(-1))
    return received_rows, expert_of_row, Route(order, sent, received)


def combine(
    expert_rows: torch.Tensor, route: Route, top_k_weights: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Send the experts' outputs back and sum each token's rows weighted by its routing weights (in fp32);
    ``[tokens, hidden]`` in ``expert_rows``' dtype."""
    rows = all_to_all_single_autograd(expert_rows, route.sent, route.received, group)
    top_k = top_k_weights.shape[-1]
    weights = top_k_weights.reshape(-1)[route.order].float().unsqueeze(-1)
    tokens = top_k_weights.shape[0]
    summed = torch.zeros(tokens, rows.shape[-1], dtype=torch.float32, device=rows.device)
    summed.index_add_(0, route.order // top_k, rows.float() * weights)
    return summed.to(expert_rows.dtype)
