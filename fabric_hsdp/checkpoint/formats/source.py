"""The interface every checkpoint format implements: a lazy source of named tensors, in the spirit of safetensors.

A :class:`CheckpointSource` has ``keys()``, ``tensor_info(name)`` (no data read), ``read(name)``, ``read_slice(name,
index)``, ``extras()`` and ``close()``; :func:`~fabric_hsdp.checkpoint.formats.detect.open_checkpoint` returns the
right one for a path. Tensors not read yet travel as :class:`LazyTensor`, which the writers read one at a time.
This module knows no format; the readers subclass :class:`CheckpointSource`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fabric_hsdp.checkpoint.core.box import Box
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor, check_out_tensor
from fabric_hsdp.checkpoint.core.tree import read_lazy
from fabric_hsdp.errors import CheckpointError

ACCEPTED_FORMATS = (
    "a torch file (.pth/.pt/.bin/.ckpt holding a state dict or a Fabric/Lightning checkpoint), a .safetensors file,"
    " a Hugging Face directory (model.safetensors[.index.json] or pytorch_model.bin[.index.json]) or a DCP directory"
    " (with a .metadata file)"
)


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape, dtype and size of a stored tensor, known without reading its data."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


class CheckpointSource(ABC):
    """A checkpoint opened for reading: named model tensors read on demand, plus the checkpoint's extras.

    Attributes:
        format: ``"torch"``, ``"fabric"``, ``"safetensors"``, ``"hf-safetensors"``, ``"hf-bin"`` or ``"dcp"``.
        path: the file or directory that was opened.
    """

    def __init__(self, path: Path, format: str) -> None:
        self.path = Path(path)
        self.format = format
        self._key_set: set[str] | None = None

    @abstractmethod
    def keys(self) -> list[str]:
        """Names of the model tensors, in checkpoint order (``model.`` prefix removed for wrapped layouts)."""

    @abstractmethod
    def _info(self, name: str) -> TensorInfo: ...

    @abstractmethod
    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor: ...

    def _read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        info = self._info(name)
        return self._read(name, None)[Box.of_index(index, info.shape, name).slices()].clone()

    def _lazy_extras(self) -> dict[str, Any]:
        return {}

    def tensor_info(self, name: str) -> TensorInfo:
        """Shape, dtype and size of model tensor ``name``, without reading its data."""
        self._check_name(name)
        return self._info(name)

    def read(self, name: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read model tensor ``name`` into a new CPU tensor owned by the caller, or into ``out``.

        Args:
            name: one of :meth:`keys`.
            out: a contiguous CPU tensor of the tensor's shape and dtype to read into (e.g. a reused buffer).

        Returns:
            The tensor read (``out`` when given).
        """
        self._check_name(name)
        if out is not None:
            info = self._info(name)
            check_out_tensor(out, name, info.shape, info.dtype)
        return self._read(name, out)

    def read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Read the box ``index`` (one unit-step slice per leading dim) of tensor ``name`` into a new CPU tensor."""
        self._check_name(name)
        return self._read_slice(name, index)

    def extras(self, *, lazy: bool = False) -> dict[str, Any]:
        """Everything of a wrapped checkpoint that is not the model: optimizer state, step, ... (``{}`` when raw).

        Args:
            lazy: leave stored tensors as :class:`LazyTensor` leaves instead of reading them now.
        """
        tree = self._lazy_extras()
        return tree if lazy else read_lazy(tree)

    def lazy_tensors(self) -> dict[str, LazyTensor]:
        """All model tensors as :class:`LazyTensor`, in checkpoint order: what the writers stream from."""
        out = {}
        for name in self.keys():
            info = self._info(name)
            out[name] = LazyTensor(
                name,
                info.shape,
                info.dtype,
                lambda name=name: self._read(name, None),
                lambda target, name=name: self._read(name, target),
            )
        return out

    def close(self) -> None:  # noqa: B027 (a no-op default: sources without open files have nothing to release)
        """Release open files. Reading after ``close()`` is an error."""

    def _check_name(self, name: str) -> None:
        if self._key_set is None:
            self._key_set = set(self.keys())
        if name not in self._key_set:
            keys = self.keys()
            sample = ", ".join(repr(key) for key in keys[:5])
            raise CheckpointError(
                f"checkpoint '{self.path}' has no tensor {name!r}; it has {len(keys)} tensors"
                + (f", e.g. {sample}" if keys else "")
            )

    def __contains__(self, name: object) -> bool:
        if self._key_set is None:
            self._key_set = set(self.keys())
        return name in self._key_set

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(format={self.format!r}, path='{self.path}', tensors={len(self.keys())})"
