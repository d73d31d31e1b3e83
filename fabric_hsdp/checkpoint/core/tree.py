"""The one walker over nested state (dicts, lists, tuples): :func:`map_tree` and :func:`tree_leaves`.

Leaves are the values of the types a caller names (tensors and lazy tensors by default; a save's
:class:`~fabric_hsdp.checkpoint.core.boxes.StoredBoxes`, DCP's metadata entries); everything else is kept as it is.
A leaf's path is the keys and indices that lead to it, e.g. ``("optimizer", "state", "w", "exp_avg")``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor

TENSORS = (torch.Tensor, LazyTensor)


def map_tree(obj: Any, fn: Callable[[Any, tuple], Any], leaves: type | tuple[type, ...] = TENSORS) -> Any:
    """Rebuild the dicts/lists/tuples of ``obj``, replacing each leaf (an instance of ``leaves``) by ``fn(leaf, path)``.

    Containers are new (a dict subclass stays that class; named tuples are kept whole, as values); leaves and other
    values are not copied.
    """

    def visit(node: Any, path: tuple) -> Any:
        if isinstance(node, leaves):
            return fn(node, path)
        if isinstance(node, dict):
            out = node.__class__() if type(node) is not dict else {}
            for key, value in node.items():
                out[key] = visit(value, (*path, key))
            return out
        if isinstance(node, list | tuple) and not hasattr(node, "_fields"):
            return type(node)(visit(value, (*path, i)) for i, value in enumerate(node))
        return node

    return visit(obj, ())


def tree_leaves(obj: Any, leaves: type | tuple[type, ...] = TENSORS) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` of every leaf (an instance of ``leaves``) in a nested structure, in traversal order."""
    found: list[tuple[tuple, Any]] = []
    map_tree(obj, lambda leaf, path: found.append((path, leaf)) or leaf, leaves)
    return found


def item_at(obj: Any, path: tuple) -> Any:
    """The value at ``path`` in a nested structure (``obj`` itself for ``()``)."""
    return functools.reduce(operator.getitem, path, obj)


def read_lazy(obj: Any) -> Any:
    """Replace every :class:`LazyTensor` in a nested structure by the tensor it reads."""
    return map_tree(obj, lambda leaf, _: leaf.read(), LazyTensor)


def nbytes(value: torch.Tensor | LazyTensor) -> int:
    """Bytes of a tensor's data (of a LazyTensor once read)."""
    return value.nbytes if isinstance(value, LazyTensor) else value.numel() * value.element_size()


def tree_nbytes(obj: Any) -> int:
    """Bytes of all tensors and LazyTensors in a nested structure."""
    return sum(nbytes(leaf) for _, leaf in tree_leaves(obj))
