"""The package's exceptions: one base class to catch, and the kinds of failure a user may want to tell apart.

Wrong arguments (a ``shard_size`` that does not divide the world, an unknown ``load_mode``) raise the built-in
``ValueError``/``TypeError`` like any Python API. Messages start with what they are about, say what was wrong and
how to fix it, e.g. ``checkpoint 'lit-llama.pth' has no tensor for 'layers.3.mlp.w1.weight' ...``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any


class FabricHSDPError(Exception):
    """Base class of the errors this package raises for its own reasons (not for wrong arguments)."""


class CheckpointError(FabricHSDPError, ValueError):
    """A checkpoint cannot be read (unknown format, damaged, incomplete) or does not fit what it is loaded into."""


class PeerRankError(FabricHSDPError, RuntimeError):
    """Raised on the ranks that succeeded when another rank failed the same step."""


class SaveError(FabricHSDPError, RuntimeError):
    """Writing a checkpoint failed on some rank; nothing was written at its path."""


class NoLayoutFitsError(FabricHSDPError, ValueError):
    """No layout fits the device memory; the message gives the smallest total and the changes that would fit.

    Attributes:
        plan: the :class:`~fabric_hsdp.planning.plan.Plan` of every layout tried.
        options: the changes that would fit, one sentence each.
    """

    def __init__(self, message: str, plan: Any, options: list[str]) -> None:
        super().__init__(message)
        self.plan = plan
        self.options = options


def unsafe_pickle_error(what: str, reason: str) -> CheckpointError:
    """The error for pickled content that ``torch.load(weights_only=True)`` refuses; ``what`` names where it is."""
    return CheckpointError(
        f"{what} holds Python objects that safe loading (weights_only=True) refuses ({reason}). If you trust this"
        " checkpoint, pass weights_only=False (CLI: --unsafe_pickle)."
    )


def refused_pickle(file_name: str | os.PathLike, error: BaseException) -> CheckpointError:
    """The error for a file whose pickle ``torch.load(weights_only=True)`` refused; names what it refused."""
    reason = next((line.strip() for line in str(error).splitlines() if "WeightsUnpickler error" in line), None)
    return unsafe_pickle_error(f"'{file_name}'", reason or first_line(error))


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name if it has none), for one-line error messages."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_error(path: str | os.PathLike, error: OSError, *, creating: bool = False) -> SaveError:
    """The error for an ``OSError`` met writing the checkpoint or output ``path`` through its hidden pending sibling.

    It names ``path`` and its directory, never the pending path the ``OSError`` names. ``creating``: the error came
    from creating the pending sibling, so the directory refused a new entry whatever the errno (``/proc`` says
    ``ENOENT``).
    """
    path = Path(path)
    reason = error.strerror or type(error).__name__
    if error.errno == errno.ENOTDIR:
        blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), path.parent)
        problem = f"'{blocking}' is a file, not a directory ({reason}); choose a directory for the checkpoint"
    elif creating or error.errno in _UNWRITABLE:
        problem = f"directory '{path.parent}' is not writable ({reason}); choose a writable directory"
    else:
        problem = f"{reason} (writing in directory '{path.parent}')"
    return SaveError(
        f"cannot write '{path}': {problem}. Nothing was written at '{path}'; what was there before, if anything,"
        " is intact."
    )
