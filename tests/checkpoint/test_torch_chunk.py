"""The layout of a DCP chunk read from its zip directory equals what ``torch.load(map_location="meta")`` says."""

from __future__ import annotations

import io

import pytest
import torch

from fabric_hsdp.checkpoint.formats.torch_chunk import chunk_record

TENSORS = {
    "contiguous": lambda: torch.randn(7, 5),
    "bfloat16": lambda: torch.randn(3, 4).to(torch.bfloat16),
    "int64 vector": lambda: torch.arange(11),
    "scalar": lambda: torch.tensor(3.0),
    "empty": lambda: torch.empty(0, 4),
    "transposed": lambda: torch.randn(6, 4).t(),
    "view with an offset": lambda: torch.randn(10, 3)[4:],
}


def _saved_after_padding(tensor: torch.Tensor, padding: int) -> bytes:
    buffer = io.BytesIO()
    buffer.write(b"x" * padding)  # a chunk lies somewhere inside a .distcp file
    torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("name", list(TENSORS))
def test_layout_matches_torch_load(tmp_path, name):
    tensor = TENSORS[name]()
    padding = 1000
    data = _saved_after_padding(tensor, padding)
    file = tmp_path / "chunk.distcp"
    file.write_bytes(data)
    with open(file, "rb") as stream:
        layout = chunk_record(stream.fileno(), padding, len(data) - padding)
        stream.seek(padding)
        stored = torch.load(io.BytesIO(stream.read()), map_location="meta", weights_only=True)
    assert layout is not None
    assert layout.start == padding + stored.untyped_storage()._checkpoint_offset
    assert layout.storage_bytes == stored.untyped_storage().nbytes()
    assert (layout.dtype, layout.shape, layout.stride) == (stored.dtype, tuple(stored.shape), stored.stride())
    assert layout.storage_offset == stored.storage_offset()
    assert layout.contiguous == stored.is_contiguous()
    # and the bytes there are the tensor's
    raw = torch.tensor(list(data[layout.start : layout.start + layout.storage_bytes]), dtype=torch.uint8)
    view = raw.view(layout.dtype).as_strided(layout.shape, layout.stride, layout.storage_offset)
    assert torch.equal(view, tensor)


@pytest.mark.parametrize(
    "obj", [{"a": torch.ones(2)}, [torch.ones(2), torch.zeros(2)], 3], ids=["dict", "two tensors", "int"]
)
def test_other_archives_are_left_to_torch_load(tmp_path, obj):
    data = _saved_after_padding(obj, 10)
    file = tmp_path / "chunk.distcp"
    file.write_bytes(data)
    with open(file, "rb") as stream:
        assert chunk_record(stream.fileno(), 10, len(data) - 10) is None


def test_damaged_directory_is_left_to_torch_load(tmp_path):
    data = bytearray(_saved_after_padding(torch.ones(4), 0))
    data[-22:-18] = b"XXXX"  # the end-of-directory signature
    file = tmp_path / "chunk.distcp"
    file.write_bytes(bytes(data))
    with open(file, "rb") as stream:
        assert chunk_record(stream.fileno(), 0, len(data)) is None
