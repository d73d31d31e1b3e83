"""Model sources: transformers configs (with and without transformers), litgpt configs, checkpoint headers."""

import builtins
import json

import pytest
import torch
from safetensors.torch import save_file

from fabric_hsdp.planning import load_model_shape, model_shape_of_module
from fabric_hsdp.planning.sources import _llama_family_shapes
from tests.helpers.training import hf_config, litgpt_config, tiny_hf_llama


def shapes(model):
    return sorted((parameter.name, parameter.shape) for parameter in model.parameters)


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("LlamaConfig", {}),
        ("LlamaConfig", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "head_dim": 32}),
        ("MistralConfig", {}),
        ("Qwen2Config", {"tie_word_embeddings": True}),
    ],
)
def test_built_in_reader_writes_what_transformers_builds(kind, extra):
    import transformers

    config = getattr(transformers, kind)(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, **extra,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sorted((name, tuple(parameter.shape)) for name, parameter in model.named_parameters())
    assert sorted(_llama_family_shapes(config.to_dict())) == expected


@pytest.fixture
def hf_directory(tmp_path):
    hf_config().save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture
def hf_reference():
    with torch.device("meta"):
        return shapes(model_shape_of_module(tiny_hf_llama()))


def test_transformers_config_directory_and_file(hf_directory, hf_reference):
    model = load_model_shape(hf_directory)
    assert model.description == f"LlamaForCausalLM from {hf_directory / 'config.json'}"
    assert shapes(model) == hf_reference
    assert load_model_shape(hf_directory / "config.json").parameters == model.parameters
    dims = model.dims
    assert (dims.hidden_size, dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim) == (64, 2, 4, 2, 16)
    assert (dims.intermediate_size, dims.vocab_size, dims.kv_size) == (96, 256, 32)


@pytest.fixture
def without_transformers(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("no transformers here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("fabric_hsdp.planning.sources._installed", lambda module: module != "transformers")
    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_llama_config_without_transformers(hf_directory, hf_reference, without_transformers):
    model = load_model_shape(hf_directory)
    assert model.description == f"llama from {hf_directory / 'config.json'}"
    assert shapes(model) == hf_reference


def test_built_in_reader_splits_what_transformers_plan_splits(hf_directory, monkeypatch):
    with_transformers = load_model_shape(hf_directory)
    monkeypatch.setattr("fabric_hsdp.planning.sources._installed", lambda module: module != "transformers")
    built_in = load_model_shape(hf_directory)
    assert with_transformers.tensor_parallel_source == built_in.tensor_parallel_source
    assert (
        with_transformers.tensor_parallel_heads
        == built_in.tensor_parallel_heads
        == {
            "config.num_attention_heads": 4,
            "config.num_key_value_heads": 2,
        }
    )
    split = {p.name: p.tensor_parallel_dim for p in with_transformers.parameters}
    assert split == {p.name: p.tensor_parallel_dim for p in built_in.parameters}
    assert split["model.embed_tokens.weight"] is None and split["lm_head.weight"] == 0
    assert split["model.layers.0.self_attn.o_proj.weight"] == 1 and split["model.layers.0.mlp.up_proj.weight"] == 0


def test_other_model_type_without_transformers_names_what_was_tried(tmp_path, without_transformers):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 64}))
    with pytest.raises(ImportError) as caught:
        load_model_shape(tmp_path)
    message = str(caught.value)
    assert "transformers (not installed; needed for model_type 'gpt_neox')" in message
    assert "the built-in reader (only llama, mistral, qwen2)" in message
    assert "a checkpoint (" in message and "pip install transformers" in message


def test_other_model_type_without_transformers_falls_back_to_the_weights_next_to_it(tmp_path, without_transformers):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "num_attention_heads": 4}))
    save_file({"gpt_neox.layers.0.mlp.dense_h_to_4h.weight": torch.zeros(256, 64)}, tmp_path / "model.safetensors")
    model = load_model_shape(tmp_path)
    assert model.description.startswith("hf-safetensors checkpoint")
    assert model.dims.num_heads == 4  # from the config.json next to the weights


def test_litgpt_name_and_file(tmp_path):
    from litgpt.model import GPT
    from litgpt.utils import save_config

    save_config(litgpt_config(), tmp_path)  # model_config.yaml, as litgpt writes it next to lit_model.pth
    with torch.device("meta"):
        reference = model_shape_of_module(GPT(litgpt_config()))
    model = load_model_shape(tmp_path)
    assert shapes(model) == shapes(reference)
    assert (model.dims.num_heads, model.dims.num_kv_heads, model.dims.vocab_size) == (4, 2, 256)
    named = load_model_shape("pythia-14m")
    assert named.description == "litgpt pythia-14m" and named.dims.num_layers == 6


def test_checkpoint_header_gives_shapes_without_reading_data(tmp_path, hf_reference, monkeypatch):
    state = {name: tensor.to(torch.bfloat16) for name, tensor in tiny_hf_llama().state_dict().items()}
    save_file(state, tmp_path / "weights.safetensors")

    def no_reading(*args, **kwargs):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr("fabric_hsdp.checkpoint.formats.source.CheckpointSource.read", no_reading)
    monkeypatch.setattr("fabric_hsdp.checkpoint.formats.source.CheckpointSource.read_slice", no_reading)
    planned = load_model_shape(tmp_path / "weights.safetensors")
    assert shapes(planned) == hf_reference
    # dims from shapes alone: embedding [256, 64], down projection [64, 96]; heads unknown
    dims = planned.dims
    assert (dims.vocab_size, dims.hidden_size, dims.intermediate_size, dims.num_layers) == (256, 64, 96, 2)
    assert dims.num_heads is None and dims.kv_size == 64


def test_unknown_name_says_what_was_tried():
    with pytest.raises(ValueError) as caught:
        load_model_shape("no-such-model-anywhere")
    message = str(caught.value)
    assert "tried a file or directory 'no-such-model-anywhere' (none) and a litgpt config name" in message
    with pytest.raises(FileNotFoundError, match="model source 'missing/config.json' does not exist"):
        load_model_shape("missing/config.json")


def test_a_file_that_is_no_model_says_what_was_tried(tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(ValueError) as caught:
        load_model_shape(junk)
    assert f"cannot read model source '{junk}': tried a checkpoint (" in str(caught.value)
