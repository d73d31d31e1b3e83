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
