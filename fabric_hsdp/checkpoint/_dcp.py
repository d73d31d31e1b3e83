"""``torch.distributed.checkpoint`` directories, read and written in a single process.

Each tensor is read by ``dcp.load(..., no_dist=True)`` into a tensor of its full shape, so DCP's planner does the
chunk bookkeeping (a tensor saved by N ranks is N chunks). Two things differ from torch's defaults:

* ``.metadata`` is unpickled with an allow-list of DCP's own classes when ``weights_only=True`` (torch's
  ``FileSystemReader`` uses plain ``pickle.load``), and non-tensor entries with ``torch.load(weights_only=...)``.
* The storage reader copies a chunk's bytes straight into the target tensor with a positioned read. Torch's reader
  first ``torch.load``s the chunk into a temporary and then copies it, which doubles the memory of the largest tensor.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pathlib
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from fabric_hsdp.checkpoint import _io
from fabric_hsdp.checkpoint._torch_file import _weights_only_hint
from fabric_hsdp.checkpoint.sources import CheckpointSource, LazyTensor, TensorInfo, map_tensors, split_layout

META_FILENAME = "meta.pt"  # Lightning's ModelParallelStrategy keeps non-tensor state here

_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
for _name in (
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
):
    if hasattr(dcp_metadata, _name):
        _METADATA_GLOBALS[("torch.distributed.checkpoint.metadata", _name)] = getattr(dcp_metadata, _name)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` allowing only DCP's metadata classes, torch dtypes and sizes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_metadata(path: Path, *, weights_only: bool = True) -> dcp_metadata.Metadata:
    """Read a DCP directory's ``.metadata``; with ``weights_only`` only DCP's own metadata classes are unpickled."""
    file = path / ".metadata"
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load() if weights_only else pickle.load(stream)
    except pickle.UnpicklingError as error:
        if "not allowed" in str(error):
            raise ValueError(
                f"'{file}' holds objects that safe loading refuses ({error}). If you trust this checkpoint, pass"
                " weights_only=False (CLI: --unsafe_pickle)."
            ) from None
        raise ValueError(f"'{file}' is truncated or damaged ({error}); it is not DCP metadata") from None
    except (EOFError, AttributeError, ImportError, TypeError, ValueError) as error:
        raise ValueError(f"'{file}' is truncated or damaged ({error}); it is not DCP metadata") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"'{file}' is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


class _SingleCopyReader(FileSystemReader):
    """A ``FileSystemReader`` that reads plain tensor chunks straight into their targets (one copy, not two)."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

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
            with open(file, "rb") as stream:
                for item in items:
                    self._read_item(stream, str(file), item, planner)
        if others:
            return super().read_data(LoadPlan(others), planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, stream: io.BufferedReader, file_name: str, item: Any, planner: LoadPlanner) -> None:
        info: _StorageInfo = self.storage_data[item.storage_index]
        # Each chunk is a small torch.save archive; its meta-load gives the layout and where the bytes start.
        size = os.fstat(stream.fileno()).st_size
        try:
            if info.offset + info.length > size:
                raise RuntimeError(f"the file has {size} bytes")
            view = _create_file_view(stream, info.offset, info.length)
            stored = torch.load(view, map_location="meta", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
            raise ValueError(
                f"'{file_name}' is truncated or damaged: tensor {item.storage_index.fqn!r} at bytes"
                f" {info.offset}..{info.offset + info.length} cannot be read ({str(error).splitlines()[0]})"
            ) from None
        start = info.offset + stored.untyped_storage()._checkpoint_offset
        fd = stream.fileno()
        target = planner.resolve_tensor(item).detach()
        offsets, lengths, shape = list(item.storage_offsets), list(item.lengths), list(stored.shape)
        if stored.is_contiguous():  # as DCP writes them: only the wanted box is read
            base = start + stored.storage_offset() * stored.element_size()
            rows = offsets[1:] == [0] * len(offsets[1:]) and lengths[1:] == shape[1:]  # one contiguous run
            direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == stored.dtype
            if rows and direct:
                first = offsets[0] * math.prod(shape[1:]) if shape else 0
                _io.readinto(fd, target, base + first * stored.element_size(), file_name=file_name)
            else:  # another box, device or dtype: through a CPU buffer of the box
                box = tuple(slice(offset, offset + length) for offset, length in zip(offsets, lengths))
                fqn = item.storage_index.fqn
                target.copy_(_io.read_box(fd, base, shape, stored.dtype, box, name=fqn, file_name=file_name))
        else:
            nbytes = stored.untyped_storage().nbytes()
            raw = _io.read_tensor(fd, start, [nbytes], torch.uint8, file_name=file_name)
            chunk = raw.view(stored.dtype).as_strided(stored.shape, stored.stride(), stored.storage_offset())
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                chunk = chunk.narrow(dim, offset, length)
            target.copy_(chunk)
        planner.commit_tensor(item, target)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, unpickling non-tensor entries with ``torch.load(weights_only=...)``.

    Torch's planner always unpickles them with ``weights_only=False``; optimizer ``param_groups`` (numbers, bools,
    tuples) load fine with the safe loader.
    """

    def __init__(self, *, weights_only: bool, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self._weights_only = weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=self._weights_only)
        except pickle.UnpicklingError as error:
            raise ValueError(
                f"checkpoint entry {fqn!r} holds objects that safe loading refuses ({str(error).splitlines()[0]})."
                " If you trust this checkpoint, pass weights_only=False."
            ) from None
        set_element(self.original_state_dict, self.mappings[fqn], loaded)


class _SafeBytesPlanner(DefaultLoadPlanner):
    """Loads non-tensor entries with ``torch.load(weights_only=...)`` instead of DCP's unconditional pickle."""

    def __init__(self, weights_only: bool) -> None:
        super().__init__(flatten_state_dict=False)
        self._weights_only = weights_only
        self.values: dict[str, Any] = {}  # dcp.load hands the planner a copy of the state dict; results land here

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=self._weights_only)


@contextmanager
def _dcp_call() -> Iterator[None]:
    """Run a single-process DCP call: silence its no-process-group warning, re-raise the error it wrapped.

    DCP wraps any failure, ``KeyboardInterrupt`` and ``OSError`` included, in a ``CheckpointException`` (a
    ``BaseException``); callers need the original to report it.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            yield
        except CheckpointException as error:
            raise first_failure(error) from None


def rank_failures(error: BaseException) -> dict[int, BaseException]:
    """The exceptions DCP wrapped in ``error``, by rank (it records each as ``(exception, traceback)``)."""
    failures = getattr(error, "failures", None) or {}
    return {rank: failure[0] if isinstance(failure, tuple) else failure for rank, failure in failures.items()}


def first_failure(error: CheckpointException) -> BaseException:
    """The first exception DCP wrapped in ``error``; ``error`` itself if it wrapped none."""
    return next(iter(rank_failures(error).values()), error)


def _quiet_load(state_dict: dict[str, Any], reader: FileSystemReader, planner: LoadPlanner) -> None:
    with _dcp_call():
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)


class DCPSource(CheckpointSource):
    """A DCP directory: Lightning's layout (``model.*`` tensors, optimizer entries, ``meta.pt``) or a flat one."""

    def __init__(self, path: Path, *, weights_only: bool) -> None:
        super().__init__(path, "dcp")
        self._weights_only = weights_only
        self.metadata = read_metadata(path, weights_only=weights_only)
        entries = self.metadata.state_dict_metadata
        mapping = self.metadata.planner_data
        if not isinstance(mapping, dict) or set(mapping) != set(entries):
            mapping = {fqn: (fqn,) for fqn in entries}
        self._fqn_of_path = {tuple(path_): fqn for fqn, path_ in mapping.items()}
        skeleton = unflatten_state_dict(dict(entries), mapping)
        is_tensor = lambda value: isinstance(value, dcp_metadata.TensorStorageMetadata)  # noqa: E731
        model_key, model, self._extras_skeleton = split_layout(skeleton, str(path), is_tensor)
        self.model_key = model_key
        self._fqns = {name: (f"{model_key}.{name}" if model_key else name) for name in model}
        for name, fqn in self._fqns.items():
            if fqn not in entries:  # a model key that itself needs the planner's mapping, e.g. nested dicts
                self._fqns[name] = self._fqn_of_path[(model_key, name) if model_key else (name,)]
        self._reader = _SingleCopyReader(path, self.metadata)
        self._extras_cache: dict[str, Any] | None = None

    def keys(self) -> list[str]:
        return list(self._fqns)

    def _info(self, name: str) -> TensorInfo:
        entry = self.metadata.state_dict_metadata[self._fqns[name]]
        return TensorInfo(name, entry.size, entry.properties.dtype)

    def _read_fqn(self, fqn: str, out: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.metadata.state_dict_metadata[fqn]
        target = torch.empty(entry.size, dtype=entry.properties.dtype) if out is None else out
        _quiet_load({fqn: target}, self._reader, DefaultLoadPlanner(flatten_state_dict=False))
        return target

    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        return self._read_fqn(self._fqns[name], out)

    def chunks(self, name: str) -> list[tuple[list[int], list[int]]]:
        """``(offsets, sizes)`` of each stored chunk of tensor ``name`` (one per saving rank that held a piece)."""
        self._check_name(name)
        entry = self.metadata.state_dict_metadata[self._fqns[name]]
        return [(list(chunk.offsets), list(chunk.sizes)) for chunk in entry.chunks]

    def _lazy_extras(self) -> dict[str, Any]:
        if self._extras_cache is not None:
            return self._extras_cache
        byte_fqns = [
            fqn
            for fqn, entry in self.metadata.state_dict_metadata.items()
            if isinstance(entry, dcp_metadata.BytesStorageMetadata)
        ]
        planner = _SafeBytesPlanner(self._weights_only)
        if byte_fqns:
            try:
                _quiet_load(dict.fromkeys(byte_fqns), self._reader, planner)
            except pickle.UnpicklingError as error:
                raise ValueError(
                    f"'{self.path}' holds non-tensor values that safe loading refuses ({str(error).splitlines()[0]})."
                    " If you trust this checkpoint, pass weights_only=False (CLI: --unsafe_pickle)."
                ) from None

        def convert(node: Any, path: tuple) -> Any:
            if isinstance(node, dcp_metadata.TensorStorageMetadata):
                fqn = self._fqn_of_path[path]
                load = functools.partial(self._read_fqn, fqn)
                return LazyTensor(fqn, node.size, node.properties.dtype, load, load)
            if isinstance(node, dcp_metadata.BytesStorageMetadata):
                return planner.values[self._fqn_of_path[path]]
            if isinstance(node, dict):
                return {key: convert(value, (*path, key)) for key, value in node.items()}
            if isinstance(node, list):
                return [convert(value, (*path, i)) for i, value in enumerate(node)]
            return node

        extras = {key: convert(value, (key,)) for key, value in self._extras_skeleton.items()}
        meta_file = self.path / META_FILENAME
        if meta_file.is_file():
            try:
                meta = torch.load(meta_file, map_location="cpu", weights_only=self._weights_only)
            except pickle.UnpicklingError as error:
                raise _weights_only_hint(str(meta_file), error) from None
            except (RuntimeError, EOFError) as error:
                raise ValueError(f"'{meta_file}' is truncated or damaged ({error})") from None
            if not isinstance(meta, dict):
                raise ValueError(f"'{meta_file}' holds a {type(meta).__name__}, expected a dict of values")
            extras.update(meta)
        self._extras_cache = extras
        return extras

    def close(self) -> None:
        self._extras_cache = None


def storage_files(path: Path) -> list[tuple[str, int]]:
    """The ``.distcp`` data files of a DCP directory with their sizes, for ``inspect``."""
    return sorted((entry.name, entry.stat().st_size) for entry in os.scandir(path) if entry.name.endswith(".distcp"))


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
        largest = max((value.nbytes for value in producers.values() if isinstance(value, LazyTensor)), default=0)
        self._scratch = _io.ScratchBuffer(largest)

    def release(self) -> None:
        if self._written is not None:
            self._written.untyped_storage().resize_(0)
            self._written = None
            _io.release_freed_memory()

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        self.release()
        value = self._producers[write_item.index.fqn]
        if isinstance(value, LazyTensor):
            tensor, owned = value.materialize(out=self._scratch.take(value.shape, value.dtype)), False
        else:
            tensor, owned = value.detach().cpu(), value.device.type != "cpu"
        if not tensor.is_contiguous() or tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor, owned = tensor.clone(memory_format=torch.contiguous_format), True
        expected = write_item.tensor_data
        if tensor.shape != expected.size or tensor.dtype != expected.properties.dtype:
            raise RuntimeError(f"tensor {write_item.index.fqn!r} changed shape or dtype while being written")
        if owned:
            self._written = tensor
        if self._on_tensor is not None:
            self._on_tensor(tensor.nbytes)
        return tensor


class _DirectFileSystem(FileSystem):
    """DCP's local filesystem, writing files through :class:`~fabric_hsdp.checkpoint._io.DirectFileWriter`."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _io.DirectFileWriter(path) as stream:
            yield stream


def save_streaming(state: dict[str, Any], path: Path, on_tensor: Callable[[int], None] | None = None) -> None:
    """``dcp.save`` of a nested state dict whose tensors may be LazyTensor, holding about one tensor in memory."""
    producers: dict[str, Any] = {}

    def placeholder(leaf: Any, leaf_path: tuple) -> torch.Tensor:
        producers[".".join(str(part) for part in leaf_path)] = leaf  # the key DCP flattens this path to
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")

    skeleton = map_tensors(state, placeholder)
    planner = _StreamingSavePlanner(producers, on_tensor)
    writer = FileSystemWriter(path, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0, overwrite=False)
    writer.fs = _DirectFileSystem()
    try:
        with _dcp_call():
            dcp.save(skeleton, storage_writer=writer, planner=planner, no_dist=True)
    finally:
        planner.release()
