"""One rank fails, all ranks fail: agree on success after a step that could fail on some ranks only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from fabric_hsdp.errors import PeerRankError


@contextmanager
def fail_together(what: str) -> Iterator[None]:
    """Run the body on every rank, then exchange outcomes so a failure anywhere ends every rank at once.

    The body must not run collectives itself: a rank that fails early would meet its peers' collective with this
    exchange and all would hang.

    The rank that failed re-raises its own exception; the others raise ``PeerRankError`` naming the failed ranks and
    their messages, instead of blocking in the next collective until its timeout.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as exception:  # noqa: BLE001 - re-raised below after the exchange
        error = exception
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    outcome = None if error is None else f"{type(error).__name__}: {error}"
    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
    if failed:
        first_rank, first_message = failed[0]
        others = f" (and {len(failed) - 1} more rank(s): {[rank for rank, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise PeerRankError(f"{what} failed on rank {first_rank}{others}: {first_message}")
