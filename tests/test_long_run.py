"""A long run as a user lives it: which checkpoint a restarted job resumes, `latest`, `--keep_last`, the global batch
across layouts, and the preemption helper's signals (the SLURM requeue itself: tests/cluster/test_preemption.py)."""

from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

from fabric_hsdp.processes.preemption import Preemption
from tests.helpers.launch import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from examples.finetune import keep_global_batch, resume_from  # noqa: E402
from examples.retention import keep_last, newest_complete, point_latest  # noqa: E402


def dcp_checkpoint(path, value=1.0):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.full((4,), value)}, checkpoint_id=str(path), no_dist=True)
    return path


class Printer(SimpleNamespace):
    """A fabric of one rank; ``lines``: what the examples said, by ``fabric.print`` or on stdout (``say``)."""

    def __init__(self, capsys=None, **kwargs):
        super().__init__(**{"said": [], "global_rank": 0, "world_size": 1, "device": torch.device("cpu"), **kwargs})
        self.capsys = capsys

    def print(self, line):
        self.said.append(line)

    @property
    def lines(self):
        if self.capsys is not None:
            self.said.extend(self.capsys.readouterr().out.splitlines())
        return self.said


def test_resume_skips_incomplete_checkpoints_with_the_reason_and_honours_a_path(tmp_path, capsys):
    checkpoints = tmp_path / "checkpoints"
    dcp_checkpoint(checkpoints / "step-000004")
    dcp_checkpoint(checkpoints / "step-000006")
    (checkpoints / "step-000006" / ".metadata").unlink()  # its writer's files, no metadata: not a checkpoint
    (checkpoints / "step-000008").mkdir()
    (checkpoints / "not-a-step").mkdir()
    fabric = Printer(capsys)
    assert resume_from(fabric, checkpoints, True) == checkpoints / "step-000004"
    assert [line.split(":")[0] for line in fabric.lines] == ["skipped step-000008", "skipped step-000006"]
    assert ".metadata" in fabric.lines[1]
    assert resume_from(fabric, checkpoints, False) is None
    assert resume_from(fabric, checkpoints, str(checkpoints / "step-000004")) == checkpoints / "step-000004"
    with pytest.raises(FileNotFoundError, match=r"--resume '.*step-000006' is not a checkpoint to resume from: "):
        resume_from(fabric, checkpoints, str(checkpoints / "step-000006"))
    assert newest_complete(tmp_path / "missing") == (None, [])


def test_latest_points_at_the_newest_and_keep_last_spares_it(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"step-{step:06d}").mkdir()
    point_latest(tmp_path, tmp_path / "step-000004")
    point_latest(tmp_path, tmp_path / "step-000008")  # replaced, not added to
    assert os.readlink(tmp_path / "latest") == "step-000008"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no pending directory left
    assert keep_last(tmp_path, 0) == []
    point_latest(tmp_path, tmp_path / "step-000002")  # e.g. a run resumed from an old one and saved nothing yet
    removed = keep_last(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000006", "step-000008"]


def test_a_new_data_parallel_size_keeps_the_global_batch_or_says_what_changed(capsys):
    fabric = Printer(capsys)
    saved = {"data_parallel_size": 4, "global_batch": 16}  # 2 x 2 nodes, batch 4
    # 1 x 4 with TP 2: two data-parallel ranks; twice the accumulation keeps 16
    assert keep_global_batch(fabric, dict(saved), batch_size=4, data_ranks=2, accumulate=1) == 2
    assert fabric.lines[-1] == (
        "data-parallel ranks 4 -> 2: gradient accumulation 1 -> 2 keeps the global batch of 16 sequences"
    )
    state = dict(saved)
    assert keep_global_batch(fabric, state, batch_size=3, data_ranks=2, accumulate=1) == 1
    assert "the global batch changes from 16 to 6 sequences" in fabric.lines[-1]
    assert state == {"data_parallel_size": 2, "global_batch": 6}
    lines = len(fabric.lines)
    assert keep_global_batch(fabric, dict(saved), batch_size=4, data_ranks=4, accumulate=1) == 1
    assert len(fabric.lines) == lines  # nothing changed, nothing said


def test_a_signal_requests_a_stop_that_every_rank_agrees_on_at_the_step_boundary(monkeypatch):
    preemption = Preemption()
    try:
        fabric = Printer()
        assert not preemption.stop_requested(fabric)
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only records it: the process goes on
        assert preemption.received == signal.SIGUSR1 and preemption.stop_requested(fabric)
        # another rank received it: the all-reduce (max) of a CPU flag over gloo brings it to this one (a flag on the
        # GPU would wait for the GPU's queued work every step)
        import torch.distributed as dist

        reduced_on = []

        def all_reduce(tensor, op, group):
            reduced_on.append((tensor.device.type, op, group))
            tensor.copy_(torch.maximum(tensor, torch.tensor(int(signal.SIGTERM))))

        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
        other = Preemption()
        assert other.received is None and other.stop_requested(Printer(world_size=2))
        assert reduced_on == [("cpu", dist.ReduceOp.MAX, None)]
        other.close()
    finally:
        preemption.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_requeue_runs_scontrol_on_rank_0_of_a_batch_job_only(monkeypatch, tmp_path):
    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NAME", "finetune")
    preemption = Preemption(signals=(), requeue=True)
    assert not preemption.requeue(Printer(global_rank=1))
    assert preemption.requeue(Printer())
    assert calls.read_text() == "requeue 77\n"
    assert not Preemption(signals=(), requeue=False).requeue(Printer())
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # salloc's shell: nothing to requeue
    assert not preemption.requeue(Printer())
    assert calls.read_text() == "requeue 77\n"
