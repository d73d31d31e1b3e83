"""Sharded (DCP) and full checkpoints of HybridFSDPStrategy on simulated nodes, in real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.counters import ReadCounter
from tests.helpers.launch import launch
from tests.helpers.training import (
    build,
    expected_state,
    full_optimizer_state,
    full_state,
    layer_class,
    make_fabric,
    setup_training,
    train_steps,
)

pytestmark = pytest.mark.slow


def _assert_exact(facts):
    assert facts["model_equal"] and all(facts["model_equal"].values()), facts["model_equal"]
    tensors = {k: v for k, v in facts["optimizer_equal"].items() if v is not None}
    assert tensors and all(tensors.values()), tensors
    assert facts["optimizer_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert facts["step"] == 2
    assert facts["scheduler_equal"] and facts["lr"] == facts["expected_lr"]


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    values = launch(save, {"out": str(out)}).check().values
    assert all(v == {"exists": True, "hidden_leftovers": []} for v in values)
    return out


@pytest.mark.parametrize(
    ("nodes", "per_node", "split"), [(1, 2, False), (1, 1, False), (4, 1, False), (2, 2, False), (4, 1, True)]
)
def test_resharded_load_is_exact(sharded_checkpoint, nodes, per_node, split):
    result = launch(
        load,
        {"out": str(sharded_checkpoint), "split_replica_reads": split},
        num_nodes=nodes,
        ranks_per_node=per_node,
    )
    for facts in result.check().values:
        _assert_exact(facts)
        assert facts["remainder"] == {"note": "hi"}
        assert facts["optimizer_steps_during_load"] == 0  # its state was allocated from the checkpoint


def test_a_damaged_meta_file_fails_the_load_with_checkpoint_error_naming_it(sharded_checkpoint, tmp_path):
    """``meta.pt`` (the plain values beside DCP's files) is read like every other part of a checkpoint: a truncated
    one is a ``CheckpointError`` naming the file, not torch's own unpickling error."""
    import shutil

    shutil.copytree(sharded_checkpoint, tmp_path, dirs_exist_ok=True)
    meta = tmp_path / "ckpt" / "meta.pt"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    # each rank's own error (without FABRIC_HSDP_DEBUG rank 0 says it in one line: tests/test_errors.py)
    debug = {"FABRIC_HSDP_DEBUG": "1"}
    result = launch(load, {"out": str(tmp_path)}, num_nodes=1, ranks_per_node=2, env=debug)
    assert not result.timed_out and all(code != 0 for code in result.returncodes), result.returncodes
    for rank in result.ranks:
        assert f"CheckpointError: '{meta}' is truncated or damaged" in rank.stderr, rank.stderr[-3000:]


def test_split_replica_reads_read_each_shard_once(sharded_checkpoint):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(sharded_checkpoint / "ckpt")).read_metadata()
    tensor_bytes = sum(
        entry.size.numel() * entry.properties.dtype.itemsize
        for entry in metadata.state_dict_metadata.values()
        if isinstance(entry, TensorStorageMetadata)
    )
    reads = {}
    for split in (False, True):
        result = launch(
            load_counting_reads,
            {"out": str(sharded_checkpoint), "split_replica_reads": split},
        )
        for facts in result.check().values:
            _assert_exact(facts)
        reads[split] = [facts["bytes_read"] for facts in result.values]
    # by default each rank reads its half, so the two replicas together read the checkpoint twice
    assert all(0.45 * tensor_bytes < count < 0.55 * tensor_bytes for count in reads[False]), (reads, tensor_bytes)
    # split: each rank reads about a quarter, all together the checkpoint once (AdamW's scalar steps are read whole
    # by every rank)
    assert all(0.2 * tensor_bytes < count < 0.3 * tensor_bytes for count in reads[True]), (reads, tensor_bytes)
    assert sum(reads[True]) < 1.05 * tensor_bytes


def test_replica_split_maps_each_rank_to_its_rows():
    values = launch(split_parts).check().values
    for facts in values:
        replica, shard = facts["coordinate"]
        assert facts["part_offset_rows"] == shard * 4 + replica * 2 and facts["part_rows"] == 2, facts
        assert facts["uneven_kept"] and facts["splits"] == 1
        assert facts["shares_memory"] and facts["shard_after_gather_exact"]


def test_each_replicated_shard_is_written_once(sharded_checkpoint):
    expected = torch.load(sharded_checkpoint / "expected.pt", weights_only=False)
    model_bytes = sum(t.numel() * t.element_size() for t in expected["model"].values())
    unique = 3 * model_bytes  # parameters, exp_avg and exp_avg_sq, one copy each
    written = sum(f.stat().st_size for f in (sharded_checkpoint / "ckpt").glob("*.distcp"))
    # 2 replicas: written twice would be 2x; per-item framing adds a little
    assert unique <= written < 1.3 * unique, (written, unique)


def test_torch_dcp_to_torch_save_reads_our_checkpoint(sharded_checkpoint, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(sharded_checkpoint / "ckpt", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    expected = torch.load(sharded_checkpoint / "expected.pt", weights_only=False)
    assert loaded["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    for fqn, entries in expected["optimizer"].items():
        assert torch.equal(loaded["optimizer"]["state"][fqn]["exp_avg"], entries["exp_avg"])


def test_lightning_consolidate_checkpoint_reads_our_checkpoint(sharded_checkpoint, tmp_path):
    output = tmp_path / "consolidated.ckpt"
    command = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint"]
    subprocess.run([*command, str(sharded_checkpoint / "ckpt"), "--output_file", str(output)], check=True, timeout=120)
    loaded = torch.load(output, weights_only=False)
    expected = torch.load(sharded_checkpoint / "expected.pt", weights_only=False)
    for name, tensor in expected["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert loaded["step"] == 2 and loaded["note"] == "hi"


def test_checkpoint_of_lightning_model_parallel_strategy_loads(tmp_path):
    launch(save_with_lightning, {"out": str(tmp_path)}).check()
    for facts in launch(load, {"out": str(tmp_path)}).check().values:
        _assert_exact(facts)
        assert facts["optimizer_steps_during_load"] == 0


@pytest.mark.parametrize("name", ["full.pth", "full.safetensors"])
def test_full_checkpoint_from_rank0(tmp_path, name):
    args = {"out": str(tmp_path), "state_dict_type": "full", "name": name, "model_only": name.endswith("safetensors")}
    launch(save, args).check()
    expected = torch.load(tmp_path / "expected.pt", weights_only=False)
    if name.endswith(".pth"):
        saved = torch.load(tmp_path / name, weights_only=True)
        assert sorted(saved) == ["model", "note", "optimizer", "scheduler", "step"]
        model = saved["model"]
        for fqn, entries in expected["optimizer"].items():
            assert torch.equal(saved["optimizer"]["state"][fqn]["exp_avg_sq"], entries["exp_avg_sq"])
        # the Fabric layout loads back with optimizer and plain values, with replicas (2 x 2, split reads)
        args = {"out": str(tmp_path), "name": name, "split_replica_reads": True}
        facts = launch(load, args).check()
        for value in facts.values:
            _assert_exact(value)
            assert value["remainder"] == {"note": "hi"}
    else:
        from safetensors.torch import load_file

        model = load_file(tmp_path / name)
    assert model.keys() == expected["model"].keys()
    assert all(torch.equal(model[k], v) for k, v in expected["model"].items())


def test_safetensors_refuses_optimizer_state(tmp_path):
    result = launch(save, {"out": str(tmp_path), "name": "x.safetensors"})
    assert result.returncodes == [1, 1, 1, 1]
    assert "is a safetensors file, which holds model tensors only" in result.ranks[0].stderr
    assert not (tmp_path / "x.safetensors").exists()


_LAYERS = [f"layers.{i}" for i in range(2)]
EXPECTED_SPLIT = {  # parameters tensor parallelism splits under each plan of TENSOR_PARALLEL_PLANS below
    "auto": sorted(
        ["tok_embeddings.weight", "output.weight"]
        + [f"{layer}.{block}.weight" for layer in _LAYERS for block in
           ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    ),
    "dict": sorted(
        ["output.weight"] + [f"{layer}.feed_forward.{w}.weight" for layer in _LAYERS for w in ("w1", "w2", "w3")]
    ),
    "callable": sorted(f"{layer}.feed_forward.{w}.weight" for layer in _LAYERS for w in ("w1", "w2", "w3")),
}  # fmt: skip


def _killed_saves(tmp_path, points, async_save):
    """One launch per kill point (``save_then_killed``): where the kill landed decides what must be at the path."""
    from tests.helpers.dcp_read import read_model_tensors

    outcomes = []
    for run, point in enumerate(points):
        out = tmp_path / f"run{run}"
        out.mkdir()
        victim = 0 if point == "after_commit" else (run * 3 + 1) % 4  # only rank 0 commits
        # every other run under tensor parallelism (mesh (2, 1, 2)): the same commit must hold there, with each kind
        # of plan in turn (the model's own, a dict, a callable)
        plan = ["auto", "dict", "callable"][run // 2 % 3]
        result = launch(
            save_then_killed,
            {"out": str(out), "point": point, "victim": victim, "async_save": async_save,
             "tensor_parallel_size": 1 + run % 2, "tensor_parallel_plan": plan},
            timeout=60,
            fail_grace=5,
        )  # fmt: skip
        assert not result.timed_out
        if run % 2:  # the plan took effect: the parameters it splits are on the 3-D mesh, the others are not
            split = json.loads((out / "split.json").read_text())
            assert split == EXPECTED_SPLIT[plan], (plan, split)
        details = f"run {run} ({point}, victim {victim}): {result.returncodes}\n" + result.ranks[victim].stderr[-2000:]
        # the victim died where it was told to (a save that raised, or never got there, leaves no marker)
        marker = out / "killed_at"
        assert marker.exists() and marker.read_text() == point, "the victim never reached its kill point; " + details
        assert result.returncodes[victim] == -9, details
        loaded = read_model_tensors(out / "ckpt")  # raises if incomplete or unreadable
        old = torch.load(out / "expected_a.pt", weights_only=True)
        new = torch.load(out / "expected_b.pt", weights_only=True)
        is_old = all(torch.equal(loaded[k], v) for k, v in old.items())
        is_new = all(torch.equal(loaded[k], v) for k, v in new.items())
        outcome = "new" if is_new and not is_old else "old" if is_old and not is_new else "neither"
        assert outcome == KILL_POINTS[point], details + f"\noutcome {outcome}"
        outcomes.append((point, outcome))
        assert not [p for p in out.iterdir() if p.name.startswith(".ckpt.previous-")]
    print("outcomes:", outcomes)


@pytest.mark.timeout(10 * 60 + 30)  # 10 launches of 60 s at most
def test_killed_saves_leave_old_or_new_checkpoint(tmp_path):

    _killed_saves(tmp_path, points=2 * list(KILL_POINTS), async_save=False)  # each point with and without TP


def test_killed_background_saves_leave_old_or_new_checkpoint(tmp_path):
    _killed_saves(tmp_path, points=["mid_write", "after_commit", "after_save"], async_save=True)


def test_background_save_holds_the_state_at_save_time_and_finishes_when_the_script_ends(tmp_path):
    result = launch(save_in_background, {"out": str(tmp_path)}, timeout=120)
    assert not any(facts["visible_before_written"] for facts in result.check().values)
    assert [p.name for p in tmp_path.glob(".*")] == []
    # parameters, AdamW state and lr changed by the step after fabric.save are not in the checkpoint
    for facts in launch(load, {"out": str(tmp_path)}, num_nodes=1).check().values:
        _assert_exact(facts)
        assert facts["remainder"] == {"note": "hi"}
        assert facts["optimizer_steps_during_load"] == 0  # its state was allocated from the checkpoint


@pytest.mark.parametrize("async_save", [False, True])
def test_one_rank_failing_to_write_fails_all_and_keeps_previous(tmp_path, async_save):
    result = launch(
        fail_writing_on_one_rank,
        {"out": str(tmp_path), "failing_rank": 2, "async_save": async_save},
        timeout=120,
    )
    values = result.check().values
    for facts in values:
        # every rank returned the error (a rank left waiting in DCP's collective would time the launch out)
        assert facts["error"] is not None
        assert f"'{tmp_path / 'ckpt'}'" in facts["error"]
        assert "rank 2: PermissionError" in facts["error"], facts["error"]
        assert ".ckpt.saving-" not in facts["error"]  # the user's path, not the hidden pending directory
    # rank 0 gets an OSError creating the pending directory or committing: SaveError there, PeerRankError elsewhere
    file_parent = tmp_path / "a_file"
    expected_rank0 = {
        "parent_is_a_file": f"SaveError: cannot write '{file_parent / 'ckpt'}': '{file_parent}' is a file, not a"
        " directory (Not a directory); choose a directory for the checkpoint. Nothing was written at"
        f" '{file_parent / 'ckpt'}'",
        "commit_refused": f"SaveError: cannot write '{tmp_path / 'ckpt'}': directory '{tmp_path}' is not writable"
        " (Read-only file system); choose a writable directory. Nothing was written at",
    }
    for rank, facts in enumerate(values):
        for case, error in facts["rank0_unwritable"].items():
            assert error.startswith(expected_rank0[case] if rank == 0 else "PeerRankError: "), (rank, case, error)
            assert ".saving-" not in error and expected_rank0[case].removeprefix("SaveError: ") in error, error
    from tests.helpers.dcp_read import read_model_tensors

    loaded = read_model_tensors(tmp_path / "ckpt")
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_background_save_failing_after_the_script_ended_exits_1(tmp_path):
    result = launch(
        fail_writing_on_one_rank,
        {"out": str(tmp_path), "failing_rank": 2, "async_save": True, "wait": False},
        timeout=120,
    )
    assert not result.timed_out
    assert result.returncodes == [1, 1, 1, 1], [rank.stderr[-2000:] for rank in result.ranks]
    for rank in result.ranks:
        assert rank.value == {"error": None, "seconds": rank.value["seconds"]}  # the scenario itself returned
        assert f"saving checkpoint '{tmp_path / 'ckpt'}' failed (rank 2: PermissionError" in rank.stderr
    from tests.helpers.dcp_read import read_model_tensors

    loaded = read_model_tensors(tmp_path / "ckpt")
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_save_path_must_be_given_state_with_a_model(tmp_path):
    from fabric_hsdp.checkpoint.training.state import CheckpointState

    with pytest.raises(ValueError, match="exactly one model set up with fabric.setup_module; found no model"):
        CheckpointState({"model": torch.nn.Linear(2, 2), "step": 1})


def load_into_another_model(num_nodes: int, devices: int, out: str) -> dict:
    """Resume a LLaMA checkpoint into litgpt's GPT (another model): the error, as the user sees it."""
    from tests.helpers.training import layer_class, make_fabric, setup_training

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("litgpt")})
    model, optimizer, _ = setup_training(fabric, kind="litgpt")
    try:
        fabric.load(Path(out) / "ckpt", {"model": model, "optimizer": optimizer})
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def test_resuming_another_models_checkpoint_names_both_sides(sharded_checkpoint):
    """#34: DCP said only "Missing key in checkpoint state_dict: model.transformer.wte.weight"."""
    result = launch(
        load_into_another_model,
        {"out": str(sharded_checkpoint)},
        num_nodes=1,
        ranks_per_node=2,
    )
    for facts in result.check().values:
        error = facts["error"]
        assert error.startswith(f"CheckpointError: checkpoint '{sharded_checkpoint / 'ckpt'}' has no tensor for"), error
        assert "'transformer.wte.weight' (model expects [256, 64] float32)" in error
        assert "has 21 tensors the model does not: 'tok_embeddings.weight' ([256, 64] float32)" in error
        assert "Is it a checkpoint of this model (entry 'model')?" in error


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# Sharded and full checkpoints: save, resharded load, interop, kills and failures.


def save(
    num_nodes: int,
    devices: int,
    out: str,
    state_dict_type: str = "sharded",
    name: str = "ckpt",
    model_only: bool = False,
) -> dict:
    """Train 2 steps, save, and record the exact expected state (rank 0 writes expected.pt)."""
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")}, state_dict_type=state_dict_type)
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=2)
    expected = expected_state(model, optimizer, scheduler)
    path = Path(out) / name
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "note": "hi"}
    fabric.save(path, {"model": model} if model_only else state)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    hidden = sorted(p.name for p in Path(out).iterdir() if p.name.startswith("."))
    return {"exists": path.exists(), "hidden_leftovers": hidden}


def load(
    num_nodes: int,
    devices: int,
    out: str,
    name: str = "ckpt",
    shard_size: Any = "node",
    split_replica_reads: bool = False,
    **kw: Any,
) -> dict:
    """Load into a meta-initialised model on this topology and compare with expected.pt exactly."""
    fabric = make_fabric(
        num_nodes,
        devices,
        sharded_modules={layer_class("llama")},
        shard_size=shard_size,
        split_replica_reads=split_replica_reads,
    )
    model, optimizer, scheduler = setup_training(fabric, empty_init=True, seed=99)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    steps = []  # a load must not step the optimizer (DCP would, to create a fresh optimizer's state)
    hook = optimizer.optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    remainder = fabric.load(Path(out) / name, state, **kw)
    hook.remove()
    expected = torch.load(Path(out) / "expected.pt", weights_only=False)
    actual_model = full_state(model.module)
    actual_optimizer = full_optimizer_state(model.module, optimizer.optimizer)
    model_equal = {k: torch.equal(actual_model[k], v) for k, v in expected["model"].items()}
    optimizer_equal = {
        f"{fqn}.{key}": (torch.equal(value, actual_optimizer[fqn][key]) if isinstance(value, torch.Tensor) else None)
        for fqn, entries in expected["optimizer"].items()
        for key, value in entries.items()
    }
    return {
        "model_equal": model_equal,
        "optimizer_equal": optimizer_equal,
        "optimizer_keys": sorted({key for entries in actual_optimizer.values() for key in entries}),
        "optimizer_steps_during_load": len(steps),
        "step": state["step"],
        "scheduler_equal": scheduler.state_dict() == expected["scheduler"],
        "lr": optimizer.param_groups[0]["lr"],
        "expected_lr": expected["scheduler"]["_last_lr"][0],
        "remainder": remainder,
    }


def save_with_lightning(num_nodes: int, devices: int, out: str) -> dict:
    """Lightning's own ModelParallelStrategy writes a DCP checkpoint of the same model (FSDP2 over all ranks)."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=num_nodes * devices, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy)
    fabric.launch()
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=2)
    expected = expected_state(model, optimizer, scheduler)
    fabric.save(Path(out) / "ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    return {}


def save_in_background(num_nodes: int, devices: int, out: str) -> dict:
    """async_save: save after 2 steps, then train on while the write is held back until that step is done.

    The checkpoint must hold the state of the moment ``fabric.save`` was called, not the later one (and a
    ``fabric.save`` that waited for the write would never return). The script then ends: the save must still be
    finished and committed.
    """
    from torch.distributed.checkpoint import filesystem

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")}, async_save=True)
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=2)
    expected = expected_state(model, optimizer, scheduler)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    write_data = filesystem.FileSystemWriter.write_data
    release = threading.Event()

    def held_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if not release.wait(timeout=60):  # in DCP's writing thread
            raise TimeoutError("the write was never released: fabric.save blocked on it")
        return write_data(self, plan, planner)

    filesystem.FileSystemWriter.write_data = held_write_data
    path = Path(out) / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "note": "hi"})
    visible_before_written = path.exists()
    train_steps(fabric, model, optimizer, scheduler, steps=1)  # changes parameters, AdamW state and lr in place
    release.set()
    return {"visible_before_written": visible_before_written}  # the script ends with the save pending


# Where a killed save dies, in the order a save passes them, and what must then be at the path.
KILL_POINTS = {
    "before_write": "old",  # in DCP's write_data, before this rank wrote a byte
    "mid_write": "old",  # in the fsync of this rank's first data file: its bytes written, the file not finished
    "after_write": "old",  # this rank's files all written, before the commit
    "after_commit": "new",  # rank 0: the swap into place done, fabric.save not yet returned
    "after_save": "new",  # fabric.save (and, in the background, the wait) returned
}


def _arm_kill(point: str, marker: Path) -> None:
    """Make this rank SIGKILL itself when the save reaches ``point``, writing ``marker`` first (where it died).

    The kill is triggered by the save's own progress (hooks in DCP's writer and in the commit), not by a timer, so
    where it lands does not depend on the machine's load.
    """
    from torch.distributed.checkpoint import filesystem

    from fabric_hsdp.checkpoint.core import commit

    def die(where: str) -> None:
        marker.write_text(where)
        os.kill(os.getpid(), signal.SIGKILL)

    write_data, fsync, commit_swap = filesystem.FileSystemWriter.write_data, os.fsync, commit.commit
    writing = threading.Event()

    def hooked_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if point == "before_write":
            die(point)
        writing.set()
        future = write_data(self, plan, planner)
        future.wait()  # done (thread_count 1 writes in this thread): an error would surface here
        if point == "after_write":
            die(point)
        return future

    def hooked_fsync(fd: int) -> None:
        if point == "mid_write" and writing.is_set() and os.fstat(fd).st_size > 0:
            die(point)
        fsync(fd)

    def hooked_commit(pending: Path, path: Path) -> None:
        commit_swap(pending, path)
        if point == "after_commit":
            die(point)

    filesystem.FileSystemWriter.write_data = hooked_write_data
    filesystem.os.fsync = hooked_fsync
    commit.commit = hooked_commit


def feed_forward_only(model: torch.nn.Module, mesh: Any) -> None:
    """A callable tensor-parallel plan: the example LLaMA's feed-forward blocks only (attention stays whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(layer.feed_forward, mesh, plan, src_data_rank=None)


# Plans a launched run takes: "auto" (the model's _tp_plan), a dict of style names, a callable.
TENSOR_PARALLEL_PLANS = {
    "auto": "auto",
    "dict": {
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise_gather_output",
    },
    "callable": feed_forward_only,
}


def save_then_killed(
    num_nodes: int,
    devices: int,
    out: str,
    point: str,
    victim: int,
    async_save: bool = False,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: str = "auto",
) -> dict:
    """Save A, train, then save B over it while rank ``victim`` SIGKILLs itself at ``point`` of that save.

    Rank 0 writes which parameters tensor parallelism split (``split.json``): the plan given took effect.
    """
    fabric = make_fabric(
        num_nodes,
        devices,
        sharded_modules={layer_class("llama")},
        async_save=async_save,
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_plan=TENSOR_PARALLEL_PLANS[tensor_parallel_plan],
    )
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    if fabric.global_rank == 0:
        split = sorted(name for name, p in model.module.named_parameters() if len(p.placements) == 3)
        (Path(out) / "split.json").write_text(json.dumps(split))
    path = Path(out) / "ckpt"
    state = {"model": model, "optimizer": optimizer, "step": 1}
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    fabric.save(path, state)
    fabric.strategy.wait_for_checkpoint()
    expected_a = full_state(model.module)  # gathers are collectives: every rank takes part
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    state["step"] = 2
    expected_b = full_state(model.module)
    if fabric.global_rank == 0:
        torch.save(expected_a, Path(out) / "expected_a.pt")
        torch.save(expected_b, Path(out) / "expected_b.pt")
    fabric.barrier()
    marker = Path(out) / "killed_at"
    if fabric.global_rank == victim:
        _arm_kill(point, marker)
    fabric.save(path, state)
    fabric.strategy.wait_for_checkpoint()
    if fabric.global_rank == victim:
        assert point == "after_save", f"the save returned on rank {victim} although it was to die at {point}"
        marker.write_text(point)
        os.kill(os.getpid(), signal.SIGKILL)
    fabric.barrier()  # the others stay until the victim is gone: the launcher ends them
    return {}


def fail_writing_on_one_rank(
    num_nodes: int, devices: int, out: str, failing_rank: int, async_save: bool = False, wait: bool = True
) -> dict:
    """Save once; then one rank's disk refuses writes (permission denied) during the next save."""
    import errno

    from torch.distributed.checkpoint import filesystem

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")}, async_save=async_save)
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    path = Path(out) / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    fabric.strategy.wait_for_checkpoint()
    expected = full_state(model.module)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    write_data = filesystem.FileSystemWriter.write_data
    if fabric.global_rank == failing_rank:

        def refuse(self: Any, plan: Any, planner: Any) -> Any:
            raise PermissionError(errno.EACCES, "Permission denied", str(self.path))

        filesystem.FileSystemWriter.write_data = refuse
    started = time.monotonic()
    try:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        if not wait:
            return {"error": None, "seconds": time.monotonic() - started}  # the script ends with the save pending
        fabric.strategy.wait_for_checkpoint()  # a background save's failure is raised here
    except Exception as error:
        failed = {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    else:
        return {"error": None, "seconds": time.monotonic() - started}
    filesystem.FileSystemWriter.write_data = write_data
    failed["rank0_unwritable"] = _save_where_rank0_cannot_write(fabric, model, optimizer, Path(out), path)
    return failed


def _save_where_rank0_cannot_write(fabric: Any, model: Any, optimizer: Any, out: Path, path: Path) -> dict[str, str]:
    """Two saves whose rank 0 gets an OSError: the checkpoint's parent is a regular file (creating the pending
    directory fails), and the final rename is refused (a read-only filesystem, planted); each rank's error by case."""
    import errno

    from fabric_hsdp.checkpoint.core import commit

    if fabric.global_rank == 0:
        (out / "a_file").write_text("not a directory")
    fabric.barrier()
    errors = {}
    commit_for_real = commit.commit
    for case, target in [("parent_is_a_file", out / "a_file" / "ckpt"), ("commit_refused", path)]:
        if case == "commit_refused" and fabric.global_rank == 0:

            def refuse(pending: Path, path: Path) -> None:
                raise OSError(errno.EROFS, "Read-only file system", str(pending))

            commit.commit = refuse
        try:
            fabric.save(target, {"model": model, "optimizer": optimizer, "step": 3})
            fabric.strategy.wait_for_checkpoint()
            errors[case] = "no error"
        except Exception as error:
            errors[case] = f"{type(error).__name__}: {error}"
        finally:
            commit.commit = commit_for_real
    if fabric.global_rank == 0:
        (out / "a_file").unlink()
    fabric.barrier()
    return errors


def load_raw_state(num_nodes: int, devices: int, out: str, name: str) -> dict:
    """Load a checkpoint holding only model weights; compare to expected.pt's model entry."""
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    with fabric.init_module(empty_init=True):
        model = build("llama", seed=5)
    model = fabric.setup_module(model)
    fabric.load_raw(Path(out) / name, model)
    expected = torch.load(Path(out) / "expected.pt", weights_only=False)["model"]
    actual = full_state(model.module)
    dist.barrier()
    return {"model_equal": {k: torch.equal(actual[k], v) for k, v in expected.items()}}


def load_counting_reads(num_nodes: int, devices: int, out: str, split_replica_reads: bool) -> dict:
    """``load`` on this topology, counting the tensor bytes this rank reads from the checkpoint's files."""
    counter = ReadCounter()
    facts = load(num_nodes, devices, out, split_replica_reads=split_replica_reads)
    return dict(facts, bytes_read=counter.bytes)


def split_parts(num_nodes: int, devices: int) -> dict:
    """What each rank of a 2 x 2 mesh reads of two (Replicate, Shard(0)) tensors, and what the gather puts back."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fabric_hsdp.checkpoint.training.replica_split import gather, replica_parts

    fabric = make_fabric(num_nodes, devices)
    mesh = fabric.strategy.device_mesh
    even = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # 8 rows: 4 parts of 2
    uneven = torch.arange(6 * 2, dtype=torch.float32).view(6, 2)  # 6 rows do not split into 4 parts
    placements = [Replicate(), Shard(0)]
    state = {
        "model": {"even": DTensor.from_local(even.chunk(2)[mesh.get_local_rank(1)].clone(), mesh, placements)},
        "other": [{"uneven": DTensor.from_local(uneven.chunk(2)[mesh.get_local_rank(1)].clone(), mesh, placements)}],
    }
    targets, _, splits = replica_parts(state, fabric.strategy.parallel_mesh, {})
    part = targets["model"]["even"]
    (chunk,) = part.__create_chunk_list__()  # where DCP reads this rank's part from
    whole = state["model"]["even"].to_local()
    facts = {
        "coordinate": mesh.get_coordinate(),
        "part_offset_rows": chunk.offsets[0],
        "part_rows": chunk.sizes[0],
        "uneven_kept": targets["other"][0]["uneven"] is state["other"][0]["uneven"],
        "splits": len(splits),
        "shares_memory": part.local.data_ptr() == whole.data_ptr(),
    }
    # as a load would: this rank's part holds its rows, the rest of the shard is stale until the gather
    whole.zero_()
    offset = facts["part_offset_rows"]
    splits[0].part.copy_(even[offset : offset + facts["part_rows"]])
    gather(splits, fabric.strategy.parallel_mesh)
    facts["shard_after_gather_exact"] = torch.equal(whole, even.chunk(2)[mesh.get_local_rank(1)])
    return facts
