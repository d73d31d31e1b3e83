"""The examples users copy: examples/train.py and the main job (examples/main_job.py), run as users run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import REPO_ROOT, free_port

sys.path.insert(0, str(REPO_ROOT))
from examples.train import devices_and_nodes, latest_checkpoint  # noqa: E402

TRAIN = REPO_ROOT / "examples" / "train.py"


def test_latest_checkpoint_takes_the_highest_step_and_ignores_other_names(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for name in ("step-000002", "step-000010", "step-9", ".step-000011.staging", "step-000012.tmp", "notes"):
        (tmp_path / name).mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"


def test_devices_and_nodes_follow_the_launcher(monkeypatch):
    """torchrun, srun and mpirun as they set their variables (fabric_hsdp.launchers decides which one it was)."""
    launcher_variables = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    for name in list(os.environ):
        if name == "LT_CLI_USED" or name.startswith("SLURM_") or name in launcher_variables:
            monkeypatch.delenv(name)
    assert devices_and_nodes("auto", None) == ("auto", 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run42")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert devices_and_nodes("auto", None) == (4, 4)
    assert devices_and_nodes(2, 8) == (2, 8)  # explicit values win
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for name, value in dict(SLURM_NTASKS="16", SLURM_NNODES="2", SLURM_PROCID="3", SLURM_STEP_ID="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    assert devices_and_nodes("auto", None) == (8, 2)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "12")  # mpirun inside the allocation: its numbers, not SLURM's
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert devices_and_nodes("auto", None) == (4, 3)
    monkeypatch.setenv("LT_CLI_USED", "1")  # under `fabric run` the CLI's --devices/--num-nodes apply
    assert devices_and_nodes("auto", None) == ("auto", 1)


def _run(command: list[str], timeout: float = 240) -> str:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}\n" + (result.stderr[-6000:])
    )
    return result.stdout + result.stderr


def _torchrun(out_dir: Path, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    return _run([*command, str(free_port()), str(TRAIN), "--out_dir", str(out_dir), *args])


def _loss_at(step: int, output: str) -> str:
    found = re.findall(rf"step {step}/\d+: train loss ([0-9.]+)", output)
    assert found, output[-3000:]
    return found[-1]


@pytest.mark.slow
def test_train_resumes_from_its_sharded_checkpoint_exactly(tmp_path):
    """Stopped at step 4 and started again, training reaches the same loss at step 8 as without the stop.

    The stopped run saves in the background (``--async_save``) and ends right after: the checkpoint must be whole.
    """
    args = ["--log_every", "4", "--batch_size", "4"]
    straight = _torchrun(tmp_path / "straight", "--max_steps", "8", "--save_every", "0", *args)
    stopped = _torchrun(tmp_path / "stopped", "--max_steps", "4", "--save_every", "0", "--async_save", "true", *args)
    assert "saving" in stopped and "in the background" in stopped
    resumed = _torchrun(tmp_path / "stopped", "--max_steps", "8", "--save_every", "0", *args)
    assert "resumed from" in resumed and "step-000004 (step 4)" in resumed
    assert _loss_at(8, resumed) == _loss_at(8, straight)
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir()) == ["step-000004", "step-000008"]


@pytest.mark.slow
def test_main_job_trains_on_two_nodes_converts_and_loads_back(tmp_path):
    """The README's `make main`: two `fabric run` launches, sharded save, convert, inspect, raw load; exit 0."""
    output = _run(
        [sys.executable, str(REPO_ROOT / "examples" / "main_job.py"), "--work_dir", str(tmp_path), "--max_steps", "6"],
        timeout=600,
    )
    assert "main job: all 4 steps passed" in output
    assert (tmp_path / "model.pth").is_file()
    assert "[4/4] ok" in output and "= the first run's final" in output
