"""Background-save staging: only the chunks a rank writes are copied, into buffers kept across saves."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.launch import launch
from tests.helpers.training import layer_class, make_fabric, setup_training

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_stager_copies_what_this_rank_writes_and_the_checkpoint_is_whole(tmp_path, tensor_parallel_size):
    result = launch(
        "tests.checkpoint.test_staging:staged_chunks",
        {"out": str(tmp_path), "tensor_parallel_size": tensor_parallel_size},
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
    from fabric_hsdp.checkpoint.core.stored_rows import held_row_order
    from fabric_hsdp.checkpoint.core.tree import tree_leaves
    from fabric_hsdp.checkpoint.training import staging
    from fabric_hsdp.checkpoint.training.state import CheckpointState
    from tests.helpers.training import layer_class, make_fabric, setup_training, train_steps

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("litgpt")}, tensor_parallel_size=2)
    model, optimizer, scheduler = setup_training(fabric, kind="litgpt", empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    checkpoint = CheckpointState({"model": model.module, "optimizer": optimizer.optimizer})
    with held_row_order():
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


def test_staged_chunks_share_one_block_of_their_exact_size_kept_across_saves():
    """GPU review S6: one host block for every chunk a rank writes (on CUDA registered once, at its exact size),
    reused by the next save with the same chunks; a pinned block per tensor from the caching allocator rounded each up
    to a power of two and was never returned."""
    from fabric_hsdp.checkpoint.training.staging import Stager

    state = {
        "model": {"w": torch.randn(3, 5), "ids": torch.arange(7), "flag": torch.tensor(True)},
        "optimizer": {"state": {"w": {"exp_avg": torch.randn(3, 5, dtype=torch.bfloat16)}}, "lr": 0.1},
    }
    written = {fqn: {None} for fqn in ("model.w", "model.ids", "model.flag", "optimizer.state.w.exp_avg")}
    stager = Stager()
    staged = stager.copy(state, written).state
    buffers = [staged["model"][n] for n in ("w", "ids", "flag")] + [staged["optimizer"]["state"]["w"]["exp_avg"]]
    originals = [state["model"][n] for n in ("w", "ids", "flag")] + [state["optimizer"]["state"]["w"]["exp_avg"]]
    assert all(torch.equal(b, o) and b.dtype == o.dtype for b, o in zip(buffers, originals, strict=True))
    assert staged["optimizer"]["lr"] == 0.1
    blocks = {buffer.untyped_storage().data_ptr() for buffer in buffers}
    assert len(blocks) == 1, "every chunk in one block"
    used = sum(buffer.nbytes for buffer in buffers)  # 60 + 56 + 1 + 30
    assert used <= stager._block.nbytes < used + 64 * len(buffers)  # its exact size, each chunk 64-byte aligned
    state["model"]["w"].add_(1.0)
    again = stager.copy(state, written).state
    assert again["model"]["w"].untyped_storage().data_ptr() in blocks  # the same block, refilled
    assert torch.equal(again["model"]["w"], state["model"]["w"])
    state["model"]["w2"] = torch.zeros(4)
    grown = stager.copy(state, {**written, "model.w2": {None}}).state
    assert torch.equal(grown["model"]["w2"], torch.zeros(4)) and torch.equal(grown["model"]["w"], state["model"]["w"])


def test_the_next_optimizer_step_waits_for_the_copies_and_only_it():
    """On CUDA the compute stream waits for a save's copies only before the next optimizer step (the first in-place
    update of what they read), so the forward and backward in between overlap them; then the hook is gone."""
    from fabric_hsdp.checkpoint.training.staging import Stager

    class Event:  # a CUDA event's part the stager uses: wait() makes the current stream wait for it
        waits = 0

        def wait(self) -> None:
            Event.waits += 1

    stager = Stager()
    stager.wait_before_next_step(Event())
    stager.wait_before_next_step(Event())  # two saves before a step: both waited for
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    assert Event.waits == 0
    parameter.grad = torch.ones(2)
    optimizer.step()
    assert Event.waits == 2
    optimizer.step()
    torch.optim.Adam([parameter]).step()
    assert Event.waits == 2  # the hook removed itself
    stager.wait_before_next_step(Event())
    stager.close()  # teardown: the writer waited for the copies; no hook is left behind
    optimizer.step()
    assert Event.waits == 2


def test_the_writing_thread_binds_the_ranks_device_before_it_waits_for_the_copies(monkeypatch):
    """#35 item 2: DCP's writing thread starts on cuda:0; waiting there for rank 3's copies would open a context on
    GPU 0 from every rank of the node. The writer's ``ready`` binds the copies' device first, and the writer reads
    the host copies with DCP's serial loader (the overlapping one syncs the thread's current CUDA stream)."""
    import threading

    from fabric_hsdp.checkpoint.training import background, staging

    calls = []

    class Event:
        def record(self, stream):
            calls.append(("record", threading.current_thread().name))

        def synchronize(self):
            calls.append(("synchronize", threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: calls.append(("set_device", f"{device} in {threading.current_thread().name}")),
    )
    stager = staging.Stager()
    monkeypatch.setattr(stager, "_copy_stream", lambda: "the copy stream")
    monkeypatch.setattr(stager, "wait_before_next_step", lambda event: calls.append(("before next step",)))
    copies = staging._Copies(stager, {})
    copies._device = torch.device("cuda", 3)  # a copy was issued from rank 3's GPU
    ready = copies.finish()
    writer_thread = threading.Thread(target=ready, name="writer")
    writer_thread.start()
    writer_thread.join()
    main = threading.current_thread().name
    assert calls == [
        ("record", main),
        ("before next step",),
        ("set_device", "cuda:3 in writer"),
        ("synchronize", "writer"),
    ]
    assert background._StagedWriter("/nowhere").per_thread_copy_ahead == 0


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# Staged background saves.


def staged_chunks(num_nodes: int, devices: int, out: str, tensor_parallel_size: int = 1) -> dict:
    """Stage model + AdamW state twice with :class:`Stager`; write the second with DCP; report sizes and reuse."""
    import torch.distributed.checkpoint as dcp

    from fabric_hsdp.checkpoint.core.dcp_planners import SavePlanner
    from fabric_hsdp.checkpoint.core.stored_rows import held_row_order
    from fabric_hsdp.checkpoint.training.staging import Stager
    from fabric_hsdp.checkpoint.training.state import CheckpointState
    from fabric_hsdp.checkpoint.writers.direct_writer import DirectWriter
    from tests.helpers.training import expected_state, train_steps

    fabric = make_fabric(
        num_nodes, devices, sharded_modules={layer_class("llama")}, tensor_parallel_size=tensor_parallel_size
    )
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    group = torch.distributed.new_group(backend="gloo")
    stager = Stager()

    def state() -> dict:
        checkpoint = CheckpointState({"model": model.module, "optimizer": optimizer.optimizer})
        with held_row_order():
            return checkpoint.stored(checkpoint.tensors())[0]

    first = stager.stage(state(), group)
    pointers = sorted(buffer.data_ptr() for buffer in stager._buffers.values())
    second = stager.stage(state(), group)
    reused = pointers == sorted(buffer.data_ptr() for buffer in stager._buffers.values())
    expected = expected_state(model, optimizer, scheduler)
    train_steps(fabric, model, optimizer, scheduler, steps=1)  # after staging: must not reach the checkpoint
    path = Path(out) / f"staged-tp{tensor_parallel_size}"
    second.ready()
    dcp.save(second.state, storage_writer=DirectWriter(path), planner=SavePlanner(), process_group=group)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / f"expected-tp{tensor_parallel_size}.pt")
    local = sum(
        (t.to_local() if hasattr(t, "to_local") else t).nbytes
        for t in [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values())]
        if isinstance(t, torch.Tensor)
    )
    return {"staged": [first.nbytes, second.nbytes], "local": local, "reused": reused}
