"""Torch files (``torch.save`` zip archives and legacy pickles) as a :class:`CheckpointSource`.

A zip archive is opened with ``torch.load(map_location="meta")``: that unpickles only ``data.pkl`` (the structure,
no tensor data) and tags each storage with its byte offset in the file. Tensors are then read with positioned reads
at those offsets, one at a time, so memory stays at the tensor being read.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fabric_hsdp.checkpoint.core import fileio
from fabric_hsdp.checkpoint.core.box import Box
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.core.tree import map_tree
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.checkpoint.formats.wrapped import find_model_tensors
from fabric_hsdp.errors import CheckpointError, first_line, refused_pickle
from fabric_hsdp.logs import warning_on_rank_zero
from fabric_hsdp.versions import checkpoint_offset, load_on_meta, stored_bytes, torch_file_reader, zip_record_sizes

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Stored:
    """Where a tensor's storage lies in the file and how the tensor views it."""

    storage_start: int
    storage_bytes: int
    info: TensorInfo
    stride: tuple[int, ...]
    storage_offset: int
    contiguous: bool


class TorchFileSource(CheckpointSource):
    """A torch file holding a raw state dict (``format="torch"``) or a Fabric/Lightning checkpoint (``"fabric"``).

    Args:
        path: the file.
        weights_only: unpickle with torch's safe loader.
        format: report this format instead (``"hf-bin"`` for Hugging Face ``pytorch_model*.bin`` shards).
        legacy: the file is a pre-zip pickle; it is loaded whole (it cannot be read piecewise).
    """

    def __init__(self, path: Path, *, weights_only: bool, format: str | None = None, legacy: bool = False) -> None:
        self._file = str(path)
        self._fd = -1
        self._byteswap = False
        obj = self._load_legacy(weights_only) if legacy else self._load_zip(weights_only)
        self.model_key, model, extras = find_model_tensors(obj, self._file)
        super().__init__(path, format or ("fabric" if self.model_key else "torch"))
        self._legacy = legacy
        if legacy:
            self._tensors: dict[str, torch.Tensor] = dict(model)
            self._stored: dict[str, _Stored] = {}
            self._extras = extras
        else:
            self._stored = {name: self._locate(name, tensor) for name, tensor in model.items()}
            self._extras = map_tree(extras, self._lazy_leaf)

    def _load_zip(self, weights_only: bool) -> Any:
        try:
            reader = torch_file_reader(self._file)
        except RuntimeError as error:
            raise CheckpointError(
                f"'{self._file}' is a truncated or damaged torch file ({first_line(error)}). Re-copy or re-save it."
            ) from None
        records = reader.get_all_records()
        if "constants.pkl" in records:
            raise CheckpointError(
                f"'{self._file}' is a TorchScript archive, not a checkpoint: load it with torch.jit.load and"
                " save its state_dict() with torch.save"
            )
        if "data.pkl" not in records:
            raise CheckpointError(f"'{self._file}' is a zip file but not a torch checkpoint (it has no data.pkl)")
        if reader.has_record("byteorder"):
            self._byteswap = reader.get_record("byteorder").decode() != sys.byteorder
        # (offset, size) of every storage record, to check the offsets torch reports against the archive itself.
        sizes = zip_record_sizes(self._file)
        self._records = {reader.get_record_offset(name): sizes[name] for name in records if name.startswith("data/")}
        try:
            obj = load_on_meta(self._file, weights_only=weights_only)
        except pickle.UnpicklingError as error:
            if "Weights only load failed" in str(error):
                raise refused_pickle(self._file, error) from None
            raise CheckpointError(f"'{self._file}' has a damaged pickle ({first_line(error)})") from None
        except (RuntimeError, EOFError, ValueError, AttributeError, ImportError) as error:
            raise CheckpointError(f"'{self._file}' could not be read as a torch file ({first_line(error)})") from None
        self._fd = os.open(self._file, os.O_RDONLY)
        return obj

    def _load_legacy(self, weights_only: bool) -> Any:
        warning_on_rank_zero(
            _logger,
            "'%s' is a legacy (non-zip) torch file: reading it loads the whole file into memory. Re-save it with"
            " torch.save to read it tensor by tensor.",
            self._file,
        )
        try:
            return torch.load(self._file, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as error:
            if "Weights only load failed" in str(error):
                raise refused_pickle(self._file, error) from None
            raise CheckpointError(f"'{self._file}' is not a readable torch pickle ({first_line(error)})") from None
        except (RuntimeError, EOFError, ValueError, AttributeError, ImportError) as error:
            raise CheckpointError(f"'{self._file}' is not a readable torch pickle ({first_line(error)})") from None

    def _locate(self, name: str, tensor: torch.Tensor) -> _Stored:
        start = checkpoint_offset(tensor.untyped_storage())
        if start is None or self._records.get(start) != stored_bytes(tensor):
            raise CheckpointError(
                f"'{self._file}': cannot locate the data of tensor {name!r} in the archive (unusual record layout);"
                " re-save the checkpoint with torch.save"
            )
        return _Stored(
            storage_start=start,
            storage_bytes=stored_bytes(tensor),
            info=TensorInfo(name, tensor.shape, tensor.dtype),
            stride=tuple(tensor.stride()),
            storage_offset=tensor.storage_offset(),
            contiguous=tensor.is_contiguous(),
        )

    def _lazy_leaf(self, leaf: Any, path: tuple) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type != "meta":
            return leaf
        name = ".".join(str(part) for part in path)
        stored = self._locate(name, leaf)
        load = functools.partial(self._read_stored, stored)
        return LazyTensor(name, leaf.shape, leaf.dtype, load, load)

    def _read_stored(self, stored: _Stored, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._fd < 0:
            raise CheckpointError(f"checkpoint '{self._file}' is closed")
        info = stored.info
        if stored.contiguous:
            start = stored.storage_start + stored.storage_offset * info.dtype.itemsize
            tensor = fileio.read_tensor(self._fd, start, info.shape, info.dtype, file_name=self._file, out=out)
            if self._byteswap:
                tensor.untyped_storage().byteswap(info.dtype)
            return tensor
        raw = fileio.read_tensor(
            self._fd, stored.storage_start, [stored.storage_bytes], torch.uint8, file_name=self._file
        )
        if self._byteswap:
            raw.untyped_storage().byteswap(info.dtype)
        strided = raw.view(info.dtype).as_strided(info.shape, stored.stride, stored.storage_offset)
        return strided.clone(memory_format=torch.contiguous_format) if out is None else out.copy_(strided)

    def keys(self) -> list[str]:
        return list(self._tensors if self._legacy else self._stored)

    def _info(self, name: str) -> TensorInfo:
        if self._legacy:
            tensor = self._tensors[name]
            return TensorInfo(name, tensor.shape, tensor.dtype)
        return self._stored[name].info

    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        if self._legacy:
            return self._tensors[name].clone() if out is None else out.copy_(self._tensors[name])
        return self._read_stored(self._stored[name], out)

    def _read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if self._legacy:  # already in memory: copy just the box, not the whole tensor and then the box
            return self._tensors[name][Box.of_index(index, self._tensors[name].shape, name).slices()].clone()
        stored = self._stored.get(name)
        if stored is None or not stored.contiguous or self._byteswap:
            return super()._read_slice(name, index)
        info = stored.info
        start = stored.storage_start + stored.storage_offset * info.dtype.itemsize
        box = Box.of_index(index, info.shape, name)
        return fileio.read_box(self._fd, start, info.shape, info.dtype, box, file_name=self._file)

    def _lazy_extras(self) -> dict[str, Any]:
        return self._extras

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
