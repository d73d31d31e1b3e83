"""A checkpoint that does not fit the model (#44): the load fails, and its message says why and what to do.

Tried as a new user would: an adapter-only LoRA checkpoint loaded into the full model with ``strict=False`` (as the
error had suggested) changed 0 of 27 tensors and returned ``{'step': 2}``; with the optimizer, torch's traceback on
every rank. Another model's hub directory, an adapter file or another vocabulary size each ended with "Pass
strict=False to skip them". Each checkpoint here is written by its library's own saver.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from fabric_hsdp.checkpoint.training.raw_load import load_into_model
from fabric_hsdp.errors import CheckpointError
from tests.helpers.launch import launch
from tests.helpers.training import hf_config, tiny_hf_llama, tiny_litgpt

GENERIC_HINT = "Pass strict=False to skip them"


def _load_error(path: Path, model: torch.nn.Module, strict: bool = True) -> str:
    with pytest.raises(CheckpointError) as raised:
        load_into_model(path, model, strict=strict)
    return " ".join(str(raised.value).split())


def _qwen2(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = {k: v for k, v in hf_config().to_dict().items() if k in ("vocab_size", "hidden_size", "intermediate_size")}
    config = Qwen2Config(**fields, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def test_another_models_hub_directory_is_named_as_another_model(tmp_path):
    _qwen2().save_pretrained(tmp_path / "qwen2")
    message = _load_error(tmp_path / "qwen2", tiny_hf_llama())
    assert "another model" in message and "model_type 'qwen2'" in message and "'llama'" in message, message
    assert str(tmp_path / "qwen2" / "config.json") in message and GENERIC_HINT not in message, message


def test_another_moe_familys_hub_directory_is_named_as_another_model(tmp_path):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from tests.helpers import moe

    config = OlmoeConfig(
        vocab_size=moe.VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=moe.SEQ,
    )  # fmt: skip
    OlmoeForCausalLM(config).save_pretrained(tmp_path / "olmoe")
    message = _load_error(tmp_path / "olmoe", moe.build("qwen3_moe"))
    assert "model_type 'olmoe'" in message and "'qwen3_moe'" in message and GENERIC_HINT not in message, message


def test_a_checkpoint_of_another_vocabulary_size_names_the_config_field(tmp_path):
    config = hf_config()
    config.vocab_size = 320
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(config).save_pretrained(tmp_path / "bigger")
    message = _load_error(tmp_path / "bigger", tiny_hf_llama())
    assert "another config" in message and "vocab_size 320 (the model: 256)" in message, message
    assert GENERIC_HINT not in message, message
    # litgpt's lit_model.pth alone (no config beside it): the size that differs, and the model's fields holding it
    bigger = tiny_litgpt()
    bigger.transformer.wte = torch.nn.Embedding(320, 64)
    bigger.lm_head = torch.nn.Linear(64, 320, bias=False)
    (tmp_path / "lit").mkdir()
    torch.save(bigger.state_dict(), tmp_path / "lit" / "lit_model.pth")
    message = _load_error(tmp_path / "lit" / "lit_model.pth", tiny_litgpt())
    assert "have 256 (the model's vocab_size and padded_vocab_size) where the checkpoint's have 320" in message
    assert GENERIC_HINT not in message, message


def test_a_peft_adapter_file_into_the_base_model_is_named_adapter_only_and_loads_nothing_even_if_not_strict(tmp_path):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_hf_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter")  # peft's own adapter_model.safetensors
    adapter_file = tmp_path / "adapter" / "adapter_model.safetensors"
    model = tiny_hf_llama(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        message = _load_error(adapter_file, model, strict=strict)
        assert "LoRA adapters only" in message and "get_peft_model" in message, message
        assert GENERIC_HINT not in message, message
    assert message.startswith(f"No tensor of checkpoint '{adapter_file}' fits the model"), message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def adapter_only_into_the_full_model(num_nodes: int, devices: int, out: str) -> dict:
    """An adapter-only sharded checkpoint (``fabric.save(filter=)`` of a peft model after a step), loaded into the
    full model with and without ``strict`` and the optimizer: what each load raised, or what it changed. And what
    the adapter helpers see on the module ``setup_module`` returned (they saw nothing: its names carry
    ``_forward_module.``)."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers.training import batch, full_state, make_fabric

    fabric = make_fabric(num_nodes, devices)
    inputs, targets = batch(4)

    def one_step(model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
        logits = model(inputs).logits
        fabric.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        optimizer.step()
        return optimizer

    lora = fabric.setup_module(get_peft_model(tiny_hf_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))
    state = {"model": lora, "optimizer": one_step(lora), "step": 2}
    adapters_only = {"model": lambda name, _: "lora_" in name}
    fabric.save(Path(out) / "adapter", state, filter=adapters_only)
    model = fabric.setup_module(tiny_hf_llama(seed=1))
    optimizer = one_step(model)
    before = full_state(model)
    said = {}
    for case, strict, keys in (
        ("model, strict=False", False, ("model",)),
        ("model and optimizer, strict=False", False, ("model", "optimizer")),
        ("model and optimizer", True, ("model", "optimizer")),
    ):
        wanted = {"model": model, "optimizer": optimizer, "step": 0}
        try:
            fabric.load(Path(out) / "adapter", {key: wanted[key] for key in keys}, strict=strict)
            changed = sum(not torch.equal(before[k], v) for k, v in full_state(model).items())
            said[case] = f"loaded: {changed} of {len(before)} tensors changed"
        except Exception as error:  # noqa: BLE001 - what the user sees is what the test checks
            said[case] = f"{type(error).__name__}: {' '.join(str(error).split())}"
    try:  # a filter that keeps nothing of the model: the model has no adapters
        fabric.save(
            Path(out) / "nothing", {"model": model, "step": 2}, filter={"model": lambda name, _: "lora_" in name}
        )
        said["save with a filter that keeps nothing"] = "saved"
    except Exception as error:  # noqa: BLE001
        said["save with a filter that keeps nothing"] = f"{type(error).__name__}: {' '.join(str(error).split())}"
    said["written"] = sorted(path.name for path in Path(out).iterdir())
    # the adapter-only checkpoint into the LoRA model it was saved from: loaded, and the skipped base named once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(Path(out) / "adapter", {"model": lora}, strict=False)
    said["adapter-only into its LoRA model"] = [str(w.message) for w in caught if "Loaded" in str(w.message)]
    from fabric_hsdp.adapters import adapter_keys, base_names

    helpers = {"adapter_keys": adapter_keys(lora), "base_names": base_names(lora)}
    inside = {"adapter_keys": adapter_keys(lora.module), "base_names": base_names(lora.module)}
    return {"loads": said, "helpers on Fabric's module": helpers, "helpers on the module inside": inside}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_adapter_only_checkpoint_into_the_full_model_fails_with_why_and_adapter_helpers_see_fabrics_module(tmp_path):
    said = launch(adapter_only_into_the_full_model, {"out": str(tmp_path)}, num_nodes=1, timeout=200).check().values
    said_on_rank = [values["loads"].pop("adapter-only into its LoRA model") for values in said]
    assert said_on_rank[1] == [] and len(said_on_rank[0]) == 1, said_on_rank  # once, by rank 0
    loaded = f"Loaded 8 of the model's 29 tensors from '{tmp_path / 'adapter'}' (strict=False): 21 not in it keep"
    assert said_on_rank[0][0].startswith(loaded) and said_on_rank[0][0].endswith("'])."), said_on_rank
    assert said[0] == said[1]  # every rank fails alike
    helpers, inside = said[0]["helpers on Fabric's module"], said[0]["helpers on the module inside"]
    assert helpers == inside and len(helpers["adapter_keys"]) == 8, helpers  # r=4 A and B on q and v, 2 layers
    assert helpers["base_names"]["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    loads = said[0]["loads"]
    assert loads.pop("written") == ["adapter"]  # nothing written at the path of the save refused
    refused = loads.pop("save with a filter that keeps nothing")
    assert refused.startswith("ValueError: fabric.save(filter={'model': ...}) keeps none of the model's"), refused
    for case, line in loads.items():
        assert line.startswith("CheckpointError: "), (case, line)
        assert "LoRA adapters only" in line and "get_peft_model" in line, (case, line)
        assert GENERIC_HINT not in line and "pass strict=False" not in line, (case, line)
    assert "fits the model" in loads["model, strict=False"]
    assert "fits the model" in loads["model and optimizer, strict=False"]


def _olmoe() -> torch.nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from tests.helpers import moe

    config = OlmoeConfig(
        vocab_size=moe.VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=moe.SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    return OlmoeForCausalLM(config)


def test_convert_refuses_a_config_of_another_model_and_says_which_layout_it_writes(tmp_path, caplog):
    """An OLMoE checkpoint in the model's layout (fused experts, as a sharded save holds it) exported with Mistral's
    config exited 0, and from_pretrained built a Mistral with 6 weights at random init; without a config the fused
    layout was written silently."""
    import logging

    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    from fabric_hsdp.checkpoint import convert_checkpoint

    olmoe = _olmoe()
    olmoe.save_pretrained(tmp_path / "olmoe-hub")
    torch.save(olmoe.state_dict(), tmp_path / "olmoe.pth")
    convert_checkpoint(tmp_path / "olmoe.pth", tmp_path / "olmoe-dcp")
    fields = {k: v for k, v in hf_config().to_dict().items() if k in ("vocab_size", "hidden_size", "intermediate_size")}
    MistralForCausalLM(MistralConfig(**fields, num_hidden_layers=2, num_attention_heads=4)).save_pretrained(
        tmp_path / "mistral"
    )
    with pytest.raises(CheckpointError) as raised:
        convert_checkpoint(tmp_path / "olmoe-dcp", tmp_path / "out", to="safetensors", hf_config=tmp_path / "mistral")
    message = " ".join(str(raised.value).split())
    assert message.startswith(f"config '{tmp_path / 'mistral' / 'config.json'}' (model_type 'mistral'"), message
    assert "does not describe the checkpoint's tensors" in message, message
    assert "'model.layers.0.mlp.gate.weight'" in message, message  # OLMoE's router, which Mistral lacks
    assert not (tmp_path / "out").exists()
    # the same checkpoint, another vocabulary size in the config: the field is named
    config = _olmoe().config
    config.vocab_size = 320
    config.save_pretrained(tmp_path / "olmoe-320")
    with pytest.raises(
        CheckpointError, match=r"its tensors have 320 \(the model's vocab_size\) where the checkpoint's"
    ):
        convert_checkpoint(tmp_path / "olmoe-dcp", tmp_path / "out", to="safetensors", hf_config=tmp_path / "olmoe-320")
    # without a config: written in transformers' fused layout, and said so
    with caplog.at_level(logging.INFO, logger="fabric_hsdp"):
        convert_checkpoint(tmp_path / "olmoe-dcp", tmp_path / "fused", to="safetensors")
    assert "with fused experts ('model.layers.0.mlp.experts.gate_up_proj')" in caplog.text, caplog.text
    # its own config: the hub's layout, said so, and from_pretrained finds every weight
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fabric_hsdp"):
        convert_checkpoint(tmp_path / "olmoe-dcp", tmp_path / "hub", to="safetensors", hf_config=tmp_path / "olmoe-hub")
    assert "writing the hub's layout" in caplog.text, caplog.text
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hub", output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info


def test_convert_refuses_a_key_map_that_drops_every_tensor(tmp_path):
    """It wrote an output of 0 tensors and said "converted 0 tensors"."""
    from fabric_hsdp.checkpoint import convert_checkpoint

    torch.save(tiny_litgpt().state_dict(), tmp_path / "lit_model.pth")
    with pytest.raises(ValueError, match=r"key_map=\['!transformer\.', '!lm_head\.'\] drops all 17 model tensors"):
        convert_checkpoint(tmp_path / "lit_model.pth", tmp_path / "out.pth", key_map=["!transformer.", "!lm_head."])
    assert not (tmp_path / "out.pth").exists()
