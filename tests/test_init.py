"""Initialising meta-built models into their shards: seeding by where the shards live, transformers' own init."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import fabric_hsdp.setup.pipeline
from tests.helpers.launch import launch, launch_cases
from tests.helpers.training import VOCAB, hf_config, make_fabric


def test_shards_in_cpu_memory_under_a_cuda_root_device_get_their_own_random_values():
    # CPU offload on CUDA: the mesh and root device are CUDA's, the shards live in CPU memory (stood in on gloo)
    for facts in launch(seeding_on_offloaded_shards, num_nodes=1).check().values:
        assert facts["local_device"] == "cpu"
        assert facts["parts_differ"], facts
        # nn.Linear's kaiming-uniform init of a [96, 64] weight: std = 1/sqrt(3 * 64)
        assert facts["std"] == pytest.approx(64**-0.5 / 3**0.5, rel=0.1)


TENSOR_PARALLEL_SIZES = [1, 2]


@pytest.fixture(scope="module")
def initialized() -> dict[str, list[dict[str, Any]]]:
    """The facts of each tensor_parallel_size, per rank, both from one launch."""
    cases = {str(size): {"tensor_parallel_size": size} for size in TENSOR_PARALLEL_SIZES}
    return launch_cases(transformers_init, cases, timeout=240)


@pytest.mark.parametrize("tensor_parallel_size", TENSOR_PARALLEL_SIZES)
def test_transformers_models_get_their_own_init_not_torch_defaults(initialized, tensor_parallel_size):
    facts = initialized[str(tensor_parallel_size)][0]
    sharded, reference = facts["sharded"], facts["from_config"]
    assert sharded.keys() == reference.keys()
    for name, expected in reference.items():
        got = sharded[name]
        if expected["all_ones"]:  # norms
            assert got["all_ones"], (name, got)
            continue
        # normal(0, 0.02) over >= 4,096 values: the std estimate is within ~2 %
        assert expected["std"] == pytest.approx(0.02, rel=0.05), (name, expected)
        assert got["std"] == pytest.approx(expected["std"], rel=0.05), (name, got, expected, facts["placements"][name])
        if "padding_row_zero" in expected:
            assert expected["padding_row_zero"] and got["padding_row_zero"], (name, got)
            assert got["other_rows_std"] == pytest.approx(0.02, rel=0.05), (name, got)


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# Initialising meta-built models into their shards: the seeding by shard device, transformers' init.


def seeding_on_offloaded_shards(num_nodes: int, devices: int) -> dict[str, Any]:
    """CPU offload on CUDA, stood in for: the root device says "cuda" but the shards land in CPU memory.

    Every rank has the same CPU generator (one seed), so shard peers differ only if materialize seeds each part of
    the model copy by where its shard lives.
    """
    fabric = make_fabric(num_nodes, devices, sharded_modules={nn.Linear})
    materialize, to_empty = fabric_hsdp.setup.pipeline.materialize_local_shards, nn.Module.to_empty

    def materialize_as_on_cuda(module: nn.Module, device: torch.device, position: int) -> None:
        materialize(module, torch.device("cuda"), position)

    def to_empty_in_cpu_memory(module: nn.Module, *, device: Any, recurse: bool = True) -> nn.Module:
        return to_empty(module, device="cpu", recurse=recurse)  # what FSDP2's CPUOffloadPolicy does to the shards

    torch.manual_seed(7)
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64))
    with (
        mock.patch.object(fabric_hsdp.setup.pipeline, "materialize_local_shards", materialize_as_on_cuda),
        mock.patch.object(nn.Module, "to_empty", to_empty_in_cpu_memory),
    ):
        model = fabric.setup_module(model)
    weight = model.module[0].weight  # [96, 64]
    full = weight.full_tensor()
    rows = 96 // devices
    parts = [full[i * rows : (i + 1) * rows] for i in range(devices)]
    return {
        "local_device": str(weight.to_local().device),
        "parts_differ": all(not torch.equal(parts[0], part) for part in parts[1:]),
        "std": full.std().item(),
    }


def _statistics(named: dict[str, torch.Tensor], padding_idx: int) -> dict[str, dict[str, Any]]:
    facts = {}
    for name, tensor in named.items():
        tensor = tensor.detach().float()
        facts[name] = {"std": tensor.std().item(), "all_ones": bool((tensor == 1).all()), "numel": tensor.numel()}
        if name.endswith("embed_tokens.weight"):
            facts[name]["padding_row_zero"] = bool((tensor[padding_idx] == 0).all())
            facts[name]["other_rows_std"] = torch.cat([tensor[:padding_idx], tensor[padding_idx + 1 :]]).std().item()
    return facts


def transformers_init(num_nodes: int, devices: int, tensor_parallel_size: int) -> dict[str, Any]:
    """A transformers Llama built on meta and set up: each tensor's statistics, and those ``from_config`` gives."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = hf_config()
    config.pad_token_id = 3
    config.initializer_range = 0.02
    fabric = make_fabric(
        num_nodes, devices, sharded_modules={LlamaDecoderLayer}, tensor_parallel_size=tensor_parallel_size
    )
    fabric.seed_everything(100 + fabric.global_rank)  # per-rank seeds, as users write
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(config)
    model = fabric.setup_module(model)
    full = {name: param.full_tensor() for name, param in model.module.named_parameters()}
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    assert config.vocab_size == VOCAB
    return {
        "sharded": _statistics(full, config.pad_token_id),
        "from_config": _statistics(dict(reference.named_parameters()), config.pad_token_id),
        "placements": {name: str(p.placements) for name, p in model.module.named_parameters()},
    }
