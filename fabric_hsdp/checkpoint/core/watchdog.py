"""Checkpoint I/O that stops advancing fails the job with where it stopped, instead of hanging in a collective.

A rank stuck in a read or write (a dead NFS mount, a file lock, a stopped process) leaves every other rank waiting
in DCP's or our own collectives until the process group's timeout (30 minutes by default), with no word on why. While
a save or a load runs, each rank's :class:`IOWatchdog` thread watches:

* this rank: while it is *in I/O* (between :func:`doing_io` entering and leaving: its own reads or writes, not the
  collectives around them), the bytes it has read or written must advance (:func:`advance`, called by
  :mod:`fabric_hsdp.checkpoint.core.fileio` every 64 MiB read and 16 MiB written) at least once per ``timeout``;
* the next rank in a ring (rank ``r`` watches rank ``r + 1``): the same rule on what that rank last posted to the
  job's TCPStore, so a rank whose every thread is stopped (``SIGSTOP``, a frozen node) is caught too.

The side channel is the TCPStore of the default process group: the waiting ranks sit in a collective, so only their
watchdog threads, which poll a store key, can learn of the stall. The first watchdog to see one sets that key to a
message naming the rank, its host, the file and how many bytes it had done; every watchdog that sees the key logs it
and ends its process with exit status 1 (a rank blocked in a collective or in the kernel cannot raise). Each rank
polls one or two keys per interval, so the store's load grows with the number of ranks, not its square.

Full (one-file) saves are watched the same way: rank 0 writes through ``fileio.DirectFileWriter``, which reports
while the others wait in its gathers.

A stop of the process that serves the store (rank 0's, unless torchrun's agent serves it) leaves no key to post or
read: every other watchdog's store call then waits, and the store client's own timeout does not end a read from a
stopped server (measured: a ``check`` with a 2 s timeout still waiting 20 s later, a ``get`` 90 s later). So each
watch also times its own store calls: one that has not returned after ``timeout`` ends the process with a message
naming the store's address and the operation, as a stall does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_logger = logging.getLogger(__name__)
_PREFIX = "fabric_hsdp/io_watchdog"


@dataclass
class _Progress:
    """What this rank's checkpoint I/O is doing, updated by the thread doing it (plain attribute writes)."""

    in_io: int = 0  # nesting depth of doing_io
    what: str = ""  # "reading" / "writing"
    file: str = ""
    done: int = 0  # bytes read or written in this operation
    steps: int = 0  # bumped on every advance and phase change: "has it moved" without comparing floats

    def record(self, rank: int, host: str) -> dict[str, Any]:
        return {
            "rank": rank,
            "host": host,
            "in_io": self.in_io > 0,
            "what": self.what,
            "file": self.file,
            "done": self.done,
            "steps": self.steps,
        }


_progress = _Progress()
_lock = threading.Lock()


def advance(nbytes: int, file: str | None = None) -> None:
    """Note that ``nbytes`` more bytes were read or written (of ``file``, when given). Cheap; safe with no watch."""
    progress = _progress
    progress.done += nbytes
    progress.steps += 1
    if file is not None:
        progress.file = file


@contextmanager
def doing_io(what: str, file: str = "") -> Iterator[None]:
    """This rank's own reads or writes (``what``: ``"reading"``/``"writing"``) run inside; collectives must not."""
    progress = _progress
    with _lock:
        progress.in_io += 1
        progress.what, progress.steps = what, progress.steps + 1
        if file:
            progress.file = file
    try:
        yield
    finally:
        with _lock:
            progress.in_io -= 1
            progress.steps += 1


def _to_seconds(timeout: float | timedelta | None) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds <= 0:
        raise ValueError(f"io_timeout={timeout!r} must be a positive number of seconds (or None to turn it off).")
    return seconds


class IOWatchdog:
    """A strategy's watch over its checkpoint I/O: ``with watchdog.watch("loading checkpoint '...'"):``.

    Args:
        timeout: Seconds (or a ``timedelta``) a rank in I/O may go without advancing; ``None`` turns watching off.
    """

    def __init__(self, timeout: float | timedelta | None) -> None:
        self.timeout = _to_seconds(timeout)
        self._operations = 0  # numbered alike on every rank: saves and loads are collective calls
        self._active: _Watch | None = None

    @contextmanager
    def watch(self, operation: str) -> Iterator[None]:
        """Watch the I/O of ``operation`` (a collective save or load) on this rank and its ring neighbour.

        Inside another watch of this process (a load that calls a raw load) it watches nothing more.
        """
        if self._active is not None:
            yield
            return
        watch = self._active = self.start(operation)
        try:
            yield
        finally:
            self._active = None
            if watch is not None:
                watch.stop()

    def start(self, operation: str) -> _Watch | None:
        """Start watching ``operation``; the caller (e.g. a background save, when committed) calls ``stop()``."""
        if self.timeout is None:
            return None
        self._operations += 1
        store = _default_store()
        if store is None:
            return None
        import torch.distributed as dist

        return _Watch(store, self._operations, operation, self.timeout, dist.get_rank(), dist.get_world_size())


def _default_store() -> Any:
    import torch.distributed as dist

    from fabric_hsdp.versions import default_process_group_store

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return default_process_group_store()
    except (RuntimeError, ValueError, AttributeError):
        return None  # e.g. a fake process group without a store: nothing to watch with


class _Watch:
    """One watched operation: the thread that posts this rank's progress and judges itself and its neighbour."""

    def __init__(self, store: Any, number: int, operation: str, timeout: float, rank: int, world: int) -> None:
        self._store = store
        self._operation = operation
        self._timeout = timeout
        self._rank = rank
        self._host = socket.gethostname()
        self._interval = min(max(timeout / 8, 0.05), 5.0)
        self._key = f"{_PREFIX}/{number}/rank{rank}"
        self._failed_key = f"{_PREFIX}/{number}/failed"
        self._neighbour = (rank + 1) % world
        self._neighbour_key = f"{_PREFIX}/{number}/rank{self._neighbour}"
        self._stopped = threading.Event()
        self._store_call_since: float | None = None  # when the store call in progress began (None: none is)
        with _lock:
            _progress.done, _progress.file, _progress.steps = 0, "", _progress.steps + 1
        self._thread = threading.Thread(target=self._run, name="fabric-hsdp-io-watchdog", daemon=True)
        self._guard = threading.Thread(target=self._guard_store, name="fabric-hsdp-io-watchdog-store", daemon=True)
        self._thread.start()
        self._guard.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        self._guard.join()

    def _run(self) -> None:
        own = _Judge(self._timeout)
        neighbour = _Judge(self._timeout)
        posted: dict[str, Any] | None = None
        while not self._stopped.wait(self._interval):
            self._store_call_since = time.monotonic()
            try:
                record = _progress.record(self._rank, self._host)
                if record != posted:
                    self._store.set(self._key, json.dumps(record))
                    posted = record
                if own.stalled(record):
                    self._fail(self._describe(record))
                if self._store.check([self._neighbour_key]):
                    other = json.loads(self._store.get(self._neighbour_key))
                    if neighbour.stalled(other):
                        self._fail(self._describe(other))
                if self._store.check([self._failed_key]):
                    self._end(self._store.get(self._failed_key).decode())
            except Exception as error:  # noqa: BLE001 - a store gone at the end of the job: stop watching quietly
                if not self._stopped.is_set():
                    _logger.debug("checkpoint I/O watchdog stopped: %s", error)
                return
            finally:
                self._store_call_since = None
        with contextlib.suppress(Exception):  # best effort: the store may already be gone
            self._store.delete_key(self._key)

    def _guard_store(self) -> None:
        """End this process when one of the watch's store calls has not returned for ``timeout``: the store's
        process is stopped or frozen, and nothing else would end the collective this rank waits in."""
        seen = None  # the call in progress at the previous check
        while not self._stopped.wait(self._interval):
            since = self._store_call_since
            # judged on a second look at the same call: a process that could not run either thread for a while
            # (both waiting for the GIL) is not taken for a silent store
            if since is not None and since == seen and time.monotonic() - since > self._timeout:
                address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                self._end(
                    f"checkpoint I/O stalled while {self._operation}: the job's store ({address}, served by rank 0's"
                    f" process unless torchrun's agent serves it) has not answered rank {self._rank} (host"
                    f" {self._host}) for {self._timeout:g} s. Check that process and its host (a stopped process, a"
                    " frozen node); the limit is HybridFSDPStrategy(io_timeout=...)."
                )
            seen = since

    def _describe(self, record: dict[str, Any]) -> str:
        what = record["what"] or "doing I/O"
        file = f" '{record['file']}'" if record["file"] else ""
        return (
            f"checkpoint I/O stalled while {self._operation}: rank {record['rank']} (host {record['host']}) has not"
            f" advanced for {self._timeout:g} s {what}{file} ({record['done']:,} bytes done in this operation). Check"
            " that file's filesystem on that host (a dead mount, a lock, a stopped process); the limit is"
            " HybridFSDPStrategy(io_timeout=...)."
        )

    def _fail(self, message: str) -> None:
        # the first to report wins: every rank ends with the same message
        first = self._store.compare_set(self._failed_key, "", message)
        self._end(first.decode() if isinstance(first, bytes) else str(first))

    def _end(self, message: str) -> None:
        _logger.error("%s", message)
        sys.stderr.write(f"fabric_hsdp: {message}\n")
        sys.stderr.flush()
        # Let every other watchdog read the message before this process's sockets close (rank 0 serves the store,
        # and a peer gone from a collective would end the waiting ranks with gloo's error instead of this one).
        time.sleep(2 * self._interval + 1.0)
        os._exit(1)  # the main thread may be blocked in a collective or in the kernel: nothing else can end it


class _Judge:
    """Whether a rank in I/O has gone ``timeout`` seconds (on this clock) without its progress changing."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._steps: int | None = None
        self._since = time.monotonic()

    def stalled(self, record: dict[str, Any]) -> bool:
        now = time.monotonic()
        if not record["in_io"] or record["steps"] != self._steps:
            self._steps, self._since = record["steps"], now
            return False
        return now - self._since > self._timeout
