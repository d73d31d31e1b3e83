"""``fabric-hsdp plan --lora_r`` (#33): the adapters the planner adds to a config's shapes are the ones peft and
litgpt make, and the plan's per-rank parameter, gradient and optimizer bytes are what the strategy holds."""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from fabric_hsdp.cli import main
from fabric_hsdp.planning import Training, Workload, load_model_shape, memory_per_device
from fabric_hsdp.planning.lora import with_lora
from tests.helpers.launch import launch
from tests.helpers.training import batch, hf_config, litgpt_config, logits_of, tiny_hf_llama

RANK = 4


def peft_model(targets: object = "all-linear") -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_hf_llama(), LoraConfig(r=RANK, lora_alpha=8, target_modules=targets))


def trainable_shapes(shape) -> dict[str, tuple[int, ...]]:
    return {p.name: p.shape for p in shape.parameters if p.trainable}


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj", "down_proj"]])
def test_adapters_of_a_transformers_config_are_peft_s_own(tmp_path, targets):
    hf_config().save_pretrained(tmp_path)
    base = load_model_shape(tmp_path)
    planned = with_lora(base, RANK, targets)
    model = peft_model("all-linear" if targets is None else targets)
    trainable, total = model.get_nb_trainable_parameters()
    made = {  # peft's names, without its prefix and adapter name
        name.removeprefix("base_model.model.").replace(".default.weight", ""): tuple(p.shape)
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    assert trainable_shapes(planned) == made
    assert sum(p.numel for p in planned.parameters if p.trainable) == trainable
    assert planned.num_parameters == total and base.num_parameters == total - trainable
    assert f"LoRA r={RANK}" in planned.summary() and "trainable" in planned.summary()


def test_adapters_of_a_litgpt_config_are_litgpt_s_own_fused_qkv_included(tmp_path):
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    from litgpt.utils import save_config

    from examples.finetune import lora_settings

    save_config(litgpt_config(), tmp_path)
    planned = with_lora(load_model_shape(tmp_path / "model_config.yaml"), RANK)
    base = litgpt_config()
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__ if name != "rope_n_elem"}
    model = GPT(Config(**fields, **lora_settings(RANK, 8)))  # what examples/finetune.py --lora_r trains
    mark_only_lora_as_trainable(model)
    made = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    assert trainable_shapes(planned) == made  # one lora_A of 3r rows on each fused qkv
    assert planned.num_parameters == sum(p.numel() for p in model.parameters())


def lora_shards(num_nodes: int, devices: int) -> dict:
    """One AdamW step of peft's all-linear LoRA (r=4) under bf16-mixed: the bytes each rank holds."""
    from torch.distributed.tensor import DTensor

    from tests.helpers.training import make_fabric

    def local_bytes(tensors) -> int:
        locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in locals_)

    fabric = make_fabric(num_nodes, devices, precision="bf16-mixed")
    with fabric.init_module(empty_init=True):
        model = peft_model()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    inputs, targets = batch(2, seed=3)
    logits = logits_of(model, inputs)
    fabric.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))
    gradients = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    return {
        "parameters": local_bytes(model.parameters()),
        "gradients": gradients,
        "optimizer": local_bytes(value for state in optimizer.state.values() for value in state.values()),
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_lora_plan_holds_what_the_strategy_measures_per_rank(tmp_path):
    hf_config().save_pretrained(tmp_path)
    base = load_model_shape(tmp_path)
    training = Training("bf16-mixed", Workload(optimizer="adamw"))
    planned = memory_per_device(with_lora(base, RANK), training, 2, 1)
    full = memory_per_device(base, training, 2, 1)
    measured = launch(lora_shards, num_nodes=1, ranks_per_node=2, timeout=200)
    for rank in measured.check().values:
        assert (rank["parameters"], rank["gradients"], rank["optimizer"]) == (
            planned.parameters,
            planned.gradients,
            planned.optimizer,
        )
    trainable, total = peft_model().get_nb_trainable_parameters()
    # per rank half of every tensor (all dim 0 even): fp32 gradients of the adapters only, not of the base
    assert planned.gradients == 4 * trainable // 2 and full.gradients == 4 * (total - trainable) // 2
    print(f"per rank: gradients {planned.gradients} bytes (full fine-tune {full.gradients}), optimizer"
          f" {planned.optimizer} ({full.optimizer}), parameters {planned.parameters} ({full.parameters})")  # fmt: skip


def test_plan_command_with_lora_r_skips_tensor_parallel_layouts_as_the_strategy_refuses_them(tmp_path, capsys):
    hf_config().save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--num_nodes", "1", "--devices_per_node", "2", "--json", "--lora_r", str(RANK)]
    assert main(args) == 0
    document = json.loads(capsys.readouterr().out)
    assert [entry["tensor_parallel_size"] for entry in document["layouts"]] == [1, 1]
    assert "does not support LoRA models under tensor parallelism" in json.dumps(document["skipped"])
    assert main([*args[:-2], "--lora_targets", "[q_proj]"]) == 2
    assert "pass --lora_r R with it" in capsys.readouterr().err
    assert main([*args, "--lora_targets", "[wq]"]) == 2
    err = capsys.readouterr().err
    assert "match no linear layer" in err and "'q_proj'" in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plan_verify_with_lora_r_dry_runs_the_lora_model(tmp_path, capsys):
    hf_config().save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--num_nodes", "1", "--devices_per_node", "2", "--device_memory", "1GB"]
    args += ["--precision", "bf16-mixed", "--seq_len", "16", "--lora_r", str(RANK), "--verify", "--json"]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    document = json.loads(out[out.index("{") :])
    (recommended,) = [row for row in document["layouts"] if row["recommended"]]
    # rank 0's measured shards: the base in bf16, the adapters in fp32 (a full fine-tune would hold all in fp32)
    assert document["verify"]["local_parameter_bytes"] == recommended["bytes_per_device"]["parameters"]
    trainable, total = peft_model().get_nb_trainable_parameters()
    shards = recommended["shard_size"]  # every dim 0 of this model is even
    assert recommended["bytes_per_device"]["parameters"] == (4 * trainable + 2 * (total - trainable)) // shards


def test_the_70b_lora_plan_in_the_docs_is_the_tools_output(capsys):
    text = (Path(__file__).resolve().parents[2] / "docs" / "loading.md").read_text()
    blocks = re.findall(r"```\n\$ fabric-hsdp (plan [^\n]*)\n(.*?)\n```", text, re.S)
    assert len(blocks) == 2 and "--lora_r 16" in blocks[1][0]
    for command, shown in blocks:
        main(shlex.split(command))
        captured = capsys.readouterr()
        printed = (captured.out + captured.err).splitlines()
        for line in shown.splitlines():
            assert line.startswith("[...") or line in printed, (command, line)


@pytest.mark.parametrize("tied", [False, True])
def test_a_frozen_base_needs_no_weight_gradients_in_the_flops(tmp_path, tied):
    """Forward, input gradients and weight gradients take 2 FLOPs each per weight and token; a frozen weight has no
    weight gradient: 4, not 6 (the step-time estimate of a LoRA plan). Counted here by hand from the shapes."""
    import math

    from fabric_hsdp.planning.throughput import flops_per_token

    config = hf_config()
    config.tie_word_embeddings = tied
    config.save_pretrained(tmp_path)
    base = load_model_shape(tmp_path)
    planned = with_lora(base, RANK)
    weights = [p for p in base.parameters if len(p.shape) == 2 and "embed_tokens" not in p.name]
    matmul = sum(math.prod(p.shape) for p in weights) + (config.vocab_size * config.hidden_size if tied else 0)
    adapters = sum(math.prod(p.shape) for p in planned.parameters if p.trainable)
    training = Training(workload=Workload(1, 64))
    (full, _), (lora, _) = flops_per_token(base, training), flops_per_token(planned, training)
    assert full - lora == 6 * matmul - (4 * matmul + 6 * adapters)
