"""The interface every checkpoint format implements: a lazy source of named tensors, in the spirit of safetensors.

A :class:`CheckpointSource` has ``keys()``, ``tensor_info(name)`` (no data read), ``read(name)``, ``read_slice(name,
index)``, ``extras()`` and ``close()``; :func:`fabric_hsdp.checkpoint.formats.open_checkpoint` returns the right one
for a path. Tensors not read yet travel as :class:`LazyTensor`, which the writers read one at a time. This module
knows no format; the readers subclass :class:`CheckpointSource`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fabric_hsdp.checkpoint import fileio
from fabric_hsdp.errors import CheckpointError

ACCEPTED_FORMATS = (
    "a torch file (.pth/.pt/.bin/.ckpt holding a state dict or a Fabric/Lightning checkpoint), a .safetensors file,"
    " a Hugging Face directory (model.safetensors[.index.json] or pytorch_model.bin[.index.json]) or a DCP directory"
    " (with a .metadata file)"
)
MODEL_KEYS = ("model", "state_dict")


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


def _describe(value: Any) -> str:
    return f"a {type(value).__name__}"


def find_model_tensors(
    obj: Any, file_name: str, is_tensor: Callable[[Any], bool] = lambda v: isinstance(v, torch.Tensor)
) -> tuple[str | None, Mapping[str, Any], dict[str, Any]]:
    """Apply the raw-vs-wrapped rule (see :mod:`fabric_hsdp.checkpoint.formats`) to a loaded checkpoint object.

    Returns:
        ``(model_key, model_tensors, extras)``; ``model_key`` is ``None`` for a raw state dict.

    Raises:
        CheckpointError: if ``obj`` is neither a raw state dict nor a wrapped checkpoint.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"'{file_name}' holds {_describe(obj)}, not a state dict (a dict of tensors) or a checkpoint"
        )
    if not obj:
        raise CheckpointError(f"'{file_name}' holds an empty dict: there are no tensors in it")
    top_tensors = [key for key, value in obj.items() if is_tensor(value)]
    if top_tensors:
        others = [key for key, value in obj.items() if not is_tensor(value)]
        if not others:
            return None, obj, {}
        raise CheckpointError(
            f"'{file_name}' mixes tensors (e.g. {top_tensors[0]!r}) and other values (e.g. {others[0]!r}:"
            f" {_describe(obj[others[0]])}) at the top level: it is neither a state dict nor a checkpoint with a"
            " 'model' entry"
        )
    for model_key in MODEL_KEYS:
        model = obj.get(model_key)
        if isinstance(model, Mapping):
            not_tensors = [key for key, value in model.items() if not is_tensor(value)]
            if not_tensors:
                bad = not_tensors[0]
                raise CheckpointError(
                    f"'{file_name}' has a {model_key!r} entry, but {model_key}[{bad!r}] is {_describe(model[bad])},"
                    f" not a tensor ({len(not_tensors)} such entries); expected a flat dict of tensors"
                )
            return model_key, model, {key: value for key, value in obj.items() if key != model_key}
    keys = ", ".join(repr(key) for key in list(obj)[:8])
    raise CheckpointError(
        f"'{file_name}' holds a dict without tensors at the top level and without a 'model' or 'state_dict' dict"
        f" of tensors (top-level keys: {keys}); cannot tell which tensors are the model's"
    )


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
        box = fileio.normalize_index(index, info.shape, name)
        return self._read(name, None)[tuple(slice(start, stop) for start, stop in box)].clone()

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
