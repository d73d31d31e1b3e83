"""DCP's file writer with the CPU work that is ours to remove taken out: page-cache copies and per-record CRC32.

Measured on this project's machine (``benchmarks/checkpoint_io.py``, profiled with cProfile per rank): of a
sharded save's CPU time, torch's zip writer spent about a third computing each record's CRC32, the buffered writes a
third copying into the page cache and ``fsync`` the rest waiting for that cache to be written back. Here each
``.distcp`` file is written through :class:`~fabric_hsdp.checkpoint.core.fileio.DirectFileWriter` (``O_DIRECT`` from two
aligned buffers, the disk writing one while the next is filled) and records carry no CRC32
(``torch.serialization.set_crc32_options(False)`` while the files are written). The format is unchanged: torch's
readers, DCP's ``FileSystemReader``, ``dcp_to_torch_save`` and Lightning's consolidation read these files; only a
generic ``unzip`` would warn about the CRC fields. Each file is fsync'ed when closed, before DCP writes
``.metadata``. Progress goes to the I/O watchdog (:mod:`fabric_hsdp.checkpoint.core.watchdog`) every 16 MiB.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from fabric_hsdp.checkpoint.core import watchdog
from fabric_hsdp.checkpoint.core.fileio import DirectFileWriter


class DirectWriter(FileSystemWriter):
    """A ``FileSystemWriter`` (one file per rank and writing thread) that writes with ``O_DIRECT`` and no CRC32.

    Args:
        path: The directory to write into.
        thread_count: Writing threads per rank (DCP's option): each writes its own file. More than one pays where a
            rank's share is large and the filesystem serves parallel streams faster (e.g. NVMe, parallel
            filesystems); on the 2-core test machine one is fastest.
        before_write: Called in the writing thread before the first byte is read from the state (e.g. waiting for
            the CUDA copies of :mod:`fabric_hsdp.checkpoint.training.staging`).
    """

    def __init__(
        self, path: str | os.PathLike, *, thread_count: int = 1, before_write: Callable[[], None] | None = None
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.fs = DirectFileSystem()
        self._before_write = before_write

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self._before_write is not None:
            self._before_write()  # e.g. wait for the staging copies (staging.Staged.ready)
        with watchdog.doing_io("writing", str(self.path)), _without_crc32():
            return super().write_data(plan, planner)


_crc_lock = threading.Lock()
_crc_users = 0


@contextmanager
def _without_crc32() -> Iterator[None]:
    """No CRC32 in the records ``torch.save`` writes meanwhile (a process-wide setting, counted across threads)."""
    global _crc_users
    with _crc_lock:
        if _crc_users == 0:
            _without_crc32.previous = torch.serialization.get_crc32_options()  # type: ignore[attr-defined]
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(_without_crc32.previous)  # type: ignore[attr-defined]


class DirectFileSystem(FileSystem):
    """DCP's local filesystem, writing files through :class:`_WatchedDirectFile` (``O_DIRECT``, fsync'ed when
    closed); the sharded saves' and the offline converter's DCP writers both use it."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _WatchedDirectFile(path)
        try:
            yield stream
        finally:
            stream.close()


class _WatchedDirectFile(DirectFileWriter):
    """A :class:`DirectFileWriter` (which reports its progress to the I/O watchdog) that is durable once closed."""

    def close(self) -> None:
        if self.closed:
            return
        fd = os.dup(self.fileno())
        try:
            super().close()  # writes the tail
            with watchdog.doing_io("writing", str(self._path)):
                os.fsync(fd)
        finally:
            os.close(fd)
