"""Reading ``torch.distributed.checkpoint`` (DCP) directories safely and with one copy, and DCP's errors.

Used by the training path (:mod:`fabric_hsdp.checkpoint.sharded`) and the offline reader
(:mod:`fabric_hsdp.checkpoint.dcp_directory`). Three things differ from torch's defaults:

* ``.metadata`` is unpickled with an allow-list of DCP's own classes when ``weights_only=True`` (torch's
  ``FileSystemReader`` uses plain ``pickle.load``), and non-tensor entries with ``torch.load(weights_only=...)``.
* :class:`OneCopyReader` copies a chunk's bytes straight into the target tensor with a positioned read. Torch's reader
  first ``torch.load``s the chunk into a temporary and then copies it, which doubles the memory of the largest tensor.
* DCP wraps any failure, ``KeyboardInterrupt`` and ``OSError`` included, in a ``CheckpointException`` (a
  ``BaseException``) holding each rank's exception; :func:`rank_failures` unpacks them for messages.

The layout beside DCP's files: ``meta.pt`` holds the plain (non-tensor, non-optimizer) values, as in Lightning's
``ModelParallelStrategy``.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pathlib
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from fabric_hsdp.checkpoint import commit, fileio, watchdog
from fabric_hsdp.checkpoint.boxes import lookup, stored_boxes_in
from fabric_hsdp.errors import CheckpointError, SaveError, unsafe_pickle_error

META_FILE = "meta.pt"

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
            raise unsafe_pickle_error(f"'{file}'", str(error)) from None
        raise CheckpointError(f"'{file}' is truncated or damaged ({error}); it is not DCP metadata") from None
    except (EOFError, AttributeError, ImportError, TypeError, ValueError) as error:
        raise CheckpointError(f"'{file}' is truncated or damaged ({error}); it is not DCP metadata") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"'{file}' is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


def check_complete(path: Path, *, weights_only: bool = True) -> Any:
    """Raise ``FileNotFoundError``/``CheckpointError`` naming what is missing if ``path`` is not a whole DCP checkpoint.

    Returns:
        Its DCP ``Metadata`` (read to check the shards against it).
    """
    if not path.exists():
        hint = ""
        parked = commit.parked_copies(path)
        if parked:
            hint = f" A save was interrupted while swapping; the previous checkpoint is intact at '{parked[-1]}'."
        raise FileNotFoundError(f"checkpoint '{path}' does not exist.{hint}")
    metadata_file = path / ".metadata"
    if not metadata_file.is_file():
        shards = sorted(p.name for p in path.glob("*.distcp"))
        raise CheckpointError(
            f"checkpoint '{path}' is incomplete: it has no DCP '.metadata' file"
            + (f" (but {len(shards)} shard file(s), e.g. '{shards[0]}')" if shards else "")
            + ". It was not written by a finished save; load the previous checkpoint instead."
        )
    metadata = read_metadata(path, weights_only=weights_only)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"'{name}' is missing")
        elif file.stat().st_size < size:
            problems.append(f"'{name}' is truncated ({file.stat().st_size} of {size} bytes)")
    if problems:
        more = f"; {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint '{path}' is incomplete: {', '.join(problems[:5])}{more}. Its shards do not match its"
            " '.metadata'; load the previous checkpoint instead."
        )
    return metadata


def top_level_keys(metadata: dcp_metadata.Metadata) -> set[str]:
    """The top-level keys of the state dict a DCP checkpoint was saved from (``model``, ``optimizer``, ...)."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {mapping[fqn][0] if fqn in mapping else fqn.split(".")[0] for fqn in metadata.state_dict_metadata}


class OneCopyReader(FileSystemReader):
    """A ``FileSystemReader`` that reads plain tensor chunks straight into their targets (one copy, not two)."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata
        self.set_up_storage_reader(metadata, is_coordinator=True)  # read_box reads without a dcp.load around it

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
        info: _StorageInfo = self.storage_data[item.storage_index]
        # Each chunk is a small torch.save archive; its meta-load gives the layout and where the bytes start.
        size = os.fstat(stream.fileno()).st_size
        try:
            if info.offset + info.length > size:
                raise RuntimeError(f"the file has {size} bytes")
            view = _create_file_view(stream, info.offset, info.length)
            stored = torch.load(view, map_location="meta", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
            raise CheckpointError(
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
                fileio.readinto(fd, target, base + first * stored.element_size(), file_name=file_name)
            else:  # another box, device or dtype: through a CPU buffer of the box
                box = tuple(slice(offset, offset + length) for offset, length in zip(offsets, lengths))
                fqn = item.storage_index.fqn
                target.copy_(fileio.read_box(fd, base, shape, stored.dtype, box, name=fqn, file_name=file_name))
        else:
            nbytes = stored.untyped_storage().nbytes()
            raw = fileio.read_tensor(fd, start, [nbytes], torch.uint8, file_name=file_name)
            chunk = raw.view(stored.dtype).as_strided(stored.shape, stored.stride(), stored.storage_offset())
            target.copy_(narrow(chunk, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)


def narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The view of ``tensor`` at ``offsets`` (one per dim) with ``lengths``."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class _BoxPlanner(DefaultLoadPlanner):
    """Resolves each read of :func:`read_box` to the part of the caller's box tensor it fills."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self._target = target

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return narrow(self._target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read_box(reader: OneCopyReader, fqn: str, offsets: list[int], target: torch.Tensor) -> torch.Tensor:
    """Fill ``target`` with the box of tensor ``fqn`` that starts at ``offsets`` (and has ``target``'s shape).

    Only the stored chunks the box overlaps are read, and of each only the overlap (DCP's own resharding arithmetic,
    ``create_read_items_for_chunk_list``), so a rank reads exactly the elements it holds.
    """
    entry = reader.read_metadata().state_dict_metadata[fqn]
    wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=target.shape)
    items = create_read_items_for_chunk_list(fqn, entry, [wanted])
    reader.read_data(LoadPlan(items), _BoxPlanner(target)).wait()
    return target


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also writes the boxes of :class:`~fabric_hsdp.checkpoint.boxes.StoredBoxes`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return lookup(self.state_dict, index)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, unpickling non-tensor entries with ``torch.load(weights_only=...)``.

    Torch's planner always unpickles them with ``weights_only=False``; optimizer ``param_groups`` (numbers, bools,
    tuples) load fine with the safe loader. Every value read is also kept in ``loaded`` by its DCP key (``dcp.load``
    hands the planner a copy of the top level of the state dict). It also fills the boxes of
    :class:`~fabric_hsdp.checkpoint.boxes.StoredBoxes`.
    """

    def __init__(self, *, weights_only: bool, allow_partial_load: bool = False, flatten_state_dict: bool = True):
        super().__init__(flatten_state_dict=flatten_state_dict, allow_partial_load=allow_partial_load)
        self._weights_only = weights_only
        self.loaded: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up initialises meta tensors in place and replaces every leaf of a type it does not know with None:
        # put the StoredBoxes back, then flatten again.
        kept = stored_boxes_in(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if kept:
            for container, key, value in kept:
                container[key] = value
            if self.flatten_state_dict:
                self.state_dict, self.mappings = flatten_state_dict(self.original_state_dict)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=self._weights_only)
        except pickle.UnpicklingError as error:
            raise unsafe_pickle_error(f"checkpoint entry {fqn!r}", str(error).splitlines()[0]) from None
        self.loaded[fqn] = loaded
        set_element(self.original_state_dict, self.mappings.get(fqn, (fqn,)), loaded)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return lookup(self.state_dict, index)


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """Run a single-process DCP call: silence its no-process-group warning, re-raise the error it wrapped.

    DCP wraps any failure, ``KeyboardInterrupt`` and ``OSError`` included, in a ``CheckpointException`` (a
    ``BaseException``); callers need the original to report it. An interrupt that landed inside torch's zip writer
    surfaces as the writer's clean-up error (``enforce fail ... unexpected pos``) with the ``KeyboardInterrupt`` as its
    context: it is re-raised as the interrupt it was.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            yield
        except CheckpointException as error:
            failure = first_failure(error)
            if interrupted(failure):
                raise KeyboardInterrupt from None
            raise failure from None


def interrupted(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised while handling, a ``KeyboardInterrupt``."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def rank_failures(error: BaseException) -> dict[int, BaseException]:
    """The exceptions DCP wrapped in ``error``, by rank (it records each as ``(exception, traceback)``)."""
    failures = getattr(error, "failures", None) or {}
    return {rank: failure[0] if isinstance(failure, tuple) else failure for rank, failure in failures.items()}


def first_failure(error: CheckpointException) -> BaseException:
    """The first exception DCP wrapped in ``error``; ``error`` itself if it wrapped none."""
    return next(iter(rank_failures(error).values()), error)


def save_error(error: BaseException, path: Path) -> SaveError:
    """The error for a failed DCP save, naming each failed rank and its exception (DCP wraps them per rank)."""
    causes = rank_failures(error)
    details = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(causes.items()))
    if not details:
        details = f"{type(error).__name__}: {error}"
    return SaveError(
        f"saving checkpoint '{path}' failed ({details}). Nothing was written at '{path}'; the previous checkpoint"
        " there, if any, is intact."
    )
