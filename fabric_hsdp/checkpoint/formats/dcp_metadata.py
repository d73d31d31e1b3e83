"""A DCP directory's ``.metadata``, read safely, and the check that a directory is a whole checkpoint.

``.metadata`` is unpickled with an allow-list of DCP's own classes when ``weights_only=True`` (torch's
``FileSystemReader`` uses plain ``pickle.load``). The layout beside DCP's files: ``meta.pt`` holds the plain
(non-tensor, non-optimizer) values, as in Lightning's ``ModelParallelStrategy``.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from fabric_hsdp.checkpoint.core import commit
from fabric_hsdp.errors import CheckpointError, refused_pickle, unsafe_pickle_error
from fabric_hsdp.versions import dcp_storage_info, serialization_get_layout

META_FILE = "meta.pt"

_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): serialization_get_layout(),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_storage_info(),
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


def read_meta(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """The plain values in a DCP directory's ``meta.pt`` (``{}`` when it has none), unpickled like ``.metadata``.

    Raises:
        CheckpointError: ``meta.pt`` is truncated or damaged, holds no dict, or safe loading refuses its content.
    """
    file = path / META_FILE
    if not file.is_file():
        return {}
    try:
        meta = torch.load(file, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        raise refused_pickle(file, error) from None
    except (RuntimeError, EOFError) as error:
        raise CheckpointError(f"'{file}' is truncated or damaged ({error})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"'{file}' holds a {type(meta).__name__}, expected a dict of values")
    return meta


def check_complete(path: Path, *, weights_only: bool = True, metadata: Any = None) -> Any:
    """Raise ``FileNotFoundError``/``CheckpointError`` naming what is missing if ``path`` is not a whole DCP checkpoint.

    Args:
        metadata: its ``.metadata`` if the caller read it already (it is unpickled once per load).

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
    if metadata is None:
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
