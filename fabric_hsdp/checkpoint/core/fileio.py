"""Low-level I/O for checkpoints: positioned reads into caller-owned tensors, and page-cache-bypassing writes.

Readers end here once they know where a tensor's bytes start in a file. Reading with ``os.preadv`` into a fresh
tensor keeps resident memory at the size of that tensor: the page cache that the kernel fills is not charged to the
process, whereas touching an ``mmap`` of the file grows RssFile up to the file size. Writers write through
:class:`DirectFileWriter`, which skips the page cache (see there).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import io
import math
import mmap
import os
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from fabric_hsdp.checkpoint.core import watchdog
from fabric_hsdp.errors import CheckpointError

if TYPE_CHECKING:
    from fabric_hsdp.checkpoint.core.box import Box

# Reads are issued in pieces of this size (each one reported to the I/O watchdog); short reads are retried.
_READ_PIECE = 64 << 20
# A slice that is not a run of whole rows is assembled from row blocks of at most this many bytes.
_SLICE_BLOCK = 64 << 20


@functools.cache
def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL("libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(path: str | os.PathLike) -> None:
    """Ask the kernel to start writing ``path``'s dirty pages now, without waiting (Linux only; else a no-op).

    Writers call this after each tensor so the disk works while the next tensor is read; the fsync that makes the
    output durable before it is renamed into place then has little left to wait for.
    """
    sync_file_range = _libc_function("sync_file_range")
    if sync_file_range is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)


def release_freed_memory() -> None:
    """Hand memory freed by the allocator back to the OS (glibc only; a no-op elsewhere).

    glibc keeps freed blocks below its mmap threshold (up to 32 MiB) in the heap, so resident memory would climb
    with every tensor a writer frees; trimming after each tensor (about 1 ms) keeps it at one tensor.
    """
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def readinto(fd: int, target: torch.Tensor, offset: int, *, file_name: str) -> None:
    """Fill the contiguous CPU tensor ``target`` with the bytes at ``offset`` of the open file ``fd``.

    Raises:
        CheckpointError: if the file ends before ``target`` is full (a truncated checkpoint).
        ValueError: if ``target`` is not a contiguous CPU tensor.
    """
    if target.device.type != "cpu" or not target.is_contiguous():
        raise ValueError("readinto needs a contiguous CPU tensor")
    nbytes = target.numel() * target.element_size()
    if nbytes == 0:
        return
    # A ctypes view, not .numpy(): numpy export pins the storage, and writers free storages by resizing them.
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(target.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        count = os.preadv(fd, [view[done : done + _READ_PIECE]], offset + done)
        if count == 0:
            raise CheckpointError(
                f"'{file_name}' is truncated: a tensor needs bytes {offset}..{offset + nbytes} but the file ends at"
                f" {offset + done}. Re-copy or re-save the checkpoint."
            )
        done += count
        watchdog.advance(count, file_name)


def read_tensor(
    fd: int,
    offset: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    file_name: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read a row-major tensor of ``shape`` and ``dtype`` stored at ``offset`` into ``out`` or a new CPU tensor."""
    tensor = torch.empty(tuple(shape), dtype=dtype) if out is None else out
    readinto(fd, tensor, offset, file_name=file_name)
    return tensor


class ScratchBuffer:
    """One reusable buffer that a writer reads each streamed tensor into.

    Fresh memory costs a page fault per 4 KiB on first touch, which made reading into new tensors several times
    slower than the read itself; reusing one buffer the size of the largest tensor pays that once.
    """

    def __init__(self, nbytes: int) -> None:
        self._buffer = torch.empty(nbytes, dtype=torch.uint8)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over the start of the buffer whose storage is exactly its size (valid until the next take)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        if nbytes > self._buffer.numel():
            raise ValueError(f"a {nbytes}-byte tensor does not fit the {self._buffer.numel()}-byte scratch buffer")
        memory = (ctypes.c_ubyte * nbytes).from_address(self._buffer.data_ptr())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about the buffer's lifetime, which we manage
            raw = torch.frombuffer(memory, dtype=torch.uint8)
        return raw.view(dtype).view(tuple(shape))


def read_box(
    fd: int, offset: int, shape: Sequence[int], dtype: torch.dtype, box: Box, *, file_name: str
) -> torch.Tensor:
    """Read only ``box`` of a row-major tensor of ``shape`` stored at ``offset``; returns a new contiguous tensor.

    A box of whole rows is one positioned read. A box of whole inner rows but some columns of dim 1 (what a
    column-split weight holds) is one positioned read per row, of exactly the box's bytes. Any other box is assembled
    from blocks of whole rows of at most 64 MiB each, so memory stays at the box plus one block.
    """
    if len(shape) == 0:
        return read_tensor(fd, offset, (), dtype, file_name=file_name)
    itemsize = dtype.itemsize
    row_bytes = math.prod(shape[1:]) * itemsize
    first_row, last_row = box.offsets[0], box.stops[0]
    out = torch.empty(box.sizes, dtype=dtype)
    if out.numel() == 0:
        return out
    inner = box.slices()[1:]
    if tuple(box.sizes[1:]) == tuple(shape[1:]):
        readinto(fd, out, offset + first_row * row_bytes, file_name=file_name)
        return out
    if tuple(box.sizes[2:]) == tuple(shape[2:]):
        column_bytes = math.prod(shape[2:]) * itemsize
        first_column = offset + box.offsets[1] * column_bytes
        for row in range(first_row, last_row):
            readinto(fd, out[row - first_row], first_column + row * row_bytes, file_name=file_name)
        return out
    rows_per_block = max(1, _SLICE_BLOCK // max(1, row_bytes))
    for row in range(first_row, last_row, rows_per_block):
        block_end = min(last_row, row + rows_per_block)
        block = read_tensor(fd, offset + row * row_bytes, [block_end - row, *shape[1:]], dtype, file_name=file_name)
        out[row - first_row : block_end - first_row] = block[(slice(None), *inner)]
    return out


class DirectFileWriter(io.RawIOBase):
    """A write-only file that bypasses the page cache (``O_DIRECT``), writing on a thread while the caller works.

    Writing through the page cache costs a page allocation and copy per 4 KiB and then the same bytes again at
    ``fsync``; ``O_DIRECT`` skips both and leaves the page cache to the caller's other work (docs/cli.md has the
    measured difference). Data is copied into one of two 16 MiB page-aligned buffers; a full
    buffer is written by a background thread while the caller fills the other, so reading the next tensor overlaps
    with the disk. The unaligned tail is written without ``O_DIRECT`` on :meth:`close`. Where the filesystem refuses
    ``O_DIRECT`` the writer falls back to plain writes and asks the kernel to start writeback after each buffer.

    ``flush()`` does not wait for the disk: everything is written by ``close()``; fsync after it for durability.
    """

    BLOCK = 16 << 20
    _ALIGN = 4096

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self._path = path
        self._name = str(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        try:
            self._fd = os.open(path, flags | direct, 0o644)
            self._direct = bool(direct)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self._fd, self._direct = os.open(path, flags, 0o644), False
        self._buffers = [memoryview(mmap.mmap(-1, self.BLOCK)) for _ in range(2)]
        self._current = 0
        self._fill = 0
        self._position = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fabric-hsdp-writer")
        self._pending: Future | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._position + self._fill

    def flush(self) -> None:
        pass

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size, done = view.nbytes, 0
        with watchdog.doing_io("writing", self._name):  # a disk that stops taking writes blocks in _submit
            while done < size:
                buffer = self._buffers[self._current]
                take = min(self.BLOCK - self._fill, size - done)
                buffer[self._fill : self._fill + take] = view[done : done + take]
                self._fill += take
                done += take
                watchdog.advance(take)
                if self._fill == self.BLOCK:
                    self._submit()
        return size

    def _submit(self) -> None:
        """Hand the full current buffer to the writing thread and go on in the other one."""
        self._wait()
        self._pending = self._pool.submit(self._write_all, self._buffers[self._current][: self._fill])
        self._position += self._fill
        self._current ^= 1
        self._fill = 0

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            try:
                done += os.write(self._fd, view[done:])
            except OSError as error:
                if error.errno != errno.EINVAL or not self._direct:
                    raise
                self._drop_direct()  # the filesystem took the flag at open but refuses O_DIRECT writes
        if not self._direct:
            start_writeback(self._path)

    def _drop_direct(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False

    def close(self) -> None:
        if self.closed:
            return
        with watchdog.doing_io("writing", self._name):
            self._finish()

    def _finish(self) -> None:
        try:
            self._wait()
            if self._fill:
                buffer = self._buffers[self._current]
                aligned = self._fill // self._ALIGN * self._ALIGN if self._direct else self._fill
                if aligned:
                    self._write_all(buffer[:aligned])
                if self._fill > aligned:
                    self._drop_direct()
                    self._write_all(buffer[aligned : self._fill])
                self._position += self._fill
                self._fill = 0
        finally:
            self._pool.shutdown(wait=True)
            os.close(self._fd)
            self._buffers = []  # the mmaps are unmapped once the last view of them is gone
            super().close()
