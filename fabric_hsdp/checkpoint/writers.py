"""Atomic, streaming checkpoint writers: a torch file, safetensors (one file or HF shards + index) and DCP.

Every writer takes the tensors as a mapping or an iterable of ``(name, tensor)`` pairs. Values may be tensors or
:class:`~fabric_hsdp.checkpoint.sources.LazyTensor` (what ``CheckpointSource.lazy_tensors()`` gives): lazy values are
read one at a time, into one scratch buffer the size of the largest tensor, and written through
:class:`~fabric_hsdp.checkpoint._io.DirectFileWriter` (``O_DIRECT`` with two 16 MiB buffers, written on a thread).

* torch file: the structure (``data.pkl``) is pickled by torch from fake tensors up front, then the zip records are
  written one at a time with torch's own ``PyTorchFileWriter`` into a stream, as ``torch.save(f)`` would (so the
  archive's inner name is ``archive``, as for ``torch.save`` to a file object).
* safetensors: the documented header (8-byte length + JSON) is computed from shapes first, then data follows.
* DCP: ``dcp.save`` is a single call; its planner is handed meta tensors and reads each real tensor only when the
  storage writer asks for it.

Peak memory, measured by ``benchmarks/convert.py`` on a 544 MiB checkpoint whose largest tensor is 125 MiB: 159-160
MiB above the process's footprint after imports for each of the three writers (scratch + 32 MiB of write buffers),
against 545-704 MiB for torch's ``torch_save_to_dcp`` / ``dcp_to_torch_save``. Plain tensors (not LazyTensor) are
written as they are, without a copy; holding them is the caller's memory. Outputs appear under their final name
only when complete and fsync'ed (see :func:`atomic_output`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fabric_hsdp.checkpoint._io import DirectFileWriter, ScratchBuffer, release_freed_memory
from fabric_hsdp.checkpoint._safetensors import SAFETENSORS_DTYPES
from fabric_hsdp.checkpoint.commit import _fsync, _remove, commit
from fabric_hsdp.checkpoint.sources import LazyTensor, map_tensors, materialize

_logger = logging.getLogger("fabric_hsdp")

TensorLike = torch.Tensor | LazyTensor
TensorsArg = Mapping[str, TensorLike] | Iterable[tuple[str, TensorLike]]
ProgressFn = Callable[[int], None]

_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (decimal, as Hugging Face uses) or ``"512MiB"``."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"size {size!r} is not a number with a unit like '5GB', '500MB' or '2GiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _fsync_tree(path: Path) -> None:
    """fsync a file, or every file and directory under a directory (so the names are durable too)."""
    if not path.is_dir():
        _fsync(path)
        return
    for root, _, names in os.walk(path):
        for name in names:
            _fsync(Path(root) / name)
        _fsync(Path(root))


@contextmanager
def atomic_output(dest: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write ``dest`` at (a file or a directory); it becomes ``dest`` only on success.

    The temporary path is ``<dest's parent>/.<name>.tmp-<random>/<name>``, so it is on the same filesystem and
    keeps ``dest``'s name (torch records the file name inside its archives). On any exception, ``KeyboardInterrupt``
    included, everything written is removed and ``dest`` is left as it was. The result is fsync'ed before the
    rename, so a crash cannot leave a half-written file under the final name.

    Raises:
        FileExistsError: ``dest`` exists and ``overwrite`` is false.
        FileNotFoundError: ``dest``'s parent directory does not exist.
    """
    dest = Path(dest)
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise FileExistsError(f"'{dest}' already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    parent = dest.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write '{dest}': directory '{parent}' does not exist")
    staging = parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        try:
            yield staging / dest.name
        except OSError as error:
            if error.filename is None and error.errno is not None:  # e.g. a full disk: say which output it was
                raise OSError(error.errno, error.strerror, str(dest)) from error
            raise
        result = staging / dest.name
        if not (result.exists() or result.is_symlink()):
            raise RuntimeError(f"nothing was written for '{dest}'")
        _fsync_tree(result)
        commit(result, dest)  # one rename, or one atomic exchange with the dest it replaces
    finally:
        _remove(staging)


def _entries(tensors: TensorsArg) -> list[tuple[str, TensorLike]]:
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    seen = set()
    for name, value in items:
        if not isinstance(value, torch.Tensor | LazyTensor):
            raise TypeError(f"tensor {name!r} is a {type(value).__name__}, expected a torch.Tensor or LazyTensor")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
    return items


def _scratch_for(values: Iterable[Any]) -> ScratchBuffer:
    return ScratchBuffer(max((value.nbytes for value in values if isinstance(value, LazyTensor)), default=0))


def _materialize(name: str, value: TensorLike, scratch: ScratchBuffer) -> tuple[torch.Tensor, bool]:
    """The tensor to write, contiguous on CPU with a storage of exactly its size, and whether it is a fresh copy.

    A LazyTensor is read into ``scratch`` (valid until the next call), so streaming allocates nothing per tensor.
    """
    if isinstance(value, LazyTensor):
        return value.materialize(out=scratch.take(value.shape, value.dtype)), False
    else:
        tensor, owned = value.detach(), False
        if tensor.device.type != "cpu":
            tensor, owned = tensor.cpu(), True
    if not tensor.is_contiguous() or tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor, owned = tensor.clone(memory_format=torch.contiguous_format), True
    return tensor, owned


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _tensor_leaves(obj: Any) -> list[tuple[tuple, TensorLike]]:
    leaves: list[tuple[tuple, TensorLike]] = []
    map_tensors(obj, lambda leaf, path: leaves.append((path, leaf)) or leaf)
    return leaves


def _disk_full(dest: Path, error: BaseException) -> OSError | None:
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    entries = _entries(tensors)
    model = dict(entries)
    obj: Any = {model_key: model, **extras} if extras else model
    leaves = _tensor_leaves(obj)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = {path: torch.empty(leaf.shape, dtype=leaf.dtype) for path, leaf in leaves}
    skeleton = map_tensors(obj, lambda _, path: fakes[path])
    dest = Path(dest)
    with atomic_output(dest, overwrite) as tmp:
        # torch pickles the structure itself (data.pkl); skip_data leaves the storage bytes out, to be streamed below.
        # A separate (sparse) file: truncating and rewriting one file makes ext4 flush it synchronously on close.
        skeleton_file = tmp.with_name(tmp.name + ".structure")
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, skeleton_file)
        reader = torch._C.PyTorchFileReader(str(skeleton_file))
        records = [name for name in reader.get_all_records() if name.startswith("data/")]
        if len(records) != len(leaves) or any(
            reader.get_record_size(f"data/{i}") != leaf.nbytes for i, (_, leaf) in enumerate(leaves)
        ):
            raise TypeError("extras hold tensors inside containers other than dict, list or tuple; cannot stream them")
        names = ("data.pkl", ".format_version", ".storage_alignment", "byteorder")
        header = [(name, reader.get_record(name)) for name in names if reader.has_record(name)]
        del reader
        skeleton_file.unlink()
        scratch = _scratch_for(leaf for _, leaf in leaves)
        stream = DirectFileWriter(tmp)
        writer = torch._C.PyTorchFileWriter(stream)
        try:
            for name, data in header:
                writer.write_record(name, data, len(data))
            for i, (path, leaf) in enumerate(leaves):
                tensor, fresh = _materialize(".".join(str(part) for part in path), leaf, scratch)
                writer.write_record(f"data/{i}", tensor.untyped_storage(), tensor.nbytes)
                del tensor
                if fresh:
                    release_freed_memory()
                if on_tensor is not None:
                    on_tensor(_nbytes(leaf))
            writer.write_end_of_file()
        except BaseException as error:
            # Finalise explicitly: the writer's destructor would retry, fail again and abort the process.
            with contextlib.suppress(RuntimeError):
                writer.write_end_of_file()
            full = _disk_full(dest, error) if isinstance(error, RuntimeError) else None
            if full is not None:
                raise full from None
            raise
        finally:
            del writer
            stream.close()
    return dest


def _nbytes(value: TensorLike) -> int:
    return value.nbytes if isinstance(value, LazyTensor) else value.numel() * value.element_size()


def _safetensors_header(entries: list[tuple[str, TensorLike]], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for name, value in entries:
        if value.dtype not in _SAFETENSORS_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {value.dtype}, which safetensors cannot store")
        nbytes = _nbytes(value)
        header[name] = {
            "dtype": _SAFETENSORS_NAMES[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
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
            tensor, fresh = _materialize(name, value, scratch)
            stream.write(_bytes_of(tensor))
            del tensor
            if fresh:
                release_freed_memory()
            if on_tensor is not None:
                on_tensor(_nbytes(value))


def plan_shards(entries: list[tuple[str, TensorLike]], max_shard_size: int) -> list[list[tuple[str, TensorLike]]]:
    """Split ``entries`` in order into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own)."""
    shards: list[list] = [[]]
    size = 0
    for name, value in entries:
        if shards[-1] and size + _nbytes(value) > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, value))
        size += _nbytes(value)
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
    entries = _entries(tensors)
    dest = Path(dest)
    metadata = dict(metadata or {})
    if dest.suffix == ".safetensors":
        if extra_files:
            raise ValueError(f"'{dest}' is a single file; extra_files need a directory output")
        with atomic_output(dest, overwrite) as tmp:
            _write_safetensors_file(tmp, entries, metadata, on_tensor, _scratch_for(value for _, value in entries))
        return [dest]
    limit = parse_size(max_shard_size) if max_shard_size is not None else float("inf")
    shards = plan_shards(entries, limit)  # type: ignore[arg-type]
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    scratch = _scratch_for(value for _, value in entries)
    with atomic_output(dest, overwrite) as tmp:
        tmp.mkdir()
        for name, shard in zip(names, shards):
            _write_safetensors_file(tmp / name, shard, metadata, on_tensor, scratch)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(_nbytes(value) for _, value in entries)},
                "weight_map": {tensor: file for file, shard in zip(names, shards) for tensor, _ in shard},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for name, file in (extra_files or {}).items():
            shutil.copyfile(file, tmp / name)
    return [dest / name for name in names]


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def write_dcp(
    dest: str | os.PathLike,
    tensors: TensorsArg,
    *,
    extras: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    on_tensor: ProgressFn | None = None,
) -> Path:
    """Write a DCP directory in Lightning's layout: ``model.<name>`` tensors, optimizer states, and ``meta.pt``.

    Optimizer states in ``extras`` (dicts with ``state`` and ``param_groups``) go into DCP like Lightning's
    ``ModelParallelStrategy`` saves them; every other extra goes into ``meta.pt`` (always written, ``{}`` if empty).
    """
    from fabric_hsdp.checkpoint._dcp import save_streaming

    entries = _entries(tensors)
    state: dict[str, Any] = {"model": dict(entries)}
    meta: dict[str, Any] = {}
    for key, value in (extras or {}).items():
        if key == "model":
            raise ValueError("extras cannot hold a 'model' entry: the model tensors are passed as `tensors`")
        if _is_optimizer_state(value):
            if any(isinstance(param_id, int) for param_id in value["state"]):
                _logger.warning(
                    "Optimizer state %r is keyed by parameter index (a plain optimizer.state_dict()). DCP keeps the"
                    " indices as strings ('0', '1', ...), so it reads back keyed by strings, and the sharded loader"
                    " expects states keyed by parameter name.",
                    key,
                )
            state[key] = value
        else:
            meta[key] = value
    with atomic_output(dest, overwrite) as tmp:
        tmp.mkdir()
        try:
            save_streaming(state, tmp, on_tensor)
        except RuntimeError as error:
            full = _disk_full(Path(dest), error)
            if full is not None:
                raise full from None
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(materialize(meta), tmp / "meta.pt")
    return Path(dest)
