"""The package's error types: each failure raises the type its docs promise, under the one base class."""

import logging
import os
from pathlib import Path

import pytest
import torch

import fabric_hsdp
from fabric_hsdp.checkpoint import open_checkpoint, write_safetensors
from fabric_hsdp.checkpoint.core import fileio
from fabric_hsdp.errors import CheckpointError, FabricHSDPError, NoLayoutFitsError, PeerRankError, SaveError


@pytest.mark.parametrize("error", [CheckpointError, NoLayoutFitsError, PeerRankError, SaveError])
def test_every_error_of_the_package_has_the_one_base_class(error):
    assert issubclass(error, FabricHSDPError)


def test_no_layout_fits_is_raised_as_the_package_error_and_stays_a_value_error():
    from fabric_hsdp.planning import Cluster, Training, Workload, load_model_shape, make_plan
    from fabric_hsdp.planning.plan import no_fit_error

    shape = load_model_shape(Path(__file__).parent.parent / "examples" / "plan" / "llama-65b.json")
    plan = make_plan(shape, Cluster(2, 8, "80GB"), Training("bf16-mixed", Workload(1, 4096)))
    assert plan.recommended is None
    with pytest.raises(FabricHSDPError) as caught:
        raise no_fit_error(plan)
    assert isinstance(caught.value, NoLayoutFitsError) and isinstance(caught.value, ValueError)
    assert caught.value.plan is plan and "no layout fits" in str(caught.value)
    assert fabric_hsdp.planning.NoLayoutFitsError is NoLayoutFitsError


def test_a_file_that_ends_early_raises_checkpoint_error_naming_it(tmp_path):
    file = tmp_path / "model.safetensors"
    write_safetensors(file, {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(4096)})
    with pytest.raises(CheckpointError, match=r"'.*model.safetensors' is truncated: tensor 'b' ends at byte"):
        open_checkpoint(file.write_bytes(file.read_bytes()[:-1024]) and file)  # caught from the header at open
    # Shrunk after it was opened (or a reader whose header says nothing of sizes): the positioned read finds it.
    fd = os.open(file, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match=r"'model.safetensors' is truncated: a tensor needs bytes 0\.\.65536"):
            fileio.read_tensor(fd, 0, [16384], torch.float32, file_name="model.safetensors")
    finally:
        os.close(fd)


def test_load_warnings_are_said_by_rank_zero_only(tmp_path, caplog, monkeypatch):
    from lightning_utilities.core.rank_zero import rank_zero_only

    torch.save({"a": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    said = {}
    for rank in (1, 0, None):  # None: Lightning never set the rank (the offline tools): the one process says it
        monkeypatch.setattr(rank_zero_only, "rank", rank, raising=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fabric_hsdp"):
            open_checkpoint(tmp_path / "old.pt", weights_only=False).close()
        said[rank] = caplog.text
    assert said[1] == ""
    for rank in (0, None):
        assert "legacy (non-zip) torch file" in said[rank] and "weights_only=False" in said[rank]


def fail_in_set_up(num_nodes: int, devices: int, failure: str) -> None:
    """A user's script whose strategy is given a shard_size that divides nothing, or whose own code fails after."""
    from tests.helpers.training import make_fabric

    if failure == "bad shard_size":
        make_fabric(num_nodes, devices, shard_size=3)
    fabric = make_fabric(num_nodes, devices)
    if failure == "rank 1 alone":  # rank 0 ends normally: nobody else would report rank 1's error
        if fabric.global_rank == 1:
            from fabric_hsdp.topology import Topology

            Topology.resolve(3, 1, 2, 2)
        return
    raise KeyError("the script's own error")


def _combined_output(result) -> str:
    return "".join(rank.stdout + rank.stderr for rank in result.ranks)


@pytest.mark.timeout(240)
def test_a_package_error_ends_the_job_with_one_line_on_rank_zero():
    """#34: 4 ranks printed 4 tracebacks of the same ValueError; rank 0 now prints its one line, the others nothing."""
    from tests.helpers.launch import launch

    result = launch(fail_in_set_up, {"failure": "bad shard_size"}, timeout=100, fail_grace=60)
    output = _combined_output(result)
    assert not result.timed_out and result.returncodes == [1, 1, 1, 1], output
    reason = [line for line in output.splitlines() if "shard_size(3) does not divide WORLD_SIZE(4)" in line]
    assert reason == [
        "fabric-hsdp: error: shard_size(3) does not divide WORLD_SIZE(4) = num_nodes(2) * ranks_per_node(2):"
        " replicate_size would be 1.33333. Choose a divisor: [1, 2, 4]. (set FABRIC_HSDP_DEBUG=1 for the traceback)"
    ], output
    assert reason[0] in result.ranks[0].stderr
    assert "Traceback" not in output, output
    assert not any(text in output for text in ("terminate called", "Fatal Python error", "core dumped")), output


@pytest.mark.timeout(240)
def test_the_traceback_stays_with_fabric_hsdp_debug_and_for_errors_not_of_the_package():
    from tests.helpers.launch import launch

    debug = launch(
        fail_in_set_up,
        {"failure": "bad shard_size"},
        num_nodes=1,
        timeout=100,
        fail_grace=60,
        env={"FABRIC_HSDP_DEBUG": "1"},
    )
    for rank in debug.ranks:
        assert rank.returncode == 1 and "Traceback" in rank.stderr, rank.stderr
        assert "ValueError: shard_size(3) does not divide" in rank.stderr and "fabric-hsdp: error" not in rank.stderr
    own = launch(fail_in_set_up, {"failure": "script"}, num_nodes=1, timeout=100, fail_grace=60)
    for rank in own.ranks:
        assert rank.returncode == 1 and 'KeyError: "the script\'s own error"' in rank.stderr, rank.stderr
        assert "Traceback" in rank.stderr and "fabric-hsdp: error" not in rank.stderr


@pytest.mark.timeout(240)
def test_a_package_error_on_one_rank_alone_is_reported_by_that_rank():
    from tests.helpers.launch import launch

    result = launch(fail_in_set_up, {"failure": "rank 1 alone"}, num_nodes=1, timeout=100)
    assert result.returncodes == [0, 1], _combined_output(result)
    reported = [line for line in _combined_output(result).splitlines() if "fabric-hsdp: error" in line]
    assert len(reported) == 1 and reported[0] in result.ranks[1].stderr, _combined_output(result)
    assert reported[0].startswith("fabric-hsdp: error on rank 1: shard_size(3) does not divide"), reported
    assert "fabric-hsdp: error" not in result.ranks[0].stderr


def test_a_package_error_tells_torchrun_its_reason(tmp_path, monkeypatch, capsys):
    """Under torchrun the summary's root cause showed a link to torch's docs; rank 0's error file now holds the line."""
    from fabric_hsdp.processes import failures

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.delenv("FABRIC_HSDP_DEBUG", raising=False)
    try:
        from fabric_hsdp.topology import Topology

        Topology.resolve(3, 1, 2, 2)
    except ValueError as error:
        failures.PackageErrorHook(previous=None)(ValueError, error, error.__traceback__)
    line = capsys.readouterr().err.strip()
    assert line.startswith("fabric-hsdp: error: shard_size(3) does not divide WORLD_SIZE(2)"), line
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    summary = ChildFailedError("finetune.py", {0: ProcessFailure(0, 1234, 1, str(tmp_path / "error.json"))})
    assert f"traceback : {line}\n" in summary.format_msg(), summary.format_msg()
