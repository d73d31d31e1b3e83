"""Single ``.safetensors`` files as a :class:`CheckpointSource`.

The format is documented: an 8-byte little-endian header length, a JSON header (dtype, shape and byte range of
each tensor), then the raw row-major data. Parsing the header here gives each tensor's file offset, so reads are
positioned reads into a fresh tensor (``safe_open`` would mmap the file, and the pages it touches stay resident
until the handle is closed). The package therefore does not depend on the ``safetensors`` library; its tests read
what this package writes with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fabric_hsdp.checkpoint.core import fileio
from fabric_hsdp.checkpoint.core.box import Box
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
# safetensors caps the JSON header at 100 MB.
_SAFETENSORS_MAX_HEADER = 100_000_000


def looks_like_safetensors(head: bytes) -> bool:
    """Whether a file starting with ``head`` (16 bytes or more) is safetensors: a length, then a JSON object."""
    return len(head) >= 10 and head[8:9] == b"{" and head[9:10] in (b'"', b"}", b" ", b"\n")


class SafetensorsFile(CheckpointSource):
    """One ``.safetensors`` file: the documented 8-byte header length + JSON header, then raw row-major data."""

    def __init__(self, path: Path, format: str = "safetensors") -> None:
        super().__init__(path, format)
        self._file = str(path)
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._entries, self.metadata = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse_header(self) -> tuple[dict[str, tuple[int, TensorInfo]], dict[str, str]]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < header_len <= _SAFETENSORS_MAX_HEADER or 8 + header_len > size:
            raise CheckpointError(
                f"'{self._file}' has a damaged safetensors header: its length field says {header_len} bytes, but the"
                f" file has {size} bytes and safetensors allows at most {_SAFETENSORS_MAX_HEADER}. Re-copy or re-save"
                " the checkpoint."
            )
        try:
            header = json.loads(os.pread(self._fd, header_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"'{self._file}' has a damaged safetensors header ({error})") from None
        data_start = 8 + header_len
        metadata = header.pop("__metadata__", None) or {}
        entries = {}
        for name, entry in header.items():
            try:
                dtype = SAFETENSORS_DTYPES[entry["dtype"]]
                begin, end = entry["data_offsets"]
                info = TensorInfo(name, torch.Size(entry["shape"]), dtype)
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"'{self._file}' has an unsupported or damaged header entry for {name!r}: {entry!r}"
                ) from None
            if end - begin != info.nbytes:
                raise CheckpointError(
                    f"'{self._file}': tensor {name!r} {list(info.shape)} {dtype} needs {info.nbytes} bytes but its"
                    f" header gives {end - begin}"
                )
            if data_start + end > size:
                raise CheckpointError(
                    f"'{self._file}' is truncated: tensor {name!r} ends at byte {data_start + end} but the file has"
                    f" {size} bytes. Re-copy or re-save the checkpoint."
                )
            entries[name] = (data_start + begin, info)
        return entries, metadata

    def keys(self) -> list[str]:
        return list(self._entries)

    def _info(self, name: str) -> TensorInfo:
        return self._entries[name][1]

    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        offset, info = self._entries[name]
        return fileio.read_tensor(self._fd, offset, info.shape, info.dtype, file_name=self._file, out=out)

    def _read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        offset, info = self._entries[name]
        box = Box.of_index(index, info.shape, name)
        return fileio.read_box(self._fd, offset, info.shape, info.dtype, box, file_name=self._file)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
