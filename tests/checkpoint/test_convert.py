import logging

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fabric_hsdp.checkpoint import convert_checkpoint, inspect_checkpoint, open_checkpoint
from fabric_hsdp.checkpoint.writers.convert import output_format
from tests.checkpoint.conftest import assert_same_tensors, make_optimizer_state


def read_all(path):
    with open_checkpoint(path) as source:
        return {name: source.read(name) for name in source}


def test_output_format_from_name_or_to():
    assert [output_format(name) for name in ("a.pth", "a.PT", "a.bin", "a.ckpt", "a.safetensors", "out", "x.d")] == [
        "torch",
        "torch",
        "torch",
        "torch",
        "safetensors",
        "dcp",
        "dcp",
    ]
    assert output_format("out", "safetensors") == "safetensors"
    # a name that promises a file of another kind is refused, not silently made a DCP directory
    for name in ("x.zip", "model.gguf", "w.npz"):
        with pytest.raises(ValueError, match=rf"'{name}': fabric-hsdp does not write \.\w+ files\. Name it"):
            output_format(name)
    assert output_format("x.zip", "dcp") == "dcp" and output_format("llama-v1.5") == "dcp"
    with pytest.raises(ValueError, match="to='zip' is not one of dcp, torch, safetensors"):
        output_format("out", "zip")


def test_round_trip_pth_dcp_safetensors_pth_is_exact(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "start.pth")
    convert_checkpoint(tmp_path / "start.pth", tmp_path / "dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "mid.safetensors")
    summary = convert_checkpoint(tmp_path / "mid.safetensors", tmp_path / "end.pth")
    assert (summary.tensors, summary.source_format, summary.dest_format) == (len(state_dict), "safetensors", "torch")
    assert summary.bytes == sum(t.numel() * t.element_size() for t in state_dict.values())
    end = torch.load(tmp_path / "end.pth", weights_only=True)
    assert_same_tensors(end, state_dict)
    # torch's own reader agrees with what we wrote
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "torch_reads_ours.pth")
    assert_same_tensors(torch.load(tmp_path / "torch_reads_ours.pth", weights_only=True)["model"], state_dict)


def test_fabric_checkpoint_keeps_extras_where_the_target_can(tmp_path, state_dict, caplog):
    optimizer = make_optimizer_state(state_dict)
    torch.save({"model": state_dict, "optimizer": optimizer, "step": 3}, tmp_path / "fabric.ckpt")
    convert_checkpoint(tmp_path / "fabric.ckpt", tmp_path / "dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back.pth")
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert list(back) == ["model", "optimizer", "step"]
    assert_same_tensors(back["model"], state_dict)
    assert back["step"] == 3
    assert back["optimizer"]["param_groups"] == optimizer["param_groups"]
    assert torch.equal(back["optimizer"]["state"]["embed.weight"]["exp_avg"], torch.full((16, 8), 0.25))
    with caplog.at_level(logging.WARNING, logger="fabric_hsdp"):
        convert_checkpoint(tmp_path / "fabric.ckpt", tmp_path / "model.safetensors")
    assert "safetensors holds tensors only: writing the model and leaving out 'optimizer', 'step'" in caplog.text
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(state_dict)


def test_dtype_cast_and_key_map(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "a.pth")
    convert_checkpoint(
        tmp_path / "a.pth", tmp_path / "b.pth", dtype="bf16", key_map={"layers.0.": "blocks.0.", "mask": None}
    )
    out = torch.load(tmp_path / "b.pth", weights_only=True)
    assert "mask" not in out
    assert torch.equal(out["blocks.0.mlp.weight"], state_dict["layers.0.mlp.weight"].to(torch.bfloat16))
    assert out["embed.weight"].dtype == torch.bfloat16
    assert out["position_ids"].dtype == torch.int64  # integers are never cast
    assert out["bytes"].dtype == torch.uint8


def test_existing_dest_and_same_path_are_refused(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "a.pth")
    (tmp_path / "b.pth").write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        convert_checkpoint(tmp_path / "a.pth", tmp_path / "b.pth")
    assert (tmp_path / "b.pth").read_bytes() == b"keep"
    with pytest.raises(ValueError, match="same path"):
        convert_checkpoint(tmp_path / "a.pth", tmp_path / "a.pth", overwrite=True)
    convert_checkpoint(tmp_path / "a.pth", tmp_path / "b.pth", overwrite=True)
    assert_same_tensors(torch.load(tmp_path / "b.pth", weights_only=True), state_dict)


def test_inspect_reads_metadata_only(tmp_path, state_dict):
    optimizer = make_optimizer_state(state_dict)
    torch.save({"model": state_dict, "optimizer": optimizer, "step": 3}, tmp_path / "fabric.ckpt")
    convert_checkpoint(tmp_path / "fabric.ckpt", tmp_path / "dcp")
    info = inspect_checkpoint(tmp_path / "dcp", first=2)
    assert info["format"] == "dcp"
    assert info["tensors"] == 11
    assert info["parameters"] == sum(t.numel() for t in state_dict.values())
    assert info["bytes"] == sum(t.numel() * t.element_size() for t in state_dict.values())
    assert info["dtypes"] == {
        "float32": 5,
        "bfloat16": 1,
        "float16": 1,
        "int64": 1,
        "bool": 1,
        "uint8": 1,
        "float64": 1,
    }
    assert info["largest"] == {"name": "embed.weight", "shape": [16, 8], "dtype": "float32", "bytes": 512}
    assert info["first_keys"] == [
        {"name": "embed.weight", "shape": [16, 8], "dtype": "float32", "bytes": 512},
        {"name": "layers.0.attn.weight", "shape": [8, 8], "dtype": "bfloat16", "bytes": 128},
    ]
    optimizer_bytes = 3 * 4 + 16 * 8 * 4 + 8 * 8 * 4 + 12 * 8 * 4
    assert info["extras"] == {
        "optimizer": {"tensors": 6, "bytes": optimizer_bytes, "type": "dict"},
        "step": {"tensors": 0, "bytes": 0, "type": "int", "value": 3},
    }
    assert info["dcp"]["chunked_tensors"] == 0 and info["dcp"]["max_chunks"] == 1
    assert [entry["name"] for entry in info["dcp"]["files"]] == ["__0_0.distcp"]


def _tiny_llama(tmp_path, name="tiny-llama-test"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / name, max_shard_size="100KB")
    return model


def test_hugging_face_round_trip_through_dcp_loads_in_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    model = _tiny_llama(tmp_path, "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp")
    # a DCP directory holds no config: hf_config gives it (the model's directory, or its config.json)
    convert_checkpoint(
        tmp_path / "dcp", tmp_path / "hf2", to="safetensors", max_shard_size="50KB", hf_config=tmp_path / "hf"
    )
    shards = sorted(path.name for path in (tmp_path / "hf2").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    assert_same_tensors(reloaded.state_dict(), model.state_dict())
    tokens = torch.tensor([[1, 5, 9, 77, 3]])
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
    # without hf_config, a config.json inside the DCP directory (or next to it) is found and copied
    (tmp_path / "dcp" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    convert_checkpoint(tmp_path / "dcp", tmp_path / "hf4", to="safetensors")
    assert sorted(path.name for path in (tmp_path / "hf4").iterdir()) == ["config.json", "model.safetensors"]
    assert_same_tensors(LlamaForCausalLM.from_pretrained(tmp_path / "hf4").state_dict(), model.state_dict())
    # converting an HF directory straight to safetensors carries its config along
    convert_checkpoint(tmp_path / "hf", tmp_path / "hf3", to="safetensors")
    assert sorted(path.name for path in (tmp_path / "hf3").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_litgpt_converter_output_reads_correctly(tmp_path):
    import litgpt.config
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    litgpt.config.name_to_config["tiny-llama-test"] = dict(
        name="tiny-llama-test",
        block_size=64,
        vocab_size=128,
        padded_vocab_size=128,
        n_layer=2,
        n_head=4,
        n_embd=64,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=1e-5,
        mlp_class_name="LLaMAMLP",
        intermediate_size=160,
        n_query_groups=2,
    )
    model = _tiny_llama(tmp_path)
    convert_hf_checkpoint(tmp_path / "tiny-llama-test", model_name="tiny-llama-test")
    lit_file = tmp_path / "tiny-llama-test" / "lit_model.pth"
    expected = torch.load(lit_file, weights_only=True)
    with open_checkpoint(lit_file) as source:
        assert source.format == "torch"
        assert source.keys() == list(expected)
        assert_same_tensors({name: source.read(name) for name in source}, expected)
    hf = model.state_dict()
    assert torch.equal(expected["transformer.wte.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(expected["lm_head.weight"], hf["lm_head.weight"])


def test_index_keyed_optimizer_state_converts_to_dcp_with_a_warning(tmp_path, caplog):
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([parameter])
    parameter.grad = torch.full((3,), 0.5)
    optimizer.step()
    torch.save({"model": {"w": parameter.detach()}, "optimizer": optimizer.state_dict()}, tmp_path / "plain.ckpt")
    with caplog.at_level(logging.WARNING, logger="fabric_hsdp"):
        convert_checkpoint(tmp_path / "plain.ckpt", tmp_path / "dcp")
    assert "keyed by parameter index" in caplog.text
    with open_checkpoint(tmp_path / "dcp") as source:
        state = source.extras()["optimizer"]["state"]
    assert list(state) == ["0"]
    assert torch.equal(state["0"]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_dcp_to_hugging_face_directory_carries_no_dcp_files(tmp_path, state_dict, caplog):
    torch.save(state_dict, tmp_path / "model.pth")
    convert_checkpoint(tmp_path / "model.pth", tmp_path / "dcp")
    with caplog.at_level(logging.WARNING, logger="fabric_hsdp"):
        convert_checkpoint(tmp_path / "dcp", tmp_path / "hf", to="safetensors")
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    assert (
        f"'{tmp_path / 'hf'}' has no config.json (none in or next to '{tmp_path / 'dcp'}'), so transformers'"
        " from_pretrained cannot load it. Pass hf_config= (CLI: --hf_config PATH) the model's config.json or"
        f" directory, or copy its config.json into '{tmp_path / 'hf'}'"
    ) in caplog.text


def test_hf_config_is_checked_before_anything_is_read(tmp_path, state_dict):
    torch.save(state_dict, tmp_path / "model.pth")
    with pytest.raises(FileNotFoundError, match=f"hf_config '{tmp_path / 'nowhere'}' does not exist"):
        convert_checkpoint(tmp_path / "model.pth", tmp_path / "hf", to="safetensors", hf_config=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"hf_config '{tmp_path}' is a directory without config.json"):
        convert_checkpoint(tmp_path / "model.pth", tmp_path / "hf", to="safetensors", hf_config=tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="hf_config applies to a Hugging Face directory output"):
        convert_checkpoint(tmp_path / "model.pth", tmp_path / "out.pth", hf_config=tmp_path / "config.json")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "model.pth"]


@pytest.mark.parametrize("dest", ["out", "out.pth", "out.safetensors"])
def test_an_interrupt_inside_the_file_writer_stays_an_interrupt(tmp_path, state_dict, monkeypatch, dest):
    """Ctrl-C while torch's zip writer writes (DCP, torch files): its clean-up error must not replace the interrupt."""
    from fabric_hsdp.checkpoint.core import fileio

    torch.save({f"w{i}": torch.randn(64, 1024) for i in range(6)}, tmp_path / "in.pth")
    calls = []
    write = fileio.DirectFileWriter.write

    def interrupted_write(self, data):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return write(self, data)

    monkeypatch.setattr(fileio.DirectFileWriter, "write", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tmp_path / "in.pth", tmp_path / dest)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.pth"]


def test_progress_reaches_a_log_without_a_terminal(tmp_path, state_dict, monkeypatch, caplog):
    """In a batch log (no terminal) a long conversion logs bytes done, rate and time left; here every tensor."""
    from fabric_hsdp.checkpoint.core import progress
    from fabric_hsdp.units import format_binary_bytes

    torch.save(state_dict, tmp_path / "in.pth")
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)
    with caplog.at_level(logging.INFO, logger="fabric_hsdp"):
        convert_checkpoint(tmp_path / "in.pth", tmp_path / "out.safetensors")
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("converting in.pth -> out.safetensors")
    ]
    total = format_binary_bytes(sum(t.numel() * t.element_size() for t in state_dict.values()))
    assert len(lines) == len(state_dict)
    assert lines[-1].startswith(f"converting in.pth -> out.safetensors: {total} of {total} (100%), ")
    assert lines[-1].endswith(" 0 s left")
