"""Initialising meta-built models into their shards: seeding by where the shards live, transformers' own init."""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch


def test_shards_in_cpu_memory_under_a_cuda_root_device_get_their_own_random_values():
    # CPU offload on CUDA: the mesh and root device are CUDA's, the shards live in CPU memory (stood in on gloo)
    for facts in launch("tests.scenarios.init:seeding_on_offloaded_shards", num_nodes=1).check().values:
        assert facts["local_device"] == "cpu"
        assert facts["parts_differ"], facts
        # nn.Linear's kaiming-uniform init of a [96, 64] weight: std = 1/sqrt(3 * 64)
        assert facts["std"] == pytest.approx(64**-0.5 / 3**0.5, rel=0.1)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_transformers_models_get_their_own_init_not_torch_defaults(tensor_parallel_size):
    result = launch("tests.scenarios.init:transformers_init", {"tensor_parallel_size": tensor_parallel_size})
    facts = result.check().values[0]
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
