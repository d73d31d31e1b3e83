"""Open any checkpoint as a lazy source of named tensors, in the spirit of safetensors' ``safe_open``.

``open_checkpoint(path)`` detects the format from the content (not the file name) and returns a
:class:`CheckpointSource`: ``keys()``, ``tensor_info(name)`` (no data read), ``read(name)``, ``read_slice(name,
index)``, ``extras()`` and ``close()``. Accepted:

* ``"torch"``: a torch zip file (``torch.save``, any name) or a legacy non-zip pickle holding a raw state dict, e.g.
  litgpt's ``lit_model.pth``.
* ``"fabric"``: a torch file holding a Fabric/Lightning full checkpoint, ``{"model": {...}, "optimizer": ...,
  "step": 3}`` or PyTorch Lightning's ``{"state_dict": {...}, ...}``.
* ``"safetensors"``: one ``.safetensors`` file.
* ``"hf-safetensors"`` / ``"hf-bin"``: a Hugging Face directory with ``model.safetensors.index.json``,
  ``model.safetensors``, ``pytorch_model.bin.index.json`` or ``pytorch_model.bin``.
* ``"dcp"``: a ``torch.distributed.checkpoint`` directory (has ``.metadata``): Lightning's layout (``model.<name>``
  and ``optimizer.*`` keys, plain values in ``meta.pt``) or torch's flat ``torch_save_to_dcp`` output.

Raw or wrapped is decided from the content, the same way for torch files and DCP directories (for DCP on the
nesting recorded in its metadata):

* a dict whose values are all tensors is a **raw** state dict: every entry is a model tensor;
* a dict with no tensor at the top level whose ``"model"`` (else ``"state_dict"``) value is a dict of tensors is
  **wrapped**: that dict holds the model tensors (keys without the ``model.`` prefix), everything else is
  ``extras()`` (optimizer state, step, ...);
* anything else is an error that names the file and what it holds.

Tensors are always read to CPU, whatever device they were saved from. Torch and safetensors files are read with
positioned reads at offsets taken from their headers, into a fresh tensor or one given with ``out=``, so a
conversion holds about one tensor in memory (an mmap would keep every page it touched resident). ``read_slice``
reads only the requested rows there; for DCP it reads the whole tensor and slices it. ``weights_only=True`` (the
default) unpickles with torch's safe loader; ``weights_only=False`` is an explicit opt-in for trusted files and
logs a warning.
"""

from __future__ import annotations

import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fabric_hsdp.checkpoint import _io

_logger = logging.getLogger("fabric_hsdp")

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
    """A stored tensor that is read only when :meth:`materialize` is called (a leaf of ``extras(lazy=True)``).

    Writers accept these wherever they accept tensors and materialise one at a time, which keeps memory bounded.

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
        """Size in bytes once materialised."""
        return math.prod(self.shape) * self.dtype.itemsize

    def materialize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read the tensor into ``out`` (a contiguous CPU tensor of this shape and dtype), else into a new one."""
        if out is None:
            tensor = self._load()
        else:
            check_out(out, self.name, self.shape, self.dtype)
            tensor = self._load_into(out) if self._load_into is not None else out.copy_(self._load())
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"tensor '{self.name}' was announced as {list(self.shape)} {self.dtype} but reads as"
                f" {list(tensor.shape)} {tensor.dtype}"
            )
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


def check_out(out: torch.Tensor, name: str, shape: torch.Size, dtype: torch.dtype) -> None:
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


def materialize(obj: Any) -> Any:
    """Replace every :class:`LazyTensor` in a nested structure by the tensor it reads."""
    return map_tensors(obj, lambda leaf, _: leaf.materialize() if isinstance(leaf, LazyTensor) else leaf)


def _describe(value: Any) -> str:
    return f"a {type(value).__name__}"


def split_layout(
    obj: Any, file_name: str, is_tensor: Callable[[Any], bool] = lambda v: isinstance(v, torch.Tensor)
) -> tuple[str | None, Mapping[str, Any], dict[str, Any]]:
    """Apply the raw-vs-wrapped rule (module docstring) to a loaded checkpoint object.

    Returns:
        ``(model_key, model_tensors, extras)``; ``model_key`` is ``None`` for a raw state dict.

    Raises:
        ValueError: if ``obj`` is neither a raw state dict nor a wrapped checkpoint.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"'{file_name}' holds {_describe(obj)}, not a state dict (a dict of tensors) or a checkpoint")
    if not obj:
        raise ValueError(f"'{file_name}' holds an empty dict: there are no tensors in it")
    top_tensors = [key for key, value in obj.items() if is_tensor(value)]
    if top_tensors:
        others = [key for key, value in obj.items() if not is_tensor(value)]
        if not others:
            return None, obj, {}
        raise ValueError(
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
                raise ValueError(
                    f"'{file_name}' has a {model_key!r} entry, but {model_key}[{bad!r}] is {_describe(model[bad])},"
                    f" not a tensor ({len(not_tensors)} such entries); expected a flat dict of tensors"
                )
            return model_key, model, {key: value for key, value in obj.items() if key != model_key}
    keys = ", ".join(repr(key) for key in list(obj)[:8])
    raise ValueError(
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
        box = _io.normalize_index(index, info.shape, name)
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
            check_out(out, name, info.shape, info.dtype)
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
        return tree if lazy else materialize(tree)

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
            raise ValueError(
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


def _open_file(path: Path, weights_only: bool, format: str | None = None) -> CheckpointSource:
    from fabric_hsdp.checkpoint._safetensors import SafetensorsFile, looks_like_safetensors
    from fabric_hsdp.checkpoint._torch_file import TorchFileSource

    with open(path, "rb") as file:
        head = file.read(16)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"'{path}' is empty (0 bytes), not a checkpoint")
    if head.startswith(b"PK\x03\x04"):
        return TorchFileSource(path, weights_only=weights_only, format=format)
    if looks_like_safetensors(head, size):
        return SafetensorsFile(path, format=format or "safetensors")
    if head[:1] == b"\x80":  # pickle protocol opcode: torch's legacy (pre-1.6) format
        return TorchFileSource(path, weights_only=weights_only, format=format, legacy=True)
    raise ValueError(f"'{path}' is not a checkpoint (unrecognised content). Accepted: {ACCEPTED_FORMATS}")


def _open_directory(path: Path, weights_only: bool) -> CheckpointSource:
    from fabric_hsdp.checkpoint._hf import ShardedDirectory
    from fabric_hsdp.checkpoint._safetensors import SafetensorsFile

    if (path / ".metadata").is_file():
        from fabric_hsdp.checkpoint._dcp import DCPSource

        return DCPSource(path, weights_only=weights_only)
    if (path / "model.safetensors.index.json").is_file():
        return ShardedDirectory(
            path, "hf-safetensors", path / "model.safetensors.index.json", lambda f: SafetensorsFile(f)
        )
    if (path / "model.safetensors").is_file():
        source = _open_file(path / "model.safetensors", weights_only, format="hf-safetensors")
        source.path = path
        return source
    if (path / "pytorch_model.bin.index.json").is_file():
        return ShardedDirectory(
            path, "hf-bin", path / "pytorch_model.bin.index.json", lambda f: _open_file(f, weights_only, "hf-bin")
        )
    if (path / "pytorch_model.bin").is_file():
        source = _open_file(path / "pytorch_model.bin", weights_only, format="hf-bin")
        source.path = path
        return source
    entries = sorted(entry.name for entry in path.iterdir())
    found = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "") or "nothing"
    raise ValueError(f"directory '{path}' is not a checkpoint (it holds {found}). Accepted: {ACCEPTED_FORMATS}")


def open_checkpoint(path: str | os.PathLike, *, weights_only: bool = True) -> CheckpointSource:
    """Open a checkpoint file or directory as a lazy source of named tensors; usable as a context manager.

    Args:
        path: a torch file, a ``.safetensors`` file, a Hugging Face directory or a DCP directory (see module doc).
        weights_only: unpickle with torch's safe loader. ``False`` runs arbitrary code from the file: only for
            checkpoints you trust.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a checkpoint, is truncated or damaged, or holds an unsupported layout.

    Example::

        with open_checkpoint("lit_model.pth") as source:
            for name in source.keys():
                tensor = source.read(name)
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    if not weights_only:
        _logger.warning(
            "Opening '%s' with weights_only=False: unpickling can run arbitrary code. Only do this for checkpoints"
            " you trust.",
            path,
        )
    if path.is_dir():
        return _open_directory(path, weights_only)
    return _open_file(path, weights_only)
