"""Streaming writers of consolidated files: a torch file, and safetensors (one file or Hugging Face shards + index).

Every writer takes the tensors as a mapping or an iterable of ``(name, tensor)`` pairs. Values may be tensors or
:class:`~fabric_hsdp.checkpoint.core.lazy_tensor.LazyTensor` (what ``CheckpointSource.lazy_tensors()`` gives): lazy
values are read one at a time, into one scratch buffer the size of the largest tensor, and written through
:class:`~fabric_hsdp.checkpoint.core.fileio.DirectFileWriter` (``O_DIRECT`` with two 16 MiB buffers, written on a
thread).
So a writer holds the largest tensor plus 32 MiB, whatever the checkpoint's size (benchmarks/convert.py measures it).
Plain tensors (not LazyTensor) are written as they are, without a copy; holding them is the caller's memory.

* torch file: the structure (``data.pkl``) is pickled by torch from fake tensors up front, then the zip records are
  written one at a time with torch's own ``PyTorchFileWriter`` into a stream, as ``torch.save(f)`` would (so the
  archive's inner name is ``archive``, as for ``torch.save`` to a file object).
* safetensors: the documented header (8-byte length + JSON) is computed from shapes first, then data follows. The
  ``safetensors`` library cannot do this: ``save_file`` takes every tensor in memory at once.

The DCP writer (:mod:`fabric_hsdp.checkpoint.writers.dcp_writer`) shares :func:`contiguous_cpu` and
:func:`check_entries`.
Outputs appear under their final name only when complete and fsync'ed
(:func:`fabric_hsdp.checkpoint.core.commit.atomic_output`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fabric_hsdp.checkpoint.core.commit import atomic_output
from fabric_hsdp.checkpoint.core.fileio import DirectFileWriter, ScratchBuffer, release_freed_memory
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.core.tree import map_tree, nbytes, tree_leaves
from fabric_hsdp.checkpoint.formats.safetensors_file import SAFETENSORS_DTYPES
from fabric_hsdp.units import parse_bytes
from fabric_hsdp.versions import fake_tensor_mode, torch_file_reader, torch_file_writer, zip_record_sizes

TensorLike = torch.Tensor | LazyTensor
TensorsArg = Mapping[str, TensorLike] | Iterable[tuple[str, TensorLike]]
ProgressFn = Callable[[int], None]

_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def check_entries(tensors: TensorsArg) -> list[tuple[str, TensorLike]]:
    """``tensors`` as a list of ``(name, tensor)``; raises on a value that is not a tensor and on a repeated name."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    seen = set()
    for name, value in items:
        if not isinstance(value, torch.Tensor | LazyTensor):
            raise TypeError(f"tensor {name!r} is a {type(value).__name__}, expected a torch.Tensor or LazyTensor")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
    return items


def scratch_for(values: Iterable[Any]) -> ScratchBuffer:
    """One buffer that the largest LazyTensor among ``values`` fits in."""
    return ScratchBuffer(max((value.nbytes for value in values if isinstance(value, LazyTensor)), default=0))


def contiguous_cpu(name: str, value: TensorLike, scratch: ScratchBuffer) -> tuple[torch.Tensor, bool]:
    """The tensor to write, contiguous on CPU with a storage of exactly its size, and whether it is a fresh copy.

    A LazyTensor is read into ``scratch`` (valid until the next call), so streaming allocates nothing per tensor.
    """
    if isinstance(value, LazyTensor):
        return value.read(out=scratch.take(value.shape, value.dtype)), False
    tensor, owned = value.detach(), False
    if tensor.device.type != "cpu":
        tensor, owned = tensor.cpu(), True
    if not tensor.is_contiguous() or tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor, owned = tensor.clone(memory_format=torch.contiguous_format), True
    return tensor, owned


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def disk_full_error(dest: Path, error: BaseException) -> OSError | None:
    """Torch's zip writer reports a full disk as a RuntimeError; return the OSError it really is, if it is one."""
    stats = os.statvfs(dest.parent)
    if stats.f_bfree * stats.f_frsize < (16 << 20):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest))
    return None


def write_torch_file(
    dest: str | os.PathLike,
    tensors: TensorsArg,
    *,
    extras: Mapping[str, Any] | None = None,
    model_key: str = "model",
    overwrite: bool = False,
    on_tensor: ProgressFn | None = None,
) -> Path:
    """Write a file ``torch.load`` reads: a flat state dict, or ``{model_key: {...}, **extras}`` when extras exist.

    Args:
        dest: the file to create.
        tensors: model tensors by name (tensors or LazyTensor).
        extras: other checkpoint entries (optimizer state, step, ...); their tensors may be LazyTensor too.
        model_key: the entry that holds the model in a wrapped file (``"state_dict"`` for PyTorch Lightning).
        overwrite: replace ``dest`` if it exists.
        on_tensor: called with the byte count of each tensor once it is written (progress).
    """
    entries = check_entries(tensors)
    model = dict(entries)
    obj: Any = {model_key: model, **extras} if extras else model
    leaves = tree_leaves(obj)
    with fake_tensor_mode(allow_non_fake_inputs=True):
        fakes = {path: torch.empty(leaf.shape, dtype=leaf.dtype) for path, leaf in leaves}
    skeleton = map_tree(obj, lambda _, path: fakes[path])
    dest = Path(dest)
    with atomic_output(dest, overwrite) as tmp:
        # torch pickles the structure itself (data.pkl); skip_data leaves the storage bytes out, to be streamed below.
        # A separate (sparse) file: truncating and rewriting one file makes ext4 flush it synchronously on close.
        skeleton_file = tmp.with_name(tmp.name + ".structure")
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, skeleton_file)
        reader = torch_file_reader(str(skeleton_file))
        records = [name for name in reader.get_all_records() if name.startswith("data/")]
        sizes = zip_record_sizes(skeleton_file)
        if len(records) != len(leaves) or any(sizes[f"data/{i}"] != leaf.nbytes for i, (_, leaf) in enumerate(leaves)):
            raise TypeError("extras hold tensors inside containers other than dict, list or tuple; cannot stream them")
        names = ("data.pkl", ".format_version", ".storage_alignment", "byteorder")
        header = [(name, reader.get_record(name)) for name in names if reader.has_record(name)]
        del reader
        skeleton_file.unlink()
        scratch = scratch_for(leaf for _, leaf in leaves)
        stream = DirectFileWriter(tmp)
        writer = torch_file_writer(stream)
        try:
            for name, data in header:
                writer.write_record(name, data, len(data))
            for i, (path, leaf) in enumerate(leaves):
                tensor, fresh = contiguous_cpu(".".join(str(part) for part in path), leaf, scratch)
                writer.write_record(f"data/{i}", tensor.untyped_storage(), tensor.nbytes)
                del tensor
                if fresh:
                    release_freed_memory()
                if on_tensor is not None:
                    on_tensor(nbytes(leaf))
            writer.write_end_of_file()
        except BaseException as error:
            # Finalise explicitly: the writer's destructor would retry, fail again and abort the process.
            with contextlib.suppress(RuntimeError):
                writer.write_end_of_file()
            full = disk_full_error(dest, error) if isinstance(error, RuntimeError) else None
            if full is not None:
                raise full from None
            raise
        finally:
            del writer
            stream.close()
    return dest


def _safetensors_header(entries: list[tuple[str, TensorLike]], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for name, value in entries:
        if value.dtype not in _SAFETENSORS_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {value.dtype}, which safetensors cannot store")
        size = nbytes(value)
        header[name] = {
            "dtype": _SAFETENSORS_NAMES[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data start to 8 bytes
    return len(encoded).to_bytes(8, "little") + encoded


def _write_safetensors_file(
    path: Path, entries: list, metadata: Mapping[str, str], on_tensor: ProgressFn | None, scratch: ScratchBuffer
) -> None:
    header = _safetensors_header(entries, metadata)
    with DirectFileWriter(path) as stream:
        stream.write(header)
        for name, value in entries:
            tensor, fresh = contiguous_cpu(name, value, scratch)
            stream.write(_bytes_of(tensor))
            del tensor
            if fresh:
                release_freed_memory()
            if on_tensor is not None:
                on_tensor(nbytes(value))


def split_into_files(entries: list[tuple[str, TensorLike]], max_shard_size: int) -> list[list[tuple[str, TensorLike]]]:
    """Split ``entries`` in order into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own)."""
    shards: list[list] = [[]]
    size = 0
    for name, value in entries:
        if shards[-1] and size + nbytes(value) > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, value))
        size += nbytes(value)
    return shards


def write_safetensors(
    dest: str | os.PathLike,
    tensors: TensorsArg,
    *,
    max_shard_size: int | str | None = "5GB",
    metadata: Mapping[str, str] | None = None,
    extra_files: Mapping[str, str | os.PathLike] | None = None,
    overwrite: bool = False,
    on_tensor: ProgressFn | None = None,
) -> list[Path]:
    """Write safetensors: one file if ``dest`` ends in ``.safetensors``, else a Hugging Face directory.

    The directory holds ``model.safetensors`` when everything fits in ``max_shard_size``, else
    ``model-0000X-of-0000N.safetensors`` shards plus ``model.safetensors.index.json`` (``{"metadata":
    {"total_size": ...}, "weight_map": {...}}``), the layout ``from_pretrained`` reads. ``max_shard_size`` does
    not apply to a single-file ``dest``. ``extra_files`` (name -> file) are copied into a directory output, e.g.
    a Hugging Face ``config.json``.

    Returns:
        The files written, under their final names.
    """
    entries = check_entries(tensors)
    dest = Path(dest)
    metadata = dict(metadata or {})
    if dest.suffix == ".safetensors":
        if extra_files:
            raise ValueError(f"'{dest}' is a single file; extra_files need a directory output")
        with atomic_output(dest, overwrite) as tmp:
            _write_safetensors_file(tmp, entries, metadata, on_tensor, scratch_for(value for _, value in entries))
        return [dest]
    limit = parse_bytes(max_shard_size, "max_shard_size") if max_shard_size is not None else float("inf")
    shards = split_into_files(entries, limit)  # type: ignore[arg-type]
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    scratch = scratch_for(value for _, value in entries)
    with atomic_output(dest, overwrite) as tmp:
        tmp.mkdir()
        for name, shard in zip(names, shards):
            _write_safetensors_file(tmp / name, shard, metadata, on_tensor, scratch)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(nbytes(value) for _, value in entries)},
                "weight_map": {tensor: file for file, shard in zip(names, shards) for tensor, _ in shard},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for name, file in (extra_files or {}).items():
            shutil.copyfile(file, tmp / name)
    return [dest / name for name in names]
