"""Which tokens of a sequence a context-parallel rank holds: head-tail chunks, and the batch cut to them.

With ``C`` ranks a sequence of ``T`` tokens is cut into ``2C`` chunks of ``T / 2C``; rank ``c`` holds chunks ``c``
and ``2C - 1 - c`` (torchtitan's and torch's head-tail load balancing): under a causal mask an early chunk attends to
few keys and a late one to many, so each rank gets one of each and the same work.
"""

from __future__ import annotations

import torch


def token_index(length: int, rank: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions in the whole sequence of the ``length`` tokens rank ``rank`` of ``size`` holds, in its order."""
    chunk = length // 2
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([head, tail])


def shard_sequence(
    tensors: tuple[torch.Tensor, ...], rank: int, size: int, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Each ``[batch, T, ...]`` tensor cut to this rank's head-tail chunks, then the position ids (``0 .. T - 1``
    when not given; a packed sequence's own, restarting at each document) cut the same way.

    Raises:
        ValueError: The tensors' lengths differ, or ``T`` does not divide by ``2 * size``.
    """
    lengths = {tensor.shape[1] for tensor in tensors}
    if len(lengths) != 1:
        raise ValueError(f"shard_sequence takes tensors of one sequence length (dim 1); got lengths {sorted(lengths)}.")
    (length,) = lengths
    if length % (2 * size) != 0:
        raise ValueError(
            f"A sequence of {length} tokens does not split into 2 x context_parallel_size({size}) = {2 * size} equal"
            f" chunks: pad it to a multiple of {2 * size} (labels -100 on the padding)."
        )
    if position_ids is None:
        position_ids = torch.arange(length, device=tensors[0].device).expand(tensors[0].shape[0], length)
    index = token_index(length // size, rank, size, tensors[0].device)
    return tuple(tensor[:, index] for tensor in (*tensors, position_ids))
