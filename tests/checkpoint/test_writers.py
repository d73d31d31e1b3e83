import json
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fabric_hsdp.checkpoint import (
    LazyTensor,
    atomic_output,
    open_checkpoint,
    write_dcp,
    write_safetensors,
    write_torch_file,
)
from fabric_hsdp.checkpoint.core.fileio import DirectFileWriter, release_freed_memory
from fabric_hsdp.checkpoint.writers.full_files import plan_shards
from fabric_hsdp.units import parse_bytes
from tests.checkpoint.conftest import assert_same_tensors, make_optimizer_state


def leftovers(directory):
    return sorted(path.name for path in directory.iterdir() if ".tmp-" in path.name or ".old-" in path.name)


def test_atomic_output_renames_only_on_success(tmp_path):
    with atomic_output(tmp_path / "out.bin") as tmp:
        assert tmp.name == "out.bin" and tmp.parent.parent == tmp_path
        tmp.write_bytes(b"done")
        assert not (tmp_path / "out.bin").exists()
    assert (tmp_path / "out.bin").read_bytes() == b"done"
    with atomic_output(tmp_path / "dir") as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("x")
    assert (tmp_path / "dir" / "a").read_text() == "x"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_atomic_output_removes_everything_on_failure(tmp_path, error):
    (tmp_path / "keep.bin").write_bytes(b"old")
    with pytest.raises(type(error)), atomic_output(tmp_path / "keep.bin", overwrite=True) as tmp:
        tmp.write_bytes(b"partial")
        raise error
    with pytest.raises(type(error)), atomic_output(tmp_path / "new_dir") as tmp:
        tmp.mkdir()
        (tmp / "shard").write_bytes(b"partial")
        raise error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["keep.bin"]
    assert (tmp_path / "keep.bin").read_bytes() == b"old"


def test_atomic_output_refuses_existing_dest_without_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    exists = r"'.*out' already exists; pass overwrite=True \(CLI: --overwrite\)"
    with pytest.raises(FileExistsError, match=exists), atomic_output(tmp_path / "out"):
        pass
    with atomic_output(tmp_path / "out", overwrite=True) as tmp:
        tmp.write_bytes(b"file now")
    assert (tmp_path / "out").read_bytes() == b"file now"
    assert leftovers(tmp_path) == []
    with (
        pytest.raises(FileNotFoundError, match="directory '.*missing' does not exist"),
        atomic_output(tmp_path / "missing" / "x"),
    ):
        pass


def test_parse_size_and_plan_shards():
    assert [parse_bytes(s) for s in ("5GB", "500MB", "2GiB", "10", 7)] == [5 * 10**9, 5 * 10**8, 2 * 2**30, 10, 7]
    with pytest.raises(ValueError, match="size='5 parsecs' is not a size; write a number with a unit"):
        parse_bytes("5 parsecs")
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5])]  # 40, 40, 120, 20 bytes
    assert [[name for name, _ in shard] for shard in plan_shards(tensors, 100)] == [["t0", "t1"], ["t2"], ["t3"]]


def test_torch_file_flat_and_fabric_layout(tmp_path, state_dict):
    write_torch_file(tmp_path / "flat.pth", state_dict)
    assert_same_tensors(torch.load(tmp_path / "flat.pth", weights_only=True), state_dict)
    archive = zipfile.ZipFile(tmp_path / "flat.pth")
    assert archive.testzip() is None  # every record's CRC is right
    assert archive.namelist()[0] == "archive/data.pkl"  # the archive name torch.save gives a file object

    optimizer = make_optimizer_state(state_dict)
    lazy = {name: LazyTensor(name, t.shape, t.dtype, lambda t=t: t.clone()) for name, t in state_dict.items()}
    write_torch_file(tmp_path / "full.ckpt", lazy, extras={"optimizer": optimizer, "step": 3}, model_key="state_dict")
    loaded = torch.load(tmp_path / "full.ckpt", weights_only=True, mmap=True)
    assert list(loaded) == ["state_dict", "optimizer", "step"]
    assert_same_tensors(loaded["state_dict"], state_dict)
    assert loaded["step"] == 3
    assert loaded["optimizer"]["param_groups"] == optimizer["param_groups"]
    assert torch.equal(loaded["optimizer"]["state"]["embed.weight"]["exp_avg"], torch.full((16, 8), 0.25))


def test_safetensors_single_file_and_sharded_directory(tmp_path, state_dict):
    write_safetensors(tmp_path / "one.safetensors", state_dict)
    assert_same_tensors(load_file(tmp_path / "one.safetensors"), state_dict)
    with safe_open(tmp_path / "one.safetensors", "pt") as file:
        assert file.metadata() == {"format": "pt"}

    files = write_safetensors(tmp_path / "hf", state_dict, max_shard_size=600)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [path.name for path in files] == names
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in state_dict.values())}
    assert list(index["weight_map"]) == list(state_dict)
    assert index["weight_map"]["embed.weight"] == names[0]
    merged = {}
    for name in names:
        merged |= load_file(tmp_path / "hf" / name)
    assert_same_tensors({name: merged[name] for name in state_dict}, state_dict)
    write_safetensors(tmp_path / "small", state_dict)
    assert sorted(path.name for path in (tmp_path / "small").iterdir()) == ["model.safetensors"]
    with pytest.raises(ValueError, match="tensor 'c' has dtype torch.complex128, which safetensors cannot store"):
        write_safetensors(tmp_path / "c.safetensors", {"c": torch.zeros(2, dtype=torch.complex128)})
    assert not (tmp_path / "c.safetensors").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_layout_is_read_by_torch_and_lightning_style_loading(tmp_path, state_dict):
    optimizer = make_optimizer_state(state_dict)
    write_dcp(tmp_path / "ckpt", state_dict, extras={"optimizer": optimizer, "step": 3, "note": "hi"})
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert torch.load(tmp_path / "ckpt" / "meta.pt", weights_only=True) == {"step": 3, "note": "hi"}
    keys = set(dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    assert {f"model.{name}" for name in state_dict} <= keys
    assert "optimizer.state.embed.weight.exp_avg" in keys

    # What Lightning's ModelParallelStrategy does: dcp.load into {"model": <state dict of the right shapes>}.
    targets = {"model": {name: torch.empty_like(t) for name, t in state_dict.items()}}
    dcp.load(targets, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert_same_tensors(targets["model"], state_dict)

    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "back.pth")
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert_same_tensors(back["model"], state_dict)
    assert torch.equal(back["optimizer"]["state"]["embed.weight"]["exp_avg"], torch.full((16, 8), 0.25))


def _peak_growth(fn) -> int:
    """Peak resident memory (VmHWM) reached while ``fn`` runs, above the resident memory before it, in bytes."""

    def status(field):
        with open("/proc/self/status") as file:
            return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field))

    release_freed_memory()  # drop what earlier allocations left in the heap, so it cannot hide a peak
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # reset VmHWM to the current RSS
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


@pytest.mark.parametrize("writer", ["dcp", "torch", "safetensors"])
def test_writers_stream_one_tensor_at_a_time(tmp_path, writer):
    tensor_bytes, count = 16 << 20, 8
    torch.save({f"w{i}": torch.full((tensor_bytes // 4,), float(i)) for i in range(count)}, tmp_path / "src.pth")
    dest = {"dcp": tmp_path / "out", "torch": tmp_path / "out.pth", "safetensors": tmp_path / "out.safetensors"}
    write = {"dcp": write_dcp, "torch": write_torch_file, "safetensors": write_safetensors}[writer]
    with open_checkpoint(tmp_path / "src.pth") as source:
        growth = _peak_growth(lambda: write(dest[writer], source.lazy_tensors()))
    # Holding the whole 128 MiB would mean >= 128 MiB; streaming holds one 16 MiB tensor, the writer's two 16 MiB
    # write buffers and a little more.
    limit = tensor_bytes + 2 * DirectFileWriter.BLOCK + (16 << 20)
    assert growth < limit, f"{writer} peaked {growth >> 20} MiB above its start"
    with open_checkpoint(dest[writer]) as written:
        assert torch.equal(written.read("w7"), torch.full((tensor_bytes // 4,), 7.0))


@pytest.mark.parametrize("direct", [True, False])
def test_direct_file_writer_writes_exactly_what_it_is_given(tmp_path, monkeypatch, direct):
    if not direct:
        monkeypatch.setattr("os.O_DIRECT", 0, raising=False)  # as on a filesystem without O_DIRECT
    data = torch.randint(0, 256, (3 * DirectFileWriter.BLOCK + 12345,), dtype=torch.uint8).numpy().tobytes()
    sizes = [1, 4095, 7, DirectFileWriter.BLOCK + 3, 100_000]
    sizes.append(len(data) - sum(sizes))  # ends with an unaligned tail
    with DirectFileWriter(tmp_path / "out.bin") as stream:
        position = 0
        for size in sizes:
            piece = data[position : position + size]
            assert stream.write(memoryview(piece)) == len(piece)
            position += len(piece)
            assert stream.tell() == position
        assert stream._direct is direct
    assert (tmp_path / "out.bin").read_bytes() == data[:position]
    assert position == len(data)
