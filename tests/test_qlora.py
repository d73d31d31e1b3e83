"""QLoRA (#33): a bitsandbytes-quantized base is refused at ``setup_module`` with the reason and what works.

bitsandbytes is not installed here: the layers are fakes named as bitsandbytes names its classes (the strategy finds
them by class name). benchmarks/gpu_check.py's "qlora" check builds a real one on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.launch import launch


class Params4bit(nn.Parameter):
    """Named as ``bitsandbytes.nn.Params4bit``: packed 4-bit weights, frozen."""


class Linear8bitLt(nn.Linear):
    """Named as ``bitsandbytes.nn.Linear8bitLt``."""


def quantized_model() -> nn.Module:
    """A tiny model whose second layer holds a 4-bit base weight, as a QLoRA model's base layers do."""
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # one FSDP unit each, the strategy's default
    model.layers[1].weight = Params4bit(torch.zeros(32, 1, dtype=torch.uint8), requires_grad=False)
    return model


def set_up_quantized(num_nodes: int, devices: int) -> dict:
    from tests.helpers.training import make_fabric

    fabric = make_fabric(num_nodes, devices, precision="bf16-mixed")
    try:
        fabric.setup_module(quantized_model())
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_4bit_base_is_refused_on_cpu_on_every_rank_with_the_reason_and_what_works():
    result = launch(set_up_quantized, num_nodes=1, ranks_per_node=2, timeout=150).check()
    for facts in result.values:
        error = facts["error"]
        assert error is not None and error.startswith("ValueError: 'layers.1' (Linear with a Params4bit 'weight')"), (
            error
        )
        assert "this run is on CPU, and bitsandbytes' quantized training is made for a CUDA GPU" in error
        assert "precision='bf16-mixed'" in error and "bf16 shards only" in error


def test_a_quantized_base_is_refused_on_cuda_too_as_not_supported_yet():
    from fabric_hsdp.adapters.quantized import refuse_quantized_base

    with pytest.raises(
        ValueError, match=r"^'layers.1' \(Linear with a Params4bit 'weight'\) is a bitsandbytes 4-bit"
    ) as info:
        refuse_quantized_base(quantized_model(), torch.device("cuda", 0))
    assert "HybridFSDPStrategy does not support quantized bases yet" in str(info.value)
    assert "CPU" not in str(info.value)
    eight_bit = nn.Sequential(nn.Linear(8, 8), Linear8bitLt(8, 8))
    with pytest.raises(ValueError, match=r"'1' \(Linear8bitLt\) is a bitsandbytes 8-bit layer"):
        refuse_quantized_base(eight_bit, torch.device("cuda", 0))
    refuse_quantized_base(nn.Sequential(nn.Linear(8, 8)), torch.device("cpu"))  # a plain model: nothing to refuse
