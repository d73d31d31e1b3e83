from collections.abc import Mapping

import pytest
import torch


def make_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small tensors covering the dtypes, shapes and layouts a checkpoint can hold."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(40, generator=generator)
    return {
        "embed.weight": torch.randn(16, 8, generator=generator),
        "layers.0.attn.weight": torch.randn(8, 8, generator=generator).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(12, 8, generator=generator).to(torch.float16),
        "layers.0.mlp.weight_t": torch.randn(8, 12, generator=generator).t(),  # non-contiguous
        "layers.0.view": base[10:18],  # a view with a storage offset
        "layers.0.norm.weight": torch.ones(8),
        "position_ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "scale": torch.tensor(0.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
    }


def make_optimizer_state(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """An optimizer state keyed by parameter name, like ``get_optimizer_state_dict`` gives (Lightning's layout)."""
    names = [name for name, tensor in state_dict.items() if tensor.is_floating_point() and tensor.numel()][:3]
    return {
        "state": {
            name: {"exp_avg": torch.full_like(state_dict[name].float(), 0.25), "step": torch.tensor(4.0)}
            for name in names
        },
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": names}],
    }


def assert_same_tensors(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].device.type == "cpu", name
        assert torch.equal(actual[name], tensor), name


@pytest.fixture
def state_dict() -> dict[str, torch.Tensor]:
    return make_state_dict()
