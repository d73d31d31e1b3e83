"""Hugging Face directories with several weight files, as one :class:`CheckpointSource`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from fabric_hsdp.checkpoint.sources import CheckpointSource, TensorInfo


class ShardedDirectory(CheckpointSource):
    """A Hugging Face directory whose ``*.index.json`` maps each tensor to one of several shard files."""

    def __init__(self, path: Path, format: str, index_file: Path, open_shard: Callable[[Path], CheckpointSource]):
        super().__init__(path, format)
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"'{index_file}' is not a valid index file (needs a 'weight_map'): {error}") from None
        self._weight_map: dict[str, str] = dict(weight_map)
        missing = sorted({shard for shard in self._weight_map.values() if not (path / shard).is_file()})
        if missing:
            raise ValueError(
                f"'{index_file}' names {len(missing)} shard file(s) that are not in '{path}', e.g. '{missing[0]}'"
            )
        self._open_shard = open_shard
        self._shards: dict[str, CheckpointSource] = {}

    def _shard(self, name: str) -> CheckpointSource:
        shard_name = self._weight_map[name]
        if shard_name not in self._shards:
            self._shards[shard_name] = self._open_shard(self.path / shard_name)
        shard = self._shards[shard_name]
        if name not in shard:
            raise ValueError(f"'{self.path / shard_name}' has no tensor {name!r} although the index points there")
        return shard

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def _info(self, name: str) -> TensorInfo:
        return self._shard(name).tensor_info(name)

    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        return self._shard(name).read(name, out=out)

    def _read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._shard(name).read_slice(name, index)

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()
