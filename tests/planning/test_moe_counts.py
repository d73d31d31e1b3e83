"""The planner counts a mixture-of-experts model's parameters in total and those one token passes through (#32)."""

from __future__ import annotations

import math

import pytest
import torch

from fabric_hsdp.planning.model import model_shape_of_module
from tests.helpers import moe


@pytest.mark.parametrize("kind", moe.KINDS)
def test_total_and_active_parameters_of_a_moe_model(kind):
    with torch.device("meta"):
        model = moe.build(kind)
    shape = model_shape_of_module(model)
    named = {name: math.prod(p.shape) for name, p in model.named_parameters()}
    experts = sum(numel for name, numel in named.items() if ".experts." in name)
    assert experts > 0
    assert shape.num_parameters == sum(named.values())
    # top-2 of 4 experts: half of the experts' parameters, all of the rest
    assert shape.active_parameters == sum(named.values()) - experts // 2
    assert f"{shape.active_parameters / 1e6:.2f} M active per token" in shape.summary()


def test_a_dense_model_has_no_active_count():
    from tests.helpers.training import tiny_hf_llama

    shape = model_shape_of_module(tiny_hf_llama())
    assert shape.active_parameters is None and "active" not in shape.summary()
