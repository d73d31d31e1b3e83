"""Sharded (DCP) and full checkpoints of HybridFSDPStrategy on simulated nodes, in real processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import launch

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
    values = launch("tests.scenarios.checkpoints:save", {"out": str(out)}).check().values
    assert all(v == {"exists": True, "hidden_leftovers": []} for v in values)
    return out


@pytest.mark.parametrize(
    ("nodes", "per_node", "split"), [(1, 2, False), (1, 1, False), (4, 1, False), (2, 2, False), (4, 1, True)]
)
def test_resharded_load_is_exact(sharded_checkpoint, nodes, per_node, split):
    result = launch(
        "tests.scenarios.checkpoints:load",
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
    result = launch("tests.scenarios.checkpoints:load", {"out": str(tmp_path)}, num_nodes=1, ranks_per_node=2)
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
            "tests.scenarios.checkpoints:load_counting_reads",
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
    values = launch("tests.scenarios.checkpoints:split_parts").check().values
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
    launch("tests.scenarios.checkpoints:save_with_lightning", {"out": str(tmp_path)}).check()
    for facts in launch("tests.scenarios.checkpoints:load", {"out": str(tmp_path)}).check().values:
        _assert_exact(facts)
        assert facts["optimizer_steps_during_load"] == 0


@pytest.mark.parametrize("name", ["full.pth", "full.safetensors"])
def test_full_checkpoint_from_rank0(tmp_path, name):
    args = {"out": str(tmp_path), "state_dict_type": "full", "name": name, "model_only": name.endswith("safetensors")}
    launch("tests.scenarios.checkpoints:save", args).check()
    expected = torch.load(tmp_path / "expected.pt", weights_only=False)
    if name.endswith(".pth"):
        saved = torch.load(tmp_path / name, weights_only=True)
        assert sorted(saved) == ["model", "note", "optimizer", "scheduler", "step"]
        model = saved["model"]
        for fqn, entries in expected["optimizer"].items():
            assert torch.equal(saved["optimizer"]["state"][fqn]["exp_avg_sq"], entries["exp_avg_sq"])
        # the Fabric layout loads back with optimizer and plain values, with replicas (2 x 2, split reads)
        args = {"out": str(tmp_path), "name": name, "split_replica_reads": True}
        facts = launch("tests.scenarios.checkpoints:load", args).check()
        for value in facts.values:
            _assert_exact(value)
            assert value["remainder"] == {"note": "hi"}
    else:
        from safetensors.torch import load_file

        model = load_file(tmp_path / name)
    assert model.keys() == expected["model"].keys()
    assert all(torch.equal(model[k], v) for k, v in expected["model"].items())


def test_safetensors_refuses_optimizer_state(tmp_path):
    result = launch("tests.scenarios.checkpoints:save", {"out": str(tmp_path), "name": "x.safetensors"})
    assert result.returncodes == [1, 1, 1, 1]
    assert "is a safetensors file, which holds model tensors only" in result.ranks[0].stderr
    assert not (tmp_path / "x.safetensors").exists()


_LAYERS = [f"layers.{i}" for i in range(2)]
EXPECTED_SPLIT = {  # parameters tensor parallelism splits under each plan of tests.scenarios.checkpoints
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
    from tests.scenarios.checkpoints import KILL_POINTS

    outcomes = []
    for run, point in enumerate(points):
        out = tmp_path / f"run{run}"
        out.mkdir()
        victim = 0 if point == "after_commit" else (run * 3 + 1) % 4  # only rank 0 commits
        # every other run under tensor parallelism (mesh (2, 1, 2)): the same commit must hold there, with each kind
        # of plan in turn (the model's own, a dict, a callable)
        plan = ["auto", "dict", "callable"][run // 2 % 3]
        result = launch(
            "tests.scenarios.checkpoints:save_then_killed",
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
    from tests.scenarios.checkpoints import KILL_POINTS

    _killed_saves(tmp_path, points=2 * list(KILL_POINTS), async_save=False)  # each point with and without TP


def test_killed_background_saves_leave_old_or_new_checkpoint(tmp_path):
    _killed_saves(tmp_path, points=["mid_write", "after_commit", "after_save"], async_save=True)


def test_background_save_holds_the_state_at_save_time_and_finishes_when_the_script_ends(tmp_path):
    result = launch("tests.scenarios.checkpoints:save_in_background", {"out": str(tmp_path)}, timeout=120)
    assert not any(facts["visible_before_written"] for facts in result.check().values)
    assert [p.name for p in tmp_path.glob(".*")] == []
    # parameters, AdamW state and lr changed by the step after fabric.save are not in the checkpoint
    for facts in launch("tests.scenarios.checkpoints:load", {"out": str(tmp_path)}, num_nodes=1).check().values:
        _assert_exact(facts)
        assert facts["remainder"] == {"note": "hi"}
        assert facts["optimizer_steps_during_load"] == 0  # its state was allocated from the checkpoint


@pytest.mark.parametrize("async_save", [False, True])
def test_one_rank_failing_to_write_fails_all_and_keeps_previous(tmp_path, async_save):
    result = launch(
        "tests.scenarios.checkpoints:fail_writing_on_one_rank",
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
        "tests.scenarios.checkpoints:fail_writing_on_one_rank",
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
        "tests.checkpoint.test_save_load:load_into_another_model",
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
