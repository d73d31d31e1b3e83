"""A stored tensor read only when asked (:class:`LazyTensor`): what sources hand out and writers stream from."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fabric_hsdp.errors import CheckpointError


class LazyTensor:
    """A stored tensor that is read only when :meth:`read` is called (a leaf of ``extras(lazy=True)``).

    Writers accept these wherever they accept tensors and read one at a time, which keeps memory bounded.

    Args:
        name: for messages.
        shape: the tensor's shape.
        dtype: the tensor's dtype.
        load: reads the tensor into a new CPU tensor.
        load_into: reads it into a given contiguous CPU tensor (optional; else ``out.copy_(load())``).
    """

    __slots__ = ("name", "shape", "dtype", "_load", "_load_into")

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        dtype: torch.dtype,
        load: Callable[[], torch.Tensor],
        load_into: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.name = name
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._load = load
        self._load_into = load_into

    @property
    def nbytes(self) -> int:
        """Size in bytes once read."""
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read the tensor into ``out`` (a contiguous CPU tensor of this shape and dtype), else into a new one."""
        if out is None:
            tensor = self._load()
        else:
            check_out_tensor(out, self.name, self.shape, self.dtype)
            tensor = self._load_into(out) if self._load_into is not None else out.copy_(self._load())
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            raise CheckpointError(
                f"tensor '{self.name}' was announced as {list(self.shape)} {self.dtype} but reads as"
                f" {list(tensor.shape)} {tensor.dtype}"
            )
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


def check_out_tensor(out: torch.Tensor, name: str, shape: torch.Size, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless ``out`` can receive tensor ``name``: contiguous, on CPU, same shape and dtype."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.shape != shape or out.dtype != dtype:
        raise ValueError(
            f"out= for tensor {name!r} must be a contiguous CPU tensor of shape {list(shape)} and dtype {dtype}, got"
            f" {list(out.shape)} {out.dtype} on {out.device}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
