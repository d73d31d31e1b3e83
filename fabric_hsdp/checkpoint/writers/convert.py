"""Offline, streaming checkpoint conversion and inspection (single process, no process group).

``convert_checkpoint`` reads any format :func:`~fabric_hsdp.checkpoint.formats.detect.open_checkpoint` accepts and
writes DCP, a torch file or safetensors, one tensor at a time. ``inspect_checkpoint`` describes a checkpoint from its
metadata alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fabric_hsdp.checkpoint.core.commit import check_destination
from fabric_hsdp.checkpoint.core.keys import KeyMapSpec, apply_key_map
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.core.progress import Progress
from fabric_hsdp.checkpoint.core.tree import tree_leaves, tree_nbytes
from fabric_hsdp.checkpoint.formats.conversions import hub_layout_for_config
from fabric_hsdp.checkpoint.formats.dcp_directory import storage_files
from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
from fabric_hsdp.checkpoint.formats.source import TensorInfo
from fabric_hsdp.checkpoint.writers.config_check import fused_experts, refuse_config_that_does_not_fit
from fabric_hsdp.checkpoint.writers.dcp_writer import write_dcp
from fabric_hsdp.checkpoint.writers.full_files import write_safetensors, write_torch_file
from fabric_hsdp.units import format_binary_bytes, parse_bytes

_logger = logging.getLogger(__name__)

OUTPUT_FORMATS = ("dcp", "torch", "safetensors")
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
# Files of a Hugging Face directory that are not weights and travel with them (config, tokenizer, ...).
_SIDECAR_MAX_BYTES = 64 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".index.json")


@dataclass(frozen=True)
class ConvertSummary:
    """What :func:`convert_checkpoint` wrote."""

    tensors: int
    bytes: int
    seconds: float
    source_format: str
    dest_format: str
    dest: Path
    with_extras: bool

    def __str__(self) -> str:
        rate = self.bytes / self.seconds if self.seconds > 0 else 0.0
        extras = " with optimizer/extras" if self.with_extras else ""
        return (
            f"converted {self.tensors} tensors ({format_binary_bytes(self.bytes)}){extras} from {self.source_format} to"
            f" {self.dest_format} in {self.seconds:.1f} s ({format_binary_bytes(rate)}/s): {self.dest}"
        )


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` (and the fp16/fp32 names), or a torch dtype -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)} (or torch.<name>)")
    return DTYPES[name]


_FILE_SUFFIXES = {".zip", ".tar", ".gz", ".tgz", ".xz", ".zst", ".7z", ".npz", ".npy", ".h5", ".hdf5", ".gguf"}
_FILE_SUFFIXES |= {".onnx", ".pkl", ".pickle", ".json", ".yaml", ".yml", ".msgpack", ".txt", ".pt2"}


def output_format(dest: str | os.PathLike, to: str | None = None) -> str:
    """The format written to ``dest``: ``to`` if given, else from the name (torch suffixes, ``.safetensors``, DCP)."""
    if to is not None:
        if to not in OUTPUT_FORMATS:
            raise ValueError(f"to={to!r} is not one of {', '.join(OUTPUT_FORMATS)}")
        return to
    suffix = Path(dest).suffix.lower()
    if suffix in TORCH_SUFFIXES:
        return "torch"
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in _FILE_SUFFIXES:  # a name that promises a file: a DCP directory under it would surprise
        raise ValueError(
            f"'{dest}': fabric-hsdp does not write {suffix} files. Name it .pth/.pt/.bin/.ckpt (torch file) or"
            " .safetensors, or pass to='dcp' (--to dcp) to write a DCP directory under that name (the default for"
            " other names)"
        )
    return "dcp"


def _cast(tensor: LazyTensor, dtype: torch.dtype | None) -> LazyTensor:
    if dtype is None or tensor.dtype == dtype or not tensor.dtype.is_floating_point:
        return tensor
    return LazyTensor(tensor.name, tensor.shape, dtype, lambda: tensor.read().to(dtype))


def _hf_sidecars(source: Path) -> dict[str, Path]:
    if not source.is_dir():
        return {}
    return {
        entry.name: entry
        for entry in sorted(source.iterdir())
        if entry.is_file()
        and not entry.name.startswith(".")
        and not entry.name.endswith(_WEIGHT_SUFFIXES)
        and entry.stat().st_size <= _SIDECAR_MAX_BYTES
    }


def _given_config(hf_config: str | os.PathLike | None, hf_directory: bool) -> Path | None:
    """The ``config.json`` that ``hf_config`` names (the file, or a directory holding it); checked up front."""
    if hf_config is None:
        return None
    path = Path(hf_config)
    if not hf_directory:
        raise ValueError(
            f"hf_config applies to a Hugging Face directory output (to='safetensors', CLI --to safetensors, with a"
            f" directory DEST), not to '{path}'"
        )
    if not path.exists():
        raise FileNotFoundError(f"hf_config '{path}' does not exist; pass a config.json or the directory holding it")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"hf_config '{path}' is a directory without config.json; pass the file itself")
        path = path / "config.json"
    return path


def _found_config(source: Path) -> Path | None:
    """A ``config.json`` inside ``source`` (a directory) or next to it, for a Hugging Face directory output."""
    for candidate in (source / "config.json", source.parent / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def _hf_extra_files(source: Path, dest: Path, from_hf: bool, given_config: Path | None) -> dict[str, Path]:
    """What travels into a Hugging Face directory output: the source's sidecars (from a Hugging Face directory),
    and ``config.json``: the given one, else the source's, else one found in or next to the source (logged)."""
    files = _hf_sidecars(source) if from_hf else {}
    config = given_config or files.get("config.json") or _found_config(source)
    if config is None:
        return files
    if config != files.get("config.json"):
        _logger.info("copying config.json from '%s' into '%s'", config, dest)
    return {**files, "config.json": config}


def convert_checkpoint(
    source: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    to: str | None = None,
    dtype: str | torch.dtype | None = None,
    key_map: KeyMapSpec = None,
    max_shard_size: int | str | None = "5GB",
    overwrite: bool = False,
    weights_only: bool = True,
    model_only: bool = False,
    hf_config: str | os.PathLike | None = None,
) -> ConvertSummary:
    """Convert a checkpoint, streaming one tensor at a time; the output appears only once complete.

    Args:
        source: any checkpoint :func:`open_checkpoint` accepts.
        dest: the output. Its format is ``to``, else from its name: ``.pth/.pt/.bin/.ckpt`` -> torch file,
            ``.safetensors`` -> one safetensors file, anything else -> a DCP directory (``to="safetensors"`` with a
            directory name writes a Hugging Face directory, sharded by ``max_shard_size``).
        to: ``"dcp"``, ``"torch"`` or ``"safetensors"``.
        dtype: cast floating-point model tensors (``"bf16"``, ``"fp16"``, ``"fp32"``); otherwise bit-exact.
        key_map: rename/drop model tensors (see :mod:`fabric_hsdp.checkpoint.core.keys`).
        max_shard_size: largest safetensors shard of a directory output, e.g. ``"5GB"``.
        overwrite: replace an existing ``dest``.
        weights_only: unpickle safely; ``False`` only for trusted checkpoints.
        model_only: write the model tensors alone (a torch file then holds a flat state dict, like litgpt's
            ``lit_model.pth``), leaving out optimizer state and other extras.
        hf_config: for a Hugging Face directory output, the ``config.json`` (or a directory holding it) to copy
            in, so ``from_pretrained`` loads the output. Without it: the source's own (a Hugging Face directory),
            else a ``config.json`` inside or next to the source; with none, a warning says how to add it.

    Optimizer state and other extras of a wrapped checkpoint are kept when the output can hold them (DCP, torch
    file) unless ``model_only``, and left out, with a warning, for safetensors.

    Raises:
        FileNotFoundError: ``source`` (or ``dest``'s directory) does not exist.
        FileExistsError: ``dest`` exists and ``overwrite`` is false.
        ValueError: ``source`` is not a readable checkpoint, or an argument is invalid.
    """
    source, dest = Path(source), Path(dest)
    format = output_format(dest, to)
    cast_to = resolve_dtype(dtype)
    shard_limit = (
        parse_bytes(max_shard_size, "max_shard_size") if max_shard_size is not None else None
    )  # bad sizes fail up front
    if source.exists() and dest.exists() and source.resolve() == dest.resolve():
        raise ValueError(f"source and destination are the same path '{dest}'; write to a new path instead")
    check_destination(dest, overwrite)  # before anything is read
    hf_directory = format == "safetensors" and dest.suffix != ".safetensors"
    given_config = _given_config(hf_config, hf_directory)
    started = time.perf_counter()
    with open_checkpoint(source, weights_only=weights_only) as checkpoint:
        lazy = checkpoint.lazy_tensors()
        renamed, dropped = apply_key_map(checkpoint.keys(), key_map)
        if dropped and not renamed:
            raise ValueError(
                f"key_map={key_map!r} drops all {len(dropped)} model tensors of '{source}' (e.g. {dropped[0]!r}), so"
                " the output would hold none; drop only what should go (rules: 'OLD=NEW', 'OLD=', '!OLD')"
            )
        if dropped:
            _logger.info("key_map drops %d tensors, e.g. %r", len(dropped), dropped[0])
        # a transformers model whose checkpoints the hub holds in another layout (one tensor per expert): that one
        config = (given_config or _found_config(source)) if hf_directory else None
        if config is not None:
            refuse_config_that_does_not_fit(checkpoint, renamed, config)
        hub = hub_layout_for_config(checkpoint, renamed, config)
        if hf_directory:
            _say_layout(renamed, hub, config)
        tensors = {new: _cast(tensor, cast_to) for new, tensor in hub.items()} if hub else {}
        tensors = tensors or {new: _cast(lazy[old], cast_to) for new, old in renamed.items()}
        extras = {} if model_only else checkpoint.extras(lazy=True)
        if extras and format == "safetensors":
            _logger.warning(
                "safetensors holds tensors only: writing the model and leaving out %s of '%s'",
                ", ".join(repr(key) for key in extras),
                source,
            )
            extras = {}
        total = sum(tensor.nbytes for tensor in tensors.values()) + tree_nbytes(extras)
        with Progress(total, f"converting {source.name} -> {dest.name}") as bar:
            if format == "dcp":
                write_dcp(dest, tensors, extras=extras, overwrite=overwrite, on_tensor=bar.update)
            elif format == "torch":
                model_key = getattr(checkpoint, "model_key", None) or "model"
                write_torch_file(
                    dest, tensors, extras=extras, model_key=model_key, overwrite=overwrite, on_tensor=bar.update
                )
            else:
                # configs and tokenizer files travel with the weights only from a Hugging Face directory
                from_hf = checkpoint.format.startswith("hf-")
                extra_files = _hf_extra_files(source, dest, from_hf, given_config) if hf_directory else {}
                write_safetensors(
                    dest,
                    tensors,
                    max_shard_size=shard_limit,
                    extra_files=extra_files,
                    overwrite=overwrite,
                    on_tensor=bar.update,
                )
                if hf_directory and "config.json" not in extra_files:  # said once the output exists
                    _logger.warning(
                        "'%s' has no config.json (none in or next to '%s'), so transformers' from_pretrained cannot"
                        " load it. Pass hf_config= (CLI: --hf_config PATH) the model's config.json or directory, or"
                        " copy its config.json into '%s'",
                        dest,
                        source,
                        dest,
                    )
        summary = ConvertSummary(
            tensors=len(tensors) + len(tree_leaves(extras)),
            bytes=total,
            seconds=time.perf_counter() - started,
            source_format=checkpoint.format,
            dest_format=format,
            dest=dest,
            with_extras=bool(extras),
        )
    _logger.info("%s", summary)
    return summary


def _say_layout(names: dict[str, str], hub: dict[str, Any] | None, config: Path | None) -> None:
    """Which layout a Hugging Face directory is written in: the hub's (by the config's ``model_type``), or the names
    the tensors are stored with, which for transformers' fused experts is not what the hub or other tools read."""
    if hub:
        _logger.info("writing the hub's layout for '%s': %d tensors as %d", config, len(names), len(hub))
        return
    fused = fused_experts(list(names))
    if config is None and fused:
        _logger.warning(
            "writing %d tensors under the names they are stored with: transformers' in-memory layout, with fused"
            " experts (%r), not the hub's one tensor per expert that from_pretrained of other versions, vLLM and"
            " other tools read. Pass hf_config= (CLI: --hf_config) the model's config.json to write the hub's layout.",
            len(names),
            fused[0],
        )
    elif config is not None:
        _logger.info(
            "writing %d tensors under the names they are stored with: the hub's layout for '%s'", len(names), config
        )
    else:
        _logger.debug("writing %d tensors under the names they are stored with", len(names))


def _info_dict(info: TensorInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "shape": list(info.shape),
        "dtype": str(info.dtype).removeprefix("torch."),
        "bytes": info.nbytes,
    }


_SMALL_TEXT = 80  # characters of a string extra shown whole


def _extra_dict(value: Any) -> dict[str, Any]:
    """An extra's tensor count, bytes and type, and its value when it is small and plain (``step``, a seed)."""
    entry: dict[str, Any] = {"tensors": len(tree_leaves(value)), "bytes": tree_nbytes(value)}
    entry["type"] = type(value).__name__
    small = (
        value is None or isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= _SMALL_TEXT)
    )
    if small:
        entry["value"] = value
    return entry


def inspect_checkpoint(path: str | os.PathLike, *, weights_only: bool = True, first: int = 10) -> dict[str, Any]:
    """Describe a checkpoint without reading tensor data: format, counts, sizes, dtypes, first keys, DCP chunking.

    Returns:
        A JSON-serialisable dict with ``path``, ``format``, ``tensors``, ``parameters``, ``bytes``, ``dtypes``,
        ``largest``, ``first_keys``, ``model_key`` (the entry holding the model tensors, ``None`` for a raw state
        dict), ``extras`` (top-level entries besides the model, with their tensor count, bytes, type and, for a
        number, bool, None or short string such as ``step``, the value) and, for DCP, ``dcp`` (files and how
        tensors are chunked).
    """
    with open_checkpoint(path, weights_only=weights_only) as checkpoint:
        names = checkpoint.keys()
        infos = [checkpoint.tensor_info(name) for name in names]
        extras = checkpoint.extras(lazy=True)
        largest = max(infos, key=lambda info: info.nbytes, default=None)
        result: dict[str, Any] = {
            "path": str(path),
            "format": checkpoint.format,
            "tensors": len(infos),
            "parameters": sum(info.numel for info in infos),
            "bytes": sum(info.nbytes for info in infos),
            "dtypes": dict(Counter(str(info.dtype).removeprefix("torch.") for info in infos).most_common()),
            "largest": _info_dict(largest) if largest else None,
            "first_keys": [_info_dict(info) for info in infos[:first]],
            "model_key": getattr(checkpoint, "model_key", None),
            "extras": {key: _extra_dict(value) for key, value in extras.items()},
        }
        if checkpoint.format == "dcp":
            chunk_counts = {name: len(checkpoint.chunks(name)) for name in names}
            split = [name for name, count in chunk_counts.items() if count > 1]
            result["dcp"] = {
                "files": [{"name": name, "bytes": size} for name, size in storage_files(Path(path))],
                "chunked_tensors": len(split),
                "max_chunks": max(chunk_counts.values(), default=0),
                "example_chunks": ({"name": split[0], "chunks": _chunk_lists(checkpoint, split[0])} if split else None),
            }
    return result


def _chunk_lists(checkpoint: Any, name: str) -> list[list[list[int]]]:
    """``[[offsets], [sizes]]`` per stored chunk of ``name``, as the ``inspect`` JSON has them."""
    return [[list(box.offsets), list(box.sizes)] for box in checkpoint.chunks(name)]
