"""Reading a DCP directory's tensors with one copy: :class:`OneCopyReader` and :func:`read_dcp_box`.

:class:`OneCopyReader` copies a chunk's bytes straight into the target tensor with a positioned read. Torch's reader
first ``torch.load``s the chunk into a temporary and then copies it, which doubles the memory of the largest tensor.
Used by the training path (:mod:`fabric_hsdp.checkpoint.training.sharded`) and the offline reader
(:mod:`fabric_hsdp.checkpoint.formats.dcp_directory`).
"""

from __future__ import annotations

import io
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from fabric_hsdp.checkpoint.core import fileio, watchdog
from fabric_hsdp.checkpoint.formats.torch_chunk import ChunkLayout, chunk_layout
from fabric_hsdp.errors import CheckpointError


class OneCopyReader(FileSystemReader):
    """A ``FileSystemReader`` that reads plain tensor chunks straight into their targets (one copy, not two)."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata
        self.set_up_storage_reader(metadata, is_coordinator=True)  # read_dcp_box reads without a dcp.load around it

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        others = []
        by_file: dict[str, list] = {}
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                others.append(item)
            else:
                by_file.setdefault(info.relative_path, []).append(item)
        for relative_path, items in by_file.items():
            file = Path(self.path) / relative_path
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)  # in file order, for readahead
            with watchdog.doing_io("reading", str(file)), open(file, "rb") as stream:
                for item in items:
                    self._read_item(stream, str(file), item, planner)
        if others:
            with watchdog.doing_io("reading", str(self.path)):
                return super().read_data(LoadPlan(others), planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, stream: io.BufferedReader, file_name: str, item: Any, planner: LoadPlanner) -> None:
        fd = stream.fileno()
        stored = _stored_layout(stream, file_name, item, self.storage_data[item.storage_index])
        target = planner.resolve_tensor(item).detach()
        offsets, lengths, shape = list(item.storage_offsets), list(item.lengths), list(stored.shape)
        itemsize = stored.dtype.itemsize
        if stored.contiguous:  # as DCP writes them: only the wanted box is read
            base = stored.start + stored.storage_offset * itemsize
            rows = offsets[1:] == [0] * len(offsets[1:]) and lengths[1:] == shape[1:]  # one contiguous run
            direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == stored.dtype
            if rows and direct:
                first = offsets[0] * math.prod(shape[1:]) if shape else 0
                fileio.readinto(fd, target, base + first * itemsize, file_name=file_name)
            else:  # another box, device or dtype: through a CPU buffer of the box
                box = tuple(slice(offset, offset + length) for offset, length in zip(offsets, lengths))
                fqn = item.storage_index.fqn
                target.copy_(fileio.read_box(fd, base, shape, stored.dtype, box, name=fqn, file_name=file_name))
        else:
            raw = fileio.read_tensor(fd, stored.start, [stored.storage_bytes], torch.uint8, file_name=file_name)
            chunk = raw.view(stored.dtype).as_strided(stored.shape, stored.stride, stored.storage_offset)
            target.copy_(narrow(chunk, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)


def _stored_layout(stream: io.BufferedReader, file_name: str, item: Any, info: _StorageInfo) -> ChunkLayout:
    """Where the chunk's bytes start and how its tensor views them: parsed directly in the plain form DCP writes
    (:mod:`~fabric_hsdp.checkpoint.formats.torch_chunk`), else by a meta-load of the chunk's archive."""
    size = os.fstat(stream.fileno()).st_size
    try:
        if info.offset + info.length > size:
            raise RuntimeError(f"the file has {size} bytes")
        layout = chunk_layout(stream.fileno(), info.offset, info.length)
        if layout is not None:
            return layout
        view = _create_file_view(stream, info.offset, info.length)
        stored = torch.load(view, map_location="meta", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(
            f"'{file_name}' is truncated or damaged: tensor {item.storage_index.fqn!r} at bytes"
            f" {info.offset}..{info.offset + info.length} cannot be read ({str(error).splitlines()[0]})"
        ) from None
    storage = stored.untyped_storage()
    return ChunkLayout(
        start=info.offset + storage._checkpoint_offset,
        storage_bytes=storage.nbytes(),
        dtype=stored.dtype,
        shape=tuple(stored.shape),
        stride=tuple(stored.stride()),
        storage_offset=stored.storage_offset(),
    )


def narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The view of ``tensor`` at ``offsets`` (one per dim) with ``lengths``."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class _BoxPlanner(DefaultLoadPlanner):
    """Resolves each read of :func:`read_dcp_box` to the part of the caller's box tensor it fills."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self._target = target

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return narrow(self._target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read_dcp_box(reader: OneCopyReader, fqn: str, offsets: list[int], target: torch.Tensor) -> torch.Tensor:
    """Fill ``target`` with the box of tensor ``fqn`` that starts at ``offsets`` (and has ``target``'s shape).

    Only the stored chunks the box overlaps are read, and of each only the overlap (DCP's own resharding arithmetic,
    ``create_read_items_for_chunk_list``), so a rank reads exactly the elements it holds.
    """
    entry = reader.read_metadata().state_dict_metadata[fqn]
    wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=target.shape)
    items = create_read_items_for_chunk_list(fqn, entry, [wanted])
    reader.read_data(LoadPlan(items), _BoxPlanner(target)).wait()
    return target
