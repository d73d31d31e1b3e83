import dataclasses
import json
import logging
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fabric_hsdp import CheckpointError
from fabric_hsdp.checkpoint import TensorInfo, open_checkpoint
from fabric_hsdp.checkpoint.core.box import Box
from tests.checkpoint.conftest import assert_same_tensors, make_optimizer_state


def read_all(source):
    return {name: source.read(name) for name in source}


def test_raw_torch_file(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "lit_model.pth")
    with open_checkpoint(tmp_path / "lit_model.pth") as source:
        assert source.format == "torch"
        assert source.keys() == list(state_dict)
        assert source.tensor_info("layers.0.mlp.weight_t") == TensorInfo(
            "layers.0.mlp.weight_t", torch.Size([12, 8]), torch.float32
        )
        assert source.tensor_info("layers.0.attn.weight").nbytes == 128
        assert_same_tensors(read_all(source), state_dict)
        assert source.extras() == {}


def test_any_file_name_is_detected_from_content(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "weights.data")
    save_file({"a": torch.ones(2)}, tmp_path / "weights.pth")
    with open_checkpoint(tmp_path / "weights.data") as source:
        assert source.format == "torch"
    with open_checkpoint(tmp_path / "weights.pth") as source:
        assert source.format == "safetensors"


def test_tensors_saved_on_another_device_are_read_to_cpu(tmp_path):
    """A CPU-only machine cannot save from cuda:0, so record storages under the location tag 'cuda:0'.

    ``torch.load`` without ``map_location`` then fails on this machine exactly as it would for a GPU checkpoint;
    the source reads the tensors to CPU regardless of the tag.
    """
    tag_as_cuda = {"on": True}
    torch.serialization.register_package(
        -1, lambda storage: "cuda:0" if tag_as_cuda["on"] else None, lambda storage, location: None
    )
    try:
        torch.save({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "gpu.pth")
    finally:
        tag_as_cuda["on"] = False
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "gpu.pth", weights_only=True)
    with open_checkpoint(tmp_path / "gpu.pth") as source:
        tensor = source.read("w")
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, torch.arange(6.0).reshape(2, 3))
        assert source.read_slice("w", (slice(1, 2),)).device.type == "cpu"


@pytest.mark.parametrize("model_key", ["model", "state_dict"])
def test_wrapped_checkpoint(tmp_path, state_dict, model_key):
    optimizer = make_optimizer_state(state_dict)
    torch.save({model_key: state_dict, "optimizer": optimizer, "step": 3}, tmp_path / "full.ckpt")
    with open_checkpoint(tmp_path / "full.ckpt") as source:
        assert source.format == "fabric"
        assert source.model_key == model_key
        assert_same_tensors(read_all(source), state_dict)
        lazy = source.extras(lazy=True)
        assert lazy["step"] == 3
        assert lazy["optimizer"]["param_groups"] == optimizer["param_groups"]
        exp_avg = lazy["optimizer"]["state"]["embed.weight"]["exp_avg"]
        assert (type(exp_avg).__name__, list(exp_avg.shape), exp_avg.dtype) == ("LazyTensor", [16, 8], torch.float32)
        extras = source.extras()
        assert torch.equal(extras["optimizer"]["state"]["embed.weight"]["exp_avg"], torch.full((16, 8), 0.25))
        assert extras["optimizer"]["state"]["embed.weight"]["step"].item() == 4.0


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"a": torch.ones(1), "step": 3}, "mixes tensors"),
        ({"optimizer": {"state": {}}, "step": 3}, "without a 'model' or 'state_dict' dict of tensors"),
        ({"model": {"a": torch.ones(1), "extra": None}, "step": 1}, r"model\['extra'\] is a NoneType, not a tensor"),
        ([torch.ones(1)], "holds a list, not a state dict"),
        ({}, "holds an empty dict"),
    ],
)
def test_layouts_that_are_neither_raw_nor_wrapped(tmp_path, obj, message):
    torch.save(obj, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match=message) as error:
        open_checkpoint(tmp_path / "odd.pth")
    assert "odd.pth" in str(error.value)


def test_read_slice_reads_only_the_box(tmp_path, monkeypatch):
    weight = torch.arange(6 * 5 * 4, dtype=torch.float32).reshape(6, 5, 4)
    torch.save({"w": weight, "t": weight.flatten(1).t()}, tmp_path / "w.pth")
    save_file({"w": weight}, tmp_path / "w.safetensors")
    boxes = [
        (slice(1, 4),),
        (slice(None), slice(2, 5)),
        (slice(2, 3), slice(0, 1), slice(1, 3)),
        (slice(0, 0),),
        (slice(-2, None), slice(None), slice(3, 4)),
    ]
    for path in ("w.pth", "w.safetensors"):
        with open_checkpoint(tmp_path / path) as source:
            for box in boxes:
                assert torch.equal(source.read_slice("w", box), weight[box]), (path, box)
    with safe_open(tmp_path / "w.safetensors", "pt") as reference, open_checkpoint(tmp_path / "w.safetensors") as ours:
        assert torch.equal(ours.read_slice("w", (slice(1, 3), slice(1, 2))), reference.get_slice("w")[1:3, 1:2])
    from fabric_hsdp.checkpoint.core import fileio

    read = []
    readinto = fileio.readinto
    monkeypatch.setattr(
        fileio,
        "readinto",
        lambda fd, target, offset, **kw: read.append(target.nbytes) or readinto(fd, target, offset, **kw),
    )
    with open_checkpoint(tmp_path / "w.safetensors") as source:  # a column-split weight: one read per row, no more
        assert torch.equal(source.read_slice("w", (slice(1, 5), slice(2, 4))), weight[1:5, 2:4])
    assert read == [2 * 4 * 4] * 4
    with open_checkpoint(tmp_path / "w.pth") as source:
        assert torch.equal(source.read_slice("t", (slice(3, 7),)), weight.flatten(1).t()[3:7])
        with pytest.raises(ValueError, match="unit steps"):
            source.read_slice("w", (slice(0, 4, 2),))


def test_legacy_pickle_is_read_whole_with_a_warning(tmp_path, state_dict, caplog):
    torch.save(state_dict, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with caplog.at_level(logging.WARNING, logger="fabric_hsdp"), open_checkpoint(tmp_path / "old.pt") as source:
        assert_same_tensors(read_all(source), state_dict)
    assert "legacy (non-zip) torch file" in caplog.text


class NotAllowed:
    def __init__(self) -> None:
        self.value = 1


def test_weights_only_refuses_arbitrary_objects_unless_opted_in(tmp_path, caplog):
    torch.save({"model": {"a": torch.ones(2)}, "hparams": NotAllowed()}, tmp_path / "pickled.ckpt")
    with pytest.raises(ValueError, match=r"'.*pickled.ckpt' holds Python objects .* weights_only=False"):
        open_checkpoint(tmp_path / "pickled.ckpt")
    with caplog.at_level(logging.WARNING, logger="fabric_hsdp"):
        source = open_checkpoint(tmp_path / "pickled.ckpt", weights_only=False)
    assert "weights_only=False" in caplog.text
    assert isinstance(source.extras()["hparams"], NotAllowed)
    source.close()


def test_safetensors_and_hugging_face_directories(tmp_path, state_dict):
    contiguous = {name: tensor.contiguous() for name, tensor in state_dict.items()}
    first, second = list(contiguous)[:5], list(contiguous)[5:]
    (tmp_path / "sharded").mkdir()
    save_file({k: contiguous[k] for k in first}, tmp_path / "sharded" / "model-00001-of-00002.safetensors")
    save_file({k: contiguous[k] for k in second}, tmp_path / "sharded" / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in second}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "single").mkdir()
    save_file(contiguous, tmp_path / "single" / "model.safetensors")
    (tmp_path / "bin").mkdir()
    torch.save({k: contiguous[k] for k in first}, tmp_path / "bin" / "pytorch_model-00001-of-00002.bin")
    torch.save({k: contiguous[k] for k in second}, tmp_path / "bin" / "pytorch_model-00002-of-00002.bin")
    bin_map = {k: f.replace("model-", "pytorch_model-").replace(".safetensors", ".bin") for k, f in weight_map.items()}
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bin_map}))
    (tmp_path / "onebin").mkdir()
    torch.save(contiguous, tmp_path / "onebin" / "pytorch_model.bin")
    expected = {name: contiguous[name] for name in weight_map}
    for directory, format in [
        ("sharded", "hf-safetensors"),
        ("single", "hf-safetensors"),
        ("bin", "hf-bin"),
        ("onebin", "hf-bin"),
    ]:
        with open_checkpoint(tmp_path / directory) as source:
            assert source.format == format
            assert sorted(source.keys()) == sorted(expected)
            assert_same_tensors({name: source.read(name) for name in expected}, expected)
    with open_checkpoint(tmp_path / "single" / "model.safetensors") as source:
        assert source.format == "safetensors"
        assert source.tensor_info("layers.0.attn.weight") == TensorInfo(
            "layers.0.attn.weight", torch.Size([8, 8]), torch.bfloat16
        )


def test_dcp_written_by_torch_save_to_dcp(tmp_path, state_dict):
    optimizer = make_optimizer_state(state_dict)
    torch.save(state_dict, tmp_path / "raw.pth")
    torch.save({"model": state_dict, "optimizer": optimizer, "step": 3}, tmp_path / "full.pth")
    torch_save_to_dcp(tmp_path / "raw.pth", tmp_path / "raw_dcp")
    torch_save_to_dcp(tmp_path / "full.pth", tmp_path / "full_dcp")
    with open_checkpoint(tmp_path / "raw_dcp") as source:
        assert source.format == "dcp"
        assert sorted(source.keys()) == sorted(state_dict)
        assert_same_tensors({name: source.read(name) for name in state_dict}, state_dict)
        assert source.extras() == {}
    with open_checkpoint(tmp_path / "full_dcp") as source:
        assert sorted(source.keys()) == sorted(state_dict)
        assert_same_tensors({name: source.read(name) for name in state_dict}, state_dict)
        extras = source.extras()
        assert extras["step"] == 3
        assert extras["optimizer"]["param_groups"] == [
            {"lr": 0.01, "betas": (0.9, 0.95), "params": optimizer["param_groups"][0]["params"]}
        ]
        assert torch.equal(extras["optimizer"]["state"]["embed.weight"]["exp_avg"], torch.full((16, 8), 0.25))
        assert torch.equal(source.read_slice("embed.weight", (slice(3, 5),)), state_dict["embed.weight"][3:5])
        assert source.chunks("embed.weight") == [Box((0, 0), (16, 8))]


def test_hf_style_raw_keys_with_a_model_prefix_stay_raw(tmp_path):
    """``model.*`` keys of a flat HF state dict are names, not Lightning's wrapper: the DCP nesting tells them apart."""
    flat = {"model.embed_tokens.weight": torch.ones(4, 2), "lm_head.weight": torch.zeros(4, 2)}
    torch.save(flat, tmp_path / "hf.pth")
    torch_save_to_dcp(tmp_path / "hf.pth", tmp_path / "hf_dcp")
    with open_checkpoint(tmp_path / "hf_dcp") as source:
        assert sorted(source.keys()) == ["lm_head.weight", "model.embed_tokens.weight"]


def test_missing_tensor_message_names_the_checkpoint_and_examples(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "lit-llama.pth")
    with open_checkpoint(tmp_path / "lit-llama.pth") as source, pytest.raises(ValueError) as error:
        source.read("layers.3.mlp.w1.weight")
    assert str(error.value) == (
        f"checkpoint '{tmp_path / 'lit-llama.pth'}' has no tensor 'layers.3.mlp.w1.weight'; it has 11 tensors,"
        " e.g. 'embed.weight', 'layers.0.attn.weight', 'layers.0.mlp.weight', 'layers.0.mlp.weight_t',"
        " 'layers.0.view'"
    )


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(bytes(range(256)) * 64), "is not a checkpoint"),
        (lambda p: p.write_bytes(b""), "is empty"),
        (lambda p: (torch.save({"a": torch.ones(1000)}, p), _truncate(p, 2000)), "truncated or damaged torch file"),
        (lambda p: (save_file({"a": torch.ones(1000)}, p), _truncate(p, 2000)), "is truncated"),
        (lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 100), "truncated or damaged torch file"),
        (lambda p: torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), p), "TorchScript archive"),
    ],
    ids=["random-bytes", "empty", "truncated-zip", "truncated-safetensors", "zip-magic-only", "torchscript"],
)
def test_bad_files(tmp_path, make, message):
    path = tmp_path / "bad.pth"
    make(path)
    with pytest.raises(ValueError, match=message) as error:
        open_checkpoint(path)
    assert str(path) in str(error.value)


def test_missing_path_and_non_checkpoint_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint '.*nope.pth' does not exist"):
        open_checkpoint(tmp_path / "nope.pth")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"is not a checkpoint \(it holds readme.txt\). Accepted: a torch file"):
        open_checkpoint(tmp_path / "notes")


def test_truncated_dcp_data_file(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "raw.pth")
    torch_save_to_dcp(tmp_path / "raw.pth", tmp_path / "dcp")
    data_file = next((tmp_path / "dcp").glob("*.distcp"))
    _truncate(data_file, data_file.stat().st_size // 2)
    # found when opening, from .metadata alone, before any tensor is read (inspect reports it too)
    with pytest.raises(CheckpointError, match=r"is incomplete: '__0_0.distcp' is truncated \(\d+ of \d+ bytes\)"):
        open_checkpoint(tmp_path / "dcp")
    data_file.unlink()
    with pytest.raises(CheckpointError, match="is incomplete: '__0_0.distcp' is missing"):
        open_checkpoint(tmp_path / "dcp")
    shutil.rmtree(tmp_path / "dcp")


def test_read_into_a_given_tensor(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "a.pth")
    torch.save(state_dict, tmp_path / "b.pth")
    torch_save_to_dcp(tmp_path / "b.pth", tmp_path / "dcp")
    for path in ("a.pth", "dcp"):
        with open_checkpoint(tmp_path / path) as source:
            out = torch.empty(12, 8)
            assert source.read("layers.0.mlp.weight_t", out=out) is out
            assert torch.equal(out, state_dict["layers.0.mlp.weight_t"])
            with pytest.raises(
                ValueError,
                match=r"'embed.weight' must be .* \[16, 8\] and dtype torch.float32, got \[16, 8\] torch.float16",
            ):
                source.read("embed.weight", out=torch.empty(16, 8, dtype=torch.float16))
            lazy = source.lazy_tensors()["embed.weight"]
            target = torch.empty(16, 8)
            assert lazy.read(out=target) is target
            assert torch.equal(target, state_dict["embed.weight"])


class _TwoChunkPlanner(DefaultSavePlanner):
    """Saves ``model.w`` as two chunks along ``dim``, as two ranks sharding it would (a single process can't)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn != "model.w"]
        whole = next(item for item in plan.items if item.index.fqn == "model.w")
        size = list(whole.tensor_data.size)
        for start, length in ((0, 3), (3, size[self.dim] - 3)):
            offsets, sizes = [0] * len(size), list(size)
            offsets[self.dim], sizes[self.dim] = start, length
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            data = TensorWriteData(chunk=chunk, properties=whole.tensor_data.properties, size=whole.tensor_data.size)
            items.append(WriteItem(MetadataIndex("model.w", chunk.offsets), WriteItemType.SHARD, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        if write_item.index.fqn != "model.w":
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        return self.state_dict["model.w"].narrow(self.dim, chunk.offsets[self.dim], chunk.sizes[self.dim])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("dim", [0, 1])
def test_dcp_tensor_saved_in_several_chunks(tmp_path, dim):
    weight = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    writer = dcp.FileSystemWriter(tmp_path / "chunked")
    dcp.save(
        {"model": {"w": weight, "b": torch.ones(2)}}, storage_writer=writer, planner=_TwoChunkPlanner(dim), no_dist=True
    )
    with open_checkpoint(tmp_path / "chunked") as source:
        assert len(source.chunks("w")) == 2
        assert torch.equal(source.read("w"), weight)
        assert torch.equal(source.read_slice("w", (slice(2, 5), slice(1, 4))), weight[2:5, 1:4])


def test_safe_load_planner_refuses_arbitrary_objects_unless_opted_in(tmp_path):
    from torch.distributed.checkpoint import CheckpointException

    from fabric_hsdp.checkpoint.core.dcp_errors import first_failure
    from fabric_hsdp.checkpoint.core.dcp_planners import SafeLoadPlanner

    dcp.save(
        {"x": torch.ones(3), "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}, checkpoint_id=tmp_path / "ok", no_dist=True
    )
    state = {"x": torch.zeros(3), "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}
    dcp.load(state, checkpoint_id=tmp_path / "ok", planner=SafeLoadPlanner(weights_only=True), no_dist=True)
    assert torch.equal(state["x"], torch.ones(3)) and state["groups"] == [{"lr": 0.1, "betas": (0.9, 0.95)}]

    dcp.save({"x": torch.ones(3), "obj": NotAllowed()}, checkpoint_id=tmp_path / "bad", no_dist=True)
    with pytest.raises(CheckpointException) as caught:
        state = {"x": torch.zeros(3), "obj": None}
        dcp.load(state, checkpoint_id=tmp_path / "bad", planner=SafeLoadPlanner(weights_only=True), no_dist=True)
    error = first_failure(caught.value)
    assert isinstance(error, ValueError)
    assert "checkpoint entry 'obj' holds Python objects that safe loading (weights_only=True) refuses" in str(error)
    assert "weights_only=False" in str(error)
    state = {"x": torch.zeros(3), "obj": None}
    dcp.load(state, checkpoint_id=tmp_path / "bad", planner=SafeLoadPlanner(weights_only=False), no_dist=True)
    assert isinstance(state["obj"], NotAllowed)
