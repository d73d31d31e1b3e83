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


def staged_sources(num_nodes: int, devices: int) -> dict:
    """Stage a litgpt model's state at TP 2 (qkv's rows regrouped: several pieces per buffer) and record where the
    data of every copy comes from."""
    from torch.distributed.tensor import DTensor

    from fabric_hsdp.checkpoint.core.boxes import StoredBoxes
    from fabric_hsdp.checkpoint.core.stored_rows import module_layout
    from fabric_hsdp.checkpoint.core.tree import tree_leaves
    from fabric_hsdp.checkpoint.training import staging
    from fabric_hsdp.checkpoint.training.state import CheckpointState
    from tests.scenarios.checkpoints import setup_training, train_steps
    from tests.scenarios.common import layer_class, make_fabric

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("litgpt")}, tensor_parallel_size=2)
    model, optimizer, scheduler = setup_training(fabric, kind="litgpt", empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    checkpoint = CheckpointState({"model": model.module, "optimizer": optimizer.optimizer})
    with module_layout():
        state, _ = checkpoint.stored(checkpoint.tensors())
    live = set()
    for _, leaf in tree_leaves(state, (torch.Tensor, StoredBoxes)):
        local = leaf.local if isinstance(leaf, StoredBoxes) else leaf.to_local() if isinstance(leaf, DTensor) else leaf
        live.add(local.untyped_storage().data_ptr())
    copied, original = [], staging._Copies._copy_rows

    def recording(self, target, source):
        copied.append(source.untyped_storage().data_ptr())
        return original(self, target, source)

    staging._Copies._copy_rows = recording
    try:
        staging.Stager().stage(state, torch.distributed.new_group(backend="gloo"))
    finally:
        staging._Copies._copy_rows = original
    return {"copies": len(copied), "from_live_state": sum(ptr in live for ptr in copied)}


def test_staging_copies_straight_from_the_live_shards():
    """#35 item 1: on CUDA the copies run on a side stream ordered after the compute stream's work so far; a
    temporary made for them (torch.cat of qkv's pieces) would be written on the compute stream after that and could
    be read stale. Every copy's source must be the live state's own memory."""
    for facts in launch("tests.checkpoint.test_staging:staged_sources", num_nodes=1, ranks_per_node=4).check().values:
        assert facts["copies"] > 0 and facts["from_live_state"] == facts["copies"], facts
