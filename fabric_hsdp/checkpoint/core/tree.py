"""Walking nested state (dicts, lists, tuples) whose leaves are tensors or lazy tensors (:class:`LazyTensor`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor


def map_tensors(obj: Any, fn: Callable[[Any, tuple], Any], path: tuple = ()) -> Any:
    """Rebuild nested dicts/lists/tuples of ``obj``, replacing each tensor or LazyTensor leaf by ``fn(leaf, path)``."""
    if isinstance(obj, torch.Tensor | LazyTensor):
        return fn(obj, path)
    if isinstance(obj, dict):
        out = obj.__class__() if type(obj) is not dict else {}
        for key, value in obj.items():
            out[key] = map_tensors(value, fn, (*path, key))
        return out
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(map_tensors(value, fn, (*path, i)) for i, value in enumerate(obj))
    return obj


def read_lazy(obj: Any) -> Any:
    """Replace every :class:`LazyTensor` in a nested structure by the tensor it reads."""
    return map_tensors(obj, lambda leaf, _: leaf.read() if isinstance(leaf, LazyTensor) else leaf)


def tensor_leaves(obj: Any) -> list[tuple[tuple, torch.Tensor | LazyTensor]]:
    """``(path, leaf)`` of every tensor or LazyTensor in a nested structure, in traversal order."""
    leaves: list[tuple[tuple, Any]] = []
    map_tensors(obj, lambda leaf, path: leaves.append((path, leaf)) or leaf)
    return leaves


def nbytes(value: torch.Tensor | LazyTensor) -> int:
    """Bytes of a tensor's data (of a LazyTensor once read)."""
    return value.nbytes if isinstance(value, LazyTensor) else value.numel() * value.element_size()


def tree_nbytes(obj: Any) -> int:
    """Bytes of all tensors and LazyTensors in a nested structure."""
    return sum(nbytes(leaf) for _, leaf in tensor_leaves(obj))
