"""Sharded saves that write in the background (``async_save=True``), committed exactly like blocking ones.

Each rank first copies its shards into CPU memory (so training may change the parameters right away); then
``dcp.async_save`` writes that copy from a thread whose collectives run on a process group of their own (gloo, so
they never interleave with training's). The copy is made here, once per tensor: DCP's default staging copies a CPU
DTensor twice (``deepcopy``, then into a fresh buffer) and moves a CUDA one to CPU before copying it again.

DCP's coordinator writes ``.metadata`` only after every rank has written and synced its files; when that has
happened, rank 0 commits the staging directory from the writing thread with the same atomic swap as a blocking save
(:func:`fabric_hsdp.checkpoint.commit.commit`). A failure is raised on every rank at the next point where all ranks
meet: the next save or load, ``strategy.wait_for_checkpoint()`` or ``teardown()``. A script that just ends lets the
write finish (Python joins DCP's writing thread before running ``atexit`` handlers); the strategy's exit handler then
reports a failure and sets the exit status.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint import commit

_logger = logging.getLogger("fabric_hsdp")


def save_error(error: BaseException, path: Path) -> RuntimeError:
    """The error for a failed DCP save, naming each failed rank and its exception (DCP wraps them per rank)."""
    from fabric_hsdp.checkpoint._dcp import rank_failures

    causes = rank_failures(error)
    details = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(causes.items()))
    if not details:
        details = f"{type(error).__name__}: {error}"
    return RuntimeError(
        f"saving checkpoint '{path}' failed ({details}). Nothing was written at '{path}'; the previous checkpoint"
        " there, if any, is intact."
    )


class BackgroundSave:
    """One save in flight: DCP's upload future, and the commit rank 0 runs when it has finished on every rank."""

    def __init__(self, future: Future, staged: Path, path: Path, started: float) -> None:
        self.path = path
        self._staged = staged
        self._started = started
        self._rank = dist.get_rank()
        self._done = threading.Event()
        self._error: BaseException | None = None
        future.add_done_callback(self._finish)  # runs in DCP's writing thread (or here, if already done)

    def _finish(self, future: Future) -> None:
        try:
            future.result()
            if self._rank == 0:
                commit.commit(self._staged, self.path)
                log_throughput("saved in the background", self.path, time.monotonic() - self._started)
        except BaseException as error:  # noqa: BLE001 - kept and raised on the main thread by wait()
            self._error = error
            if self._rank == 0:
                commit.discard(self._staged)  # the previous checkpoint is untouched
        finally:
            self._done.set()

    def wait(self, *, together: bool = True) -> None:
        """Block until this save is committed (or failed); raise its failure, on every rank when ``together``.

        ``together=False`` waits for this rank's part only, with no collective: for the end of the process, when
        the other ranks may no longer take part in one.
        """
        if not together:
            self._done.wait()
            if self._error is not None:
                raise save_error(self._error, self.path)
            return
        with fail_together(f"saving checkpoint '{self.path}' in the background"):
            self.wait(together=False)


def log_throughput(verb: str, path: Path, seconds: float) -> None:
    """Rank 0's line for a finished save or load: size on disk, seconds, MB/s."""
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    _logger.info(
        "fabric_hsdp: %s '%s': %.1f MB in %.2f s (%.0f MB/s)", verb, path, size / 1e6, seconds, size / 1e6 / seconds
    )


def start(copies: dict[str, Any], staged: Path, path: Path, group: Any, started: float) -> BackgroundSave:
    """Start writing ``copies`` (from :func:`copy_to_cpu`) to ``staged`` in a thread; commit it to ``path`` after."""
    import torch.distributed.checkpoint as dcp

    future = dcp.async_save(
        copies,
        storage_writer=dcp.FileSystemWriter(str(staged)),
        process_group=group,
        async_stager=_AlreadyStaged(),
    )
    return BackgroundSave(future, staged, path, started)


def copy_to_cpu(value: Any) -> Any:
    """A copy of a nested state dict with every tensor (a DTensor's local shard) copied to CPU memory, once.

    A DTensor stays a DTensor of the same mesh and placements with a CPU local shard (``DTensor.from_local`` would
    move that shard back to the mesh's device).
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: copy_to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_to_cpu(item) for item in value)
    return value


class _AlreadyStaged(AsyncStager):
    """DCP's staging step for a state dict :func:`copy_to_cpu` already copied: hand it on as it is."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
