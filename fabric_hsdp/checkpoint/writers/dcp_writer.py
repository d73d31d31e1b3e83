"""Writing a DCP directory in a single process, streaming: one tensor in memory at a time.

``dcp.save`` is a single call; its planner is handed meta tensors and reads each real tensor only when the storage
writer asks for it, into one scratch buffer; the files are written through
:class:`~fabric_hsdp.checkpoint.core.fileio.DirectFileWriter`.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from fabric_hsdp.checkpoint.core.commit import atomic_output
from fabric_hsdp.checkpoint.core.dcp_errors import single_process_dcp
from fabric_hsdp.checkpoint.core.fileio import release_freed_memory
from fabric_hsdp.checkpoint.core.tree import map_tree, read_lazy
from fabric_hsdp.checkpoint.formats.dcp_metadata import META_FILE
from fabric_hsdp.checkpoint.writers.direct_writer import DirectFileSystem
from fabric_hsdp.checkpoint.writers.full_files import (
    ProgressFn,
    TensorsArg,
    check_entries,
    contiguous_cpu,
    disk_full_error,
    scratch_for,
)
from fabric_hsdp.errors import CheckpointError

_logger = logging.getLogger(__name__)


class _StreamingSavePlanner(DefaultSavePlanner):
    """A save planner whose state dict holds meta tensors; the real tensor is produced when DCP asks to write it.

    A LazyTensor is read into one scratch buffer that every item reuses, and a copy this planner had to make is
    freed (storage resized to 0) when the next item is asked for: ``FileSystemWriter`` keeps a reference to every
    tensor it wrote until the file is closed, but never reads them again in its default (torch.save) format. Both
    are safe because the writer is built with ``thread_count=1, per_thread_copy_ahead=0``: its serial loader
    resolves item ``i + 1`` only after item ``i`` is written.
    """

    def __init__(self, producers: dict[str, Any], on_tensor: Callable[[int], None] | None) -> None:
        super().__init__(flatten_state_dict=True)
        self._producers = producers
        self._on_tensor = on_tensor
        self._written: torch.Tensor | None = None
        self._scratch = scratch_for(producers.values())

    def release(self) -> None:
        if self._written is not None:
            self._written.untyped_storage().resize_(0)
            self._written = None
            release_freed_memory()

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        self.release()
        tensor, owned = contiguous_cpu(write_item.index.fqn, self._producers[write_item.index.fqn], self._scratch)
        expected = write_item.tensor_data
        if tensor.shape != expected.size or tensor.dtype != expected.properties.dtype:
            raise CheckpointError(f"tensor {write_item.index.fqn!r} changed shape or dtype while being written")
        if owned:
            self._written = tensor
        if self._on_tensor is not None:
            self._on_tensor(tensor.nbytes)
        return tensor


def save_streaming(state: dict[str, Any], path: Path, on_tensor: Callable[[int], None] | None = None) -> None:
    """``dcp.save`` of a nested state dict whose tensors may be LazyTensor, holding about one tensor in memory."""
    producers: dict[str, Any] = {}

    def placeholder(leaf: Any, leaf_path: tuple) -> torch.Tensor:
        producers[".".join(str(part) for part in leaf_path)] = leaf  # the key DCP flattens this path to
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")

    skeleton = map_tree(state, placeholder)
    planner = _StreamingSavePlanner(producers, on_tensor)
    writer = FileSystemWriter(path, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0, overwrite=False)
    writer.fs = DirectFileSystem()
    try:
        with single_process_dcp():
            dcp.save(skeleton, storage_writer=writer, planner=planner, no_dist=True)
    finally:
        planner.release()


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def write_dcp(
    dest: str | os.PathLike,
    tensors: TensorsArg,
    *,
    extras: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    on_tensor: ProgressFn | None = None,
) -> Path:
    """Write a DCP directory in Lightning's layout: ``model.<name>`` tensors, optimizer states, and ``meta.pt``.

    Optimizer states in ``extras`` (dicts with ``state`` and ``param_groups``) go into DCP like Lightning's
    ``ModelParallelStrategy`` saves them; every other extra goes into ``meta.pt`` (always written, ``{}`` if empty).
    """
    entries = check_entries(tensors)
    state: dict[str, Any] = {"model": dict(entries)}
    meta: dict[str, Any] = {}
    for key, value in (extras or {}).items():
        if key == "model":
            raise ValueError("extras cannot hold a 'model' entry: the model tensors are passed as `tensors`")
        if _is_optimizer_state(value):
            if any(isinstance(param_id, int) for param_id in value["state"]):
                _logger.warning(
                    "Optimizer state %r is keyed by parameter index (a plain optimizer.state_dict()). DCP keeps the"
                    " indices as strings ('0', '1', ...), so it reads back keyed by strings, and the sharded loader"
                    " expects states keyed by parameter name.",
                    key,
                )
            state[key] = value
        else:
            meta[key] = value
    with atomic_output(dest, overwrite) as tmp:
        tmp.mkdir()
        try:
            save_streaming(state, tmp, on_tensor)
        except RuntimeError as error:
            full = disk_full_error(Path(dest), error)
            if full is not None:
                raise full from None
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(read_lazy(meta), tmp / META_FILE)
    return Path(dest)
