"""DCP's errors unpacked: it wraps any failure, ``KeyboardInterrupt`` and ``OSError`` included, in a
``CheckpointException`` (a ``BaseException``) holding each rank's exception; these functions unpack them for messages.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from fabric_hsdp.errors import SaveError, write_error


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """Run a single-process DCP call: silence its no-process-group warning, re-raise the error it wrapped.

    DCP wraps any failure, ``KeyboardInterrupt`` and ``OSError`` included, in a ``CheckpointException`` (a
    ``BaseException``); callers need the original to report it. An interrupt that landed inside torch's zip writer
    surfaces as the writer's clean-up error (``enforce fail ... unexpected pos``) with the ``KeyboardInterrupt`` as its
    context: it is re-raised as the interrupt it was.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            yield
        except CheckpointException as error:
            failure = first_failure(error)
            if interrupted(failure):
                raise KeyboardInterrupt from None
            raise failure from None


def interrupted(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised while handling, a ``KeyboardInterrupt``."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def rank_failures(error: BaseException) -> dict[int, BaseException]:
    """The exceptions DCP wrapped in ``error``, by rank (it records each as ``(exception, traceback)``)."""
    failures = getattr(error, "failures", None) or {}
    return {rank: failure[0] if isinstance(failure, tuple) else failure for rank, failure in failures.items()}


def first_failure(error: CheckpointException) -> BaseException:
    """The first exception DCP wrapped in ``error``; ``error`` itself if it wrapped none."""
    return next(iter(rank_failures(error).values()), error)


def save_error(error: BaseException, path: Path) -> SaveError:
    """The error for a failed DCP save, naming each failed rank and its exception (DCP wraps them per rank)."""
    if isinstance(error, SaveError):  # already says what failed (rank 0's commit of a background save)
        return error
    if isinstance(error, OSError):  # not DCP's: rank 0 committing a background save
        return write_error(path, error)
    causes = rank_failures(error)
    details = "; ".join(f"rank {rank}: {_describe(e)}" for rank, e in sorted(causes.items()))
    if not details:
        details = _describe(error)
    return SaveError(
        f"saving checkpoint '{path}' failed ({details}). Nothing was written at '{path}'; the previous checkpoint"
        " there, if any, is intact."
    )


def _describe(error: BaseException) -> str:
    """``Type: message``; an ``OSError`` without its file name, which is inside the hidden pending directory."""
    if isinstance(error, OSError) and error.strerror:
        return f"{type(error).__name__}: {error.strerror}"
    return f"{type(error).__name__}: {error}"
