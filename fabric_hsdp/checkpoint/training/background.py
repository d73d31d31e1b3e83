"""Sharded saves that write in the background (``async_save=True``), committed exactly like blocking ones.

Each rank first copies its shards into CPU memory (so training may change the parameters right away); then
``dcp.async_save`` writes that copy from a thread whose collectives run on a process group of their own (gloo, so
they never interleave with training's). The copy is made here, once per tensor: DCP's default staging copies a CPU
DTensor twice (``deepcopy``, then into a fresh buffer) and moves a CUDA one to CPU before copying it again.

DCP's coordinator writes ``.metadata`` only after every rank has written and synced its files; when that has
happened, rank 0 commits the pending directory from the writing thread with the same atomic swap as a blocking save
(:func:`fabric_hsdp.checkpoint.core.commit.commit`). A failure is raised on every rank at the next point where all ranks
meet: the next save or load, ``strategy.wait_for_checkpoint()`` or ``teardown()``. A script that just ends lets the
write finish (Python joins DCP's writing thread before running ``atexit`` handlers); the strategy's exit handler then
reports a failure and sets the exit status.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core.commit import PendingSave
from fabric_hsdp.checkpoint.core.dcp_errors import save_error
from fabric_hsdp.checkpoint.core.dcp_planners import SavePlanner
from fabric_hsdp.checkpoint.core.watchdog import IOWatchdog
from fabric_hsdp.checkpoint.training.staging import Staged, Stager
from fabric_hsdp.checkpoint.writers.direct_writer import DirectWriter
from fabric_hsdp.errors import SaveError

_logger = logging.getLogger(__name__)


class BackgroundSaves:
    """A strategy's background saves: their gloo group, the one save in flight, and waiting for it.

    Call :meth:`set_up` once the default process group exists; with ``enabled=False`` every method is a no-op and
    ``group`` is ``None`` (saves block).
    """

    def __init__(self, enabled: bool, watchdog: IOWatchdog | None = None) -> None:
        self.enabled = enabled
        self.group: Any = None  # gloo group for DCP's collectives while saving in the background
        self.stager = Stager()  # the staging buffers, kept from one save to the next
        self._watchdog = watchdog
        self._pending: BackgroundSave | None = None

    def set_up(self, timeout: Any) -> None:
        if self.enabled:
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its failure on every rank (a collective)."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.wait()
        except Exception:
            self._pending = None  # its failure is reported; an interrupt keeps it for the end of the process
            raise
        self._pending = None

    def finish_at_exit(self) -> bool:
        """At interpreter exit: let the save in flight finish, without collectives; ``True`` if it failed."""
        pending, self._pending = self._pending, None
        self.group = None
        if pending is None:
            return False
        try:
            pending.wait(together=False)  # the other ranks may be gone: no collective here
        except SaveError as error:
            _logger.error("%s", error)
            return True
        return False

    def start(self, tensors: dict[str, Any], save: PendingSave) -> None:
        """Copy the chunks of ``tensors`` this rank writes into :attr:`stager`'s buffers, then write them into
        ``save``'s pending directory in a thread and commit it after; it is the save in flight until :meth:`wait`.
        A collective (the staging plan, then the copy's agreement): call it on every rank, after :meth:`wait`."""
        path = save.path
        written = self.stager.plan(tensors, self.group)
        with fail_together(f"copying the shards of checkpoint '{path}' to CPU memory"):
            copies: Staged = self.stager.copy(tensors, written)
        watch = self._watchdog.start(f"saving checkpoint '{path}' in the background") if self._watchdog else None
        self._pending = start_save(copies.state, save, self.group, ready=copies.ready, watch=watch)

    def close(self) -> None:
        self.group = None
        self.stager.close()


class BackgroundSave:
    """One save in flight: DCP's upload future, and the commit rank 0 runs when it has finished on every rank."""

    def __init__(self, future: Future, save: PendingSave, watch: Any = None) -> None:
        self.path = save.path
        self._watch = watch  # the I/O watchdog's watch over this save's writes, stopped when it ends
        self._save = save
        self._done = threading.Event()
        self._error: BaseException | None = None
        future.add_done_callback(self._finish)  # runs in DCP's writing thread (or here, if already done)

    def _finish(self, future: Future) -> None:
        try:
            future.result()
            self._save.commit("saved in the background")
        except BaseException as error:  # noqa: BLE001 - kept and raised on the main thread by wait()
            self._error = error
            self._save.discard()  # the previous checkpoint is untouched
        finally:
            if self._watch is not None:
                self._watch.stop()
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


def start_save(
    copies: dict[str, Any], save: PendingSave, group: Any, ready: Any = None, watch: Any = None
) -> BackgroundSave:
    """Start writing ``copies`` (staged CPU copies) into ``save``'s pending directory in a thread; commit it after.

    ``ready``: called in the writing thread before the copies are read (the staging's CUDA event).
    """
    import torch.distributed.checkpoint as dcp

    writer = _StagedWriter(save.directory, before_write=ready)
    future = dcp.async_save(copies, storage_writer=writer, planner=SavePlanner(), process_group=group)
    return BackgroundSave(future, save, watch)


class _StagedWriter(DirectWriter):
    """The writer of a state dict :class:`~fabric_hsdp.checkpoint.training.staging.Stager` already copied.

    ``async_save`` stages through its writer when that is an ``AsyncStager`` (torch's ``FileSystemWriter`` is one)
    and no ``async_stager=`` is given, which torch < 2.11 cannot take: this writer hands the copies on as they are.
    """

    _synchronize_after_execute = False

    def __init__(self, path: Any, *, before_write: Any = None) -> None:
        super().__init__(path, before_write=before_write)
        # the copies are on the host already: DCP's serial loader, not the overlapping one that syncs CUDA streams
        # on the writing thread's device (GPU 0 for every rank)
        self.per_thread_copy_ahead = 0

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
