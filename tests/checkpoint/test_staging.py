"""Background-save staging: only the chunks a rank writes are copied, into buffers kept across saves."""

import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.launch import launch

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_stager_copies_what_this_rank_writes_and_the_checkpoint_is_whole(tmp_path, tensor_parallel_size):
    result = launch(
        "tests.scenarios.io:staged_chunks", {"out": str(tmp_path), "tensor_parallel_size": tensor_parallel_size}
    )
    for facts in result.check().values:
        # 2 replicas: each rank writes about half of its shards (dedup), so it stages about half; AdamW's scalar
        # steps and the uneven split of the small model's chunks between replicas give the slack
        first, second = facts["staged"]
        assert first == second and 0.3 * facts["local"] < first < 0.7 * facts["local"], facts
        assert facts["reused"], facts
    staged = [facts["staged"][0] for facts in result.values]
    assert sum(staged) < 0.6 * sum(facts["local"] for facts in result.values)  # the R copies are staged once
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(tmp_path / f"staged-tp{tensor_parallel_size}", Path(tmp) / "out.pt")
        loaded = torch.load(Path(tmp) / "out.pt", weights_only=True)
    expected = torch.load(tmp_path / f"expected-tp{tensor_parallel_size}.pt", weights_only=False)
    assert loaded["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name  # the state at staging time, not after the step
    for fqn, entries in expected["optimizer"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optimizer"]["state"][fqn][key], entries[key]), (fqn, key)
