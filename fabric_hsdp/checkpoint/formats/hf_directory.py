"""Hugging Face directories whose ``*.index.json`` spreads the tensors over several files, as one source."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.errors import CheckpointError


class IndexedDirectory(CheckpointSource):
    """A Hugging Face directory whose ``*.index.json`` maps each tensor to one of several weight files."""

    def __init__(self, path: Path, format: str, index_file: Path, open_file: Callable[[Path], CheckpointSource]):
        super().__init__(path, format)
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"'{index_file}' is not a valid index file (needs a 'weight_map'): {error}") from None
        self._weight_map: dict[str, str] = dict(weight_map)
        missing = sorted({file for file in self._weight_map.values() if not (path / file).is_file()})
        if missing:
            raise CheckpointError(
                f"'{index_file}' names {len(missing)} weight file(s) that are not in '{path}', e.g. '{missing[0]}'"
            )
        self._open_file = open_file
        self._files: dict[str, CheckpointSource] = {}

    def _file(self, name: str) -> CheckpointSource:
        file_name = self._weight_map[name]
        if file_name not in self._files:
            self._files[file_name] = self._open_file(self.path / file_name)
        file = self._files[file_name]
        if name not in file:
            raise CheckpointError(f"'{self.path / file_name}' has no tensor {name!r} although the index points there")
        return file

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def _info(self, name: str) -> TensorInfo:
        return self._file(name).tensor_info(name)

    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        return self._file(name).read(name, out=out)

    def _read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._file(name).read_slice(name, index)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
