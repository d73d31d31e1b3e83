"""How the package's errors end a user's script: one line for the job, not a traceback per rank.

A wrong argument or a damaged checkpoint fails every rank alike (the package agrees failures across ranks: the others
raise ``PeerRankError`` naming the rank that failed), so N ranks printed N tracebacks of 45 frames and the reason was
lost among them. :func:`install` (the strategy calls it when it is created, and again once the process group exists,
above torch's own hook, which prefixes each line with ``[rankN]:``) makes an uncaught error *of the package* print::

    fabric-hsdp: error: <message> (set FABRIC_HSDP_DEBUG=1 for the traceback)

once, on global rank 0; the other ranks exit with the same status (1) quietly, once rank 0 has said it (they wait for
its word in the process group's store: a launcher such as torchrun ends every rank when the first one exits, which
could be before rank 0 printed). A rank whose error rank 0 does not report within ``REPORT_WAIT`` seconds (it failed
alone) prints its own line, naming its rank. Under torchrun (and ``fabric run``) every rank also writes its line to
torchrun's error file, so torchrun's summary on every node names the root cause instead of a link to torch's docs.

The package's errors are :class:`~fabric_hsdp.errors.FabricHSDPError` and the types it raises for a user's mistake
(``ValueError``, ``TypeError``, ``OSError``, ``ImportError``) when raised by its own code (the traceback ends in
``fabric_hsdp/``). Anything else (the script's own errors, torch's, a bug of the package such as an
``AttributeError``) keeps its normal traceback on every rank, and so does every error with ``FABRIC_HSDP_DEBUG=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

from fabric_hsdp.errors import FabricHSDPError
from fabric_hsdp.logs import global_rank

DEBUG_VARIABLE = "FABRIC_HSDP_DEBUG"
REPORT_WAIT = 10.0  # seconds a rank waits for rank 0 to report the error before it reports its own
_REPORTED, _HEARD = "fabric_hsdp/failures/reported", "fabric_hsdp/failures/heard"
_USER_MISTAKES = (ValueError, TypeError, OSError, ImportError)
_PACKAGE_DIRECTORY = Path(__file__).resolve().parents[1]  # fabric_hsdp/


def is_package_error(error: BaseException) -> bool:
    """Whether ``error`` is one the package raised for a reason a user can act on (see the module docstring)."""
    if isinstance(error, FabricHSDPError):
        return True
    if not isinstance(error, _USER_MISTAKES) or error.__traceback__ is None:
        return False
    innermost = error.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    return _PACKAGE_DIRECTORY in Path(innermost.tb_frame.f_code.co_filename).resolve().parents


def error_line(error: BaseException) -> str:
    """The one line that reports ``error``: its message on one line, and how to see the traceback."""
    message = " ".join(str(error).split()) or type(error).__name__
    return f"fabric-hsdp: error: {message} (set {DEBUG_VARIABLE}=1 for the traceback)"


def debugging() -> bool:
    """``FABRIC_HSDP_DEBUG`` is set (to anything but ``0``): every error keeps its traceback."""
    return os.environ.get(DEBUG_VARIABLE, "0") not in ("", "0")


class PackageErrorHook:
    """``sys.excepthook``: the package's errors in one line on rank 0, the rest left to ``previous``."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        if debugging() or not is_package_error(error):
            self.previous(kind, error, traceback)
            return
        rank = global_rank()
        if rank != 0 and _rank_zero_reported():
            _tell_torchrun(error_line(error))  # the other nodes' torchrun summaries name the reason
            return
        line = error_line(error) if rank == 0 else error_line(error).replace(": error:", f": error on rank {rank}:", 1)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        if rank == 0:
            _tell_torchrun(line)
            _tell_the_other_ranks()


def install() -> None:
    """Make the package's uncaught errors end the script with one line on rank 0 (idempotent: one hook on top)."""
    if not isinstance(sys.excepthook, PackageErrorHook):
        sys.excepthook = PackageErrorHook(sys.excepthook)


def _tell_torchrun(line: str) -> None:
    """Write ``line`` where torchrun reads a failed rank's reason (its summary shows it as the root cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # torchrun's own @record may have written it: keep that
        return
    message = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
    try:  # torch's own format (``ErrorHandler.record_exception``)
        with open(path, "w") as file:
            json.dump({"message": message}, file)
    except OSError:
        pass  # the line is on stderr already


def _store() -> Any:
    import torch.distributed as dist

    from fabric_hsdp import versions

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return versions.default_process_group_store()


def _tell_the_other_ranks() -> None:
    """Give rank 0's word; keep this process (it may host the store) until all heard it, ``REPORT_WAIT`` at most."""
    store = _store()
    if store is None:
        return
    import torch.distributed as dist

    others, deadline = dist.get_world_size() - 1, time.monotonic() + REPORT_WAIT
    with contextlib.suppress(Exception):  # the store may be gone: the others then report their own lines
        store.set(_REPORTED, "1")
        while store.add(_HEARD, 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)


def _rank_zero_reported() -> bool:
    """Wait up to ``REPORT_WAIT`` s for rank 0's word; ``False`` if none came: this rank reports its own error."""
    store = _store()
    if store is None:
        return True  # before the process group: every rank fails the same launch checks, rank 0 says it
    try:
        store.wait([_REPORTED], timedelta(seconds=REPORT_WAIT))
        store.add(_HEARD, 1)
    except Exception:  # noqa: BLE001 - no word in time, or rank 0 (the store's host) ended without one
        return False
    return True
