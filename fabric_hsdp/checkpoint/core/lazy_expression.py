"""Lazy expressions: a tensor defined by stored tensors and the torch operations that combine them, read one box at
a time (:class:`LazyExpression`).

An expression is built by calling ``torch.stack``, ``torch.cat``, ``torch.chunk`` or ``torch.transpose`` on
expressions (their ``__torch_function__`` records the call instead of computing it), so code written for tensors (a
model family's checkpoint conversion rules, :mod:`fabric_hsdp.checkpoint.formats.conversions`) builds them
unchanged. :meth:`LazyExpression.read` of a box reads, from each stored tensor, only the part of it the box covers: a
range of stacked experts reads those experts, a box cutting through a concatenation the rows of each part it covers.
Any other torch function is refused with its name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fabric_hsdp.checkpoint.core.box import Box
from fabric_hsdp.errors import CheckpointError

if TYPE_CHECKING:
    from fabric_hsdp.checkpoint.formats.source import CheckpointSource

LAZY_TORCH_FUNCTIONS = ("torch.stack", "torch.cat", "torch.chunk", "torch.transpose")


class LazyExpression:
    """A tensor defined by stored tensors and the operations that combine them; :meth:`read` reads one box of it."""

    shape: torch.Size
    dtype: torch.dtype

    def read(self, box: Box) -> torch.Tensor:
        raise NotImplementedError

    def stored_names(self) -> list[str]:
        raise NotImplementedError

    def whole(self) -> Box:
        return Box((0,) * len(self.shape), tuple(self.shape))

    # what transformers' operations call besides torch functions: a lazily read tensor is a fresh, aligned copy
    def contiguous(self) -> LazyExpression:
        return self

    def clone(self) -> LazyExpression:
        return self

    def data_ptr(self) -> int:
        return 0

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def squeeze(self) -> LazyExpression:
        return _Squeezed(self)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            raise CheckpointError(
                f"the checkpoint's conversion applies torch.{getattr(func, '__name__', func)} to stored tensors, which"
                f" fabric-hsdp cannot read lazily per shard (it reads {', '.join(LAZY_TORCH_FUNCTIONS)}). Convert the"
                " checkpoint once with the model's own library (from_pretrained, then save with fabric.save)."
            )
        return handler(*args, **(kwargs or {}))


class StoredTensor(LazyExpression):
    """Tensor ``name`` of a checkpoint source, as it is stored."""

    def __init__(self, source: CheckpointSource, name: str) -> None:
        info = source.tensor_info(name)
        self.source, self.name, self.shape, self.dtype = source, name, info.shape, info.dtype

    def read(self, box: Box) -> torch.Tensor:
        if not self.shape:
            return self.source.read(self.name)
        return self.source.read_slice(self.name, box.slices())

    def stored_names(self) -> list[str]:
        return [self.name]


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _same_dtype(parts: Sequence[LazyExpression], what: str) -> torch.dtype:
    dtypes = {part.dtype for part in parts}
    if len(dtypes) != 1:
        raise CheckpointError(
            f"{what} of stored tensors {_names(parts)} of different dtypes {sorted(map(str, dtypes))}"
        )
    return parts[0].dtype


def _names(parts: Sequence[LazyExpression]) -> list[str]:
    return [name for part in parts for name in part.stored_names()][:4]


class _Stacked(LazyExpression):
    """``torch.stack(parts, dim)``: a box reads only the parts its range along ``dim`` covers."""

    def __init__(self, parts: Sequence[LazyExpression], dim: int) -> None:
        shapes = {tuple(part.shape) for part in parts}
        if len(shapes) != 1:
            raise CheckpointError(f"cannot stack stored tensors {_names(parts)} of shapes {sorted(shapes)}")
        self.parts, self.dim = list(parts), _dim(dim, len(parts[0].shape) + 1)
        inner = list(parts[0].shape)
        self.shape = torch.Size([*inner[: self.dim], len(parts), *inner[self.dim :]])
        self.dtype = _same_dtype(parts, "stack")

    def read(self, box: Box) -> torch.Tensor:
        start, size = box.offsets[self.dim], box.sizes[self.dim]
        inner = Box(_drop(box.offsets, self.dim), _drop(box.sizes, self.dim))
        if size == 0:
            return torch.empty(box.sizes, dtype=self.dtype)
        return torch.stack([self.parts[index].read(inner) for index in range(start, start + size)], self.dim)

    def stored_names(self) -> list[str]:
        return [name for part in self.parts for name in part.stored_names()]


class _Concatenated(LazyExpression):
    """``torch.cat(parts, dim)``: a box reads from each part only the rows of it that it covers."""

    def __init__(self, parts: Sequence[LazyExpression], dim: int) -> None:
        self.parts, self.dim = list(parts), _dim(dim, len(parts[0].shape))
        others = {tuple(_drop(part.shape, self.dim)) for part in parts}
        if len(others) != 1:
            raise CheckpointError(f"cannot concatenate stored tensors {_names(parts)} along dim {dim}")
        shape = list(parts[0].shape)
        shape[self.dim] = sum(part.shape[self.dim] for part in parts)
        self.shape, self.dtype = torch.Size(shape), _same_dtype(parts, "concatenation")

    def read(self, box: Box) -> torch.Tensor:
        low, high = box.offsets[self.dim], box.stops[self.dim]
        pieces, start = [], 0
        for part in self.parts:
            stop = start + part.shape[self.dim]
            begin, end = max(low, start), min(high, stop)
            if begin < end:
                pieces.append(part.read(_replace(box, self.dim, begin - start, end - begin)))
            start = stop
        return torch.cat(pieces, self.dim) if pieces else torch.empty(box.sizes, dtype=self.dtype)

    def stored_names(self) -> list[str]:
        return [name for part in self.parts for name in part.stored_names()]


class _Narrowed(LazyExpression):
    """``part`` narrowed to ``length`` rows from ``start`` along ``dim`` (one chunk of ``torch.chunk``)."""

    def __init__(self, part: LazyExpression, dim: int, start: int, length: int) -> None:
        self.part, self.dim, self.start = part, dim, start
        shape = list(part.shape)
        shape[dim] = length
        self.shape, self.dtype = torch.Size(shape), part.dtype

    def read(self, box: Box) -> torch.Tensor:
        return self.part.read(_replace(box, self.dim, self.start + box.offsets[self.dim], box.sizes[self.dim]))

    def stored_names(self) -> list[str]:
        return self.part.stored_names()


class _Transposed(LazyExpression):
    def __init__(self, part: LazyExpression, dim0: int, dim1: int) -> None:
        ndim = len(part.shape)
        self.part, self.dim0, self.dim1 = part, _dim(dim0, ndim), _dim(dim1, ndim)
        shape = list(part.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        self.shape, self.dtype = torch.Size(shape), part.dtype

    def read(self, box: Box) -> torch.Tensor:
        offsets, sizes = list(box.offsets), list(box.sizes)
        for values in (offsets, sizes):
            values[self.dim0], values[self.dim1] = values[self.dim1], values[self.dim0]
        return self.part.read(Box(tuple(offsets), tuple(sizes))).transpose(self.dim0, self.dim1).contiguous()

    def stored_names(self) -> list[str]:
        return self.part.stored_names()


class _Squeezed(LazyExpression):
    """``part`` without its dims of size 1 (``SplitModulelist`` squeezes each expert's slice)."""

    def __init__(self, part: LazyExpression) -> None:
        self.part, self.kept = part, [dim for dim, size in enumerate(part.shape) if size != 1]
        self.shape, self.dtype = torch.Size([part.shape[dim] for dim in self.kept]), part.dtype

    def read(self, box: Box) -> torch.Tensor:
        offsets, sizes = [0] * len(self.part.shape), [1] * len(self.part.shape)
        for position, dim in enumerate(self.kept):
            offsets[dim], sizes[dim] = box.offsets[position], box.sizes[position]
        return self.part.read(Box(tuple(offsets), tuple(sizes))).reshape(box.sizes)

    def stored_names(self) -> list[str]:
        return self.part.stored_names()


def _drop(values: Sequence[int], dim: int) -> tuple[int, ...]:
    return tuple(values[:dim]) + tuple(values[dim + 1 :])


def _replace(box: Box, dim: int, offset: int, size: int) -> Box:
    offsets, sizes = list(box.offsets), list(box.sizes)
    offsets[dim], sizes[dim] = offset, size
    return Box(tuple(offsets), tuple(sizes))


def _chunk(part: LazyExpression, chunks: int, dim: int = 0) -> tuple[LazyExpression, ...]:
    dim = _dim(dim, len(part.shape))
    size = part.shape[dim]
    step = -(-size // chunks)  # torch.chunk's sizes: all equal but the last
    return tuple(_Narrowed(part, dim, start, min(step, size - start)) for start in range(0, size, step))


_HANDLERS: dict[Any, Callable[..., Any]] = {
    torch.stack: lambda tensors, dim=0: _Stacked(tensors, dim),
    torch.cat: lambda tensors, dim=0: _Concatenated(tensors, dim),
    torch.concat: lambda tensors, dim=0: _Concatenated(tensors, dim),
    torch.chunk: _chunk,
    torch.transpose: lambda input, dim0, dim1: _Transposed(input, dim0, dim1),
}
