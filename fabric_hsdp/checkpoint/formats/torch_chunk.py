"""Where a DCP chunk's tensor bytes lie, read from its zip directory and pickle instead of ``torch.load``.

DCP stores each tensor chunk as a small ``torch.save`` archive inside a ``.distcp`` file. To read only the bytes a
rank needs, a reader must know where the chunk's storage starts and how the tensor views it.
``torch.load(map_location="meta")`` says so but costs about a millisecond per chunk (a Python zip reader, the
weights-only unpickler): a second per thousand chunks, a large part of a cold load. :func:`chunk_record` reads the
archive's end-of-directory record and central directory (one positioned read at the chunk's end), the local headers
and ``data.pkl`` (one at its start) and unpickles ``data.pkl`` with an allow-list that only records the layout.

It returns ``None`` for anything but the plain form ``torch.save`` writes for one tensor (zip64, compression,
another byte order, other pickled objects); the caller then uses ``torch.load``, which also reports damage.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

from fabric_hsdp.versions import dtype_to_storage_type_map

_PROBE = 4096  # bytes read at each end of a chunk: its directory and its first records fit in them
_END = struct.Struct("<4sHHHHIIH")  # end of central directory
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_ZIP64 = 0xFFFFFFFF


@dataclass(frozen=True)
class ChunkRecord:
    """Where a chunk's tensor lies in its file: its storage's first byte, and the view of the storage that is the
    tensor."""

    start: int
    storage_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def chunk_record(fd: int, offset: int, length: int) -> ChunkRecord | None:
    """The layout of the one-tensor ``torch.save`` archive at bytes ``offset..offset + length`` of ``fd``, or
    ``None`` when it is not in the plain form (read it with ``torch.load`` then)."""
    if length < _END.size:
        return None
    tail_start = max(0, length - _PROBE)
    tail = os.pread(fd, length - tail_start, offset + tail_start)
    if len(tail) != length - tail_start:
        return None
    signature, _, _, _, count, directory_size, directory_offset, comment = _END.unpack_from(tail, len(tail) - _END.size)
    if signature != b"PK\x05\x06" or comment or directory_offset == _ZIP64 or count == 0xFFFF:
        return None
    records = _directory(tail, directory_offset - tail_start, directory_size, count)
    if records is None or "data.pkl" not in records:
        return None
    head = os.pread(fd, min(length, _PROBE), offset)
    pickled = _record_bytes(head, records["data.pkl"])
    order = _record_bytes(head, records["byteorder"]) if "byteorder" in records else sys.byteorder.encode()
    if pickled is None or order != sys.byteorder.encode():
        return None
    tensor = _unpickle_layout(pickled)
    if tensor is None:
        return None
    dtype, key, numel, storage_offset, shape, stride = tensor
    data = records.get(f"data/{key}")
    start = _data_start(head, data[0]) if data is not None else None
    if start is None or data[1] != numel * dtype.itemsize:
        return None
    return ChunkRecord(offset + start, data[1], dtype, shape, stride, storage_offset)


def _directory(tail: bytes, start: int, size: int, count: int) -> dict[str, tuple[int, int]] | None:
    """Record name (without the archive's folder) -> (local header offset, stored size), from the central
    directory at ``start`` of ``tail``; ``None`` if it is not there or not plain."""
    if start < 0 or start + size > len(tail) - _END.size:
        return None
    records: dict[str, tuple[int, int]] = {}
    position = start
    for _ in range(count):
        if position + _CENTRAL.size > len(tail):
            return None
        fields = _CENTRAL.unpack_from(tail, position)
        signature, method, stored, name_length, extra_length, comment_length, local = (
            fields[0],
            fields[4],
            fields[8],
            fields[10],
            fields[11],
            fields[12],
            fields[16],
        )
        if signature != b"PK\x01\x02" or method != 0 or stored == _ZIP64 or local == _ZIP64:
            return None
        name = tail[position + _CENTRAL.size : position + _CENTRAL.size + name_length].decode("utf-8", "replace")
        records[name.split("/", 1)[-1]] = (local, stored)
        position += _CENTRAL.size + name_length + extra_length + comment_length
    return records


def _data_start(head: bytes, local: int) -> int | None:
    """Where the data of the record whose local header is at ``local`` starts, if that header is in ``head``."""
    if local + _LOCAL.size > len(head):
        return None
    signature, *_, name_length, extra_length = _LOCAL.unpack_from(head, local)
    if signature != b"PK\x03\x04":
        return None
    return local + _LOCAL.size + name_length + extra_length


def _record_bytes(head: bytes, record: tuple[int, int]) -> bytes | None:
    start = _data_start(head, record[0])
    if start is None or start + record[1] > len(head):
        return None
    return head[start : start + record[1]]


class _NotPlain(Exception):
    pass


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """``"FloatStorage"`` -> ``torch.float32``, ...: the storage names ``torch.save`` pickles (not their classes,
    whose ``dtype`` warns that typed storages are deprecated)."""
    return {name: dtype for dtype, name in dtype_to_storage_type_map().items()}


def _rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any, *_: Any) -> tuple:
    if not isinstance(storage, tuple):
        raise _NotPlain
    return (*storage, storage_offset, tuple(size), tuple(stride))


class _ChunkRecordUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.save``'d tensor's ``data.pkl`` into its layout; any other object is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        dtype = _storage_dtypes().get(name) if module == "torch" else None
        if dtype is None:
            raise _NotPlain
        return dtype

    def persistent_load(self, saved_id: Any) -> Any:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
            raise _NotPlain
        _, dtype, key, _, numel = saved_id
        if not isinstance(dtype, torch.dtype):
            raise _NotPlain
        return (dtype, str(key), int(numel))


def _unpickle_layout(pickled: bytes) -> tuple | None:
    try:
        layout = _ChunkRecordUnpickler(io.BytesIO(pickled)).load()
    except (_NotPlain, pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError):
        return None
    return layout if isinstance(layout, tuple) and len(layout) == 6 else None
