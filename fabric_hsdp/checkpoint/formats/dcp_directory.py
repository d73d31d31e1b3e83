"""A DCP directory opened in a single process (no process group) as a :class:`CheckpointSource`.

Lightning's layout (``model.<name>`` tensors, optimizer entries, plain values in ``meta.pt``) or torch's flat
``torch_save_to_dcp`` output. Each tensor is read by ``dcp.load(..., no_dist=True)`` into a tensor of its full shape, so
DCP's planner does the chunk bookkeeping (a tensor saved by N ranks is N chunks), through the one-copy reader.
Opening checks that every data file ``.metadata`` names is there and long enough.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlanner

from fabric_hsdp.checkpoint.core.box import Box
from fabric_hsdp.checkpoint.core.dcp_errors import single_process_dcp
from fabric_hsdp.checkpoint.core.dcp_planners import SafeLoadPlanner
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.core.tree import map_tree
from fabric_hsdp.checkpoint.formats.dcp_metadata import check_complete, read_meta
from fabric_hsdp.checkpoint.formats.dcp_reader import OneCopyReader, read_dcp_box
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.checkpoint.formats.wrapped import find_model_tensors
from fabric_hsdp.versions import unflatten_state_dict


def _load(state_dict: dict[str, Any], reader: FileSystemReader, planner: LoadPlanner) -> None:
    with single_process_dcp():
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)


class DCPSource(CheckpointSource):
    """A DCP directory: Lightning's layout (``model.*`` tensors, optimizer entries, ``meta.pt``) or a flat one."""

    def __init__(self, path: Path, *, weights_only: bool) -> None:
        super().__init__(path, "dcp")
        self._weights_only = weights_only
        self.metadata = check_complete(path, weights_only=weights_only)
        entries = self.metadata.state_dict_metadata
        mapping = self.metadata.planner_data
        if not isinstance(mapping, dict) or set(mapping) != set(entries):
            mapping = {fqn: (fqn,) for fqn in entries}
        self._fqn_of_path = {tuple(path_): fqn for fqn, path_ in mapping.items()}
        skeleton = unflatten_state_dict(dict(entries), mapping)
        is_tensor = lambda value: isinstance(value, dcp_metadata.TensorStorageMetadata)  # noqa: E731
        model_key, model, self._extras_skeleton = find_model_tensors(skeleton, str(path), is_tensor)
        self.model_key = model_key
        self._fqns = {name: (f"{model_key}.{name}" if model_key else name) for name in model}
        for name, fqn in self._fqns.items():
            if fqn not in entries:  # a model key that itself needs the planner's mapping, e.g. nested dicts
                self._fqns[name] = self._fqn_of_path[(model_key, name) if model_key else (name,)]
        self._reader = OneCopyReader(path, self.metadata)
        self._extras_cache: dict[str, Any] | None = None

    def keys(self) -> list[str]:
        return list(self._fqns)

    def _info(self, name: str) -> TensorInfo:
        entry = self.metadata.state_dict_metadata[self._fqns[name]]
        return TensorInfo(name, entry.size, entry.properties.dtype)

    def _read_fqn(self, fqn: str, out: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.metadata.state_dict_metadata[fqn]
        target = torch.empty(entry.size, dtype=entry.properties.dtype) if out is None else out
        _load({fqn: target}, self._reader, DefaultLoadPlanner(flatten_state_dict=False))
        return target

    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        return self._read_fqn(self._fqns[name], out)

    def _read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        info = self._info(name)
        box = Box.of_index(index, info.shape, name)
        target = torch.empty(box.sizes, dtype=info.dtype)
        if target.numel():
            with single_process_dcp():
                read_dcp_box(self._reader, self._fqns[name], box.offsets, target)
        return target

    def chunks(self, name: str) -> list[Box]:
        """The box of each stored chunk of tensor ``name`` (one per saving rank that held a piece)."""
        self._check_name(name)
        entry = self.metadata.state_dict_metadata[self._fqns[name]]
        return [Box(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks]

    def _lazy_extras(self) -> dict[str, Any]:
        if self._extras_cache is not None:
            return self._extras_cache
        byte_fqns = [
            fqn
            for fqn, entry in self.metadata.state_dict_metadata.items()
            if isinstance(entry, dcp_metadata.BytesStorageMetadata)
        ]
        planner = SafeLoadPlanner(weights_only=self._weights_only, flatten_state_dict=False)
        if byte_fqns:
            _load(dict.fromkeys(byte_fqns), self._reader, planner)

        def convert(entry: Any, path: tuple) -> Any:
            fqn = self._fqn_of_path[path]
            if isinstance(entry, dcp_metadata.BytesStorageMetadata):
                return planner.loaded[fqn]
            load = functools.partial(self._read_fqn, fqn)
            return LazyTensor(fqn, entry.size, entry.properties.dtype, load, load)

        entries = (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata)
        extras = dict(map_tree(self._extras_skeleton, convert, entries))
        extras.update(read_meta(self.path, weights_only=self._weights_only))
        self._extras_cache = extras
        return extras

    def close(self) -> None:
        self._extras_cache = None


def storage_files(path: Path) -> list[tuple[str, int]]:
    """The ``.distcp`` data files of a DCP directory with their sizes, for ``inspect``."""
    return sorted((entry.name, entry.stat().st_size) for entry in os.scandir(path) if entry.name.endswith(".distcp"))
