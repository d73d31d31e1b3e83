"""Preemption on the real SLURM cluster: SLURM's pre-kill signal mid-training -> every rank saves at one step, the
job requeues itself, and the restarted job resumes from that step and finishes (examples/finetune.py,
fabric_hsdp.processes.preemption).

The local cluster's slurm.conf leaves ``JobRequeue`` at its default (1: batch jobs may be requeued), and
``scontrol requeue`` is what a job script's own rank 0 runs.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.cluster.test_slurm_launchers import LAUNCH, LAUNCH_TIMEOUT, recipe_env
from tests.helpers.launch import REPO_ROOT

pytestmark = pytest.mark.slow


def tiny_litgpt(directory):
    """A 2-layer litgpt checkpoint with no tokenizer (byte tokens): lit_model.pth + model_config.yaml."""
    import torch
    import yaml
    from litgpt import GPT, Config

    config = dict(name="tiny", block_size=64, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=2,
                  n_query_groups=2, n_embd=32, intermediate_size=64, mlp_class_name="LLaMAMLP",
                  norm_class_name="RMSNorm", bias=False, parallel_residual=False, rotary_percentage=1.0)  # fmt: skip
    directory.mkdir()
    torch.manual_seed(0)
    torch.save(GPT(Config(**config)).state_dict(), directory / "lit_model.pth")
    (directory / "model_config.yaml").write_text(yaml.safe_dump(config))
    return directory


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 120)
def test_usr1_mid_training_saves_on_every_rank_requeues_and_the_restarted_job_finishes(slurm_cluster, tmp_path):
    model = tiny_litgpt(tmp_path / "tiny")
    output, out_dir = tmp_path / "job.out", tmp_path / "run"
    args = ["--checkpoint_dir", str(model), "--max_steps", "40", "--save_every", "0", "--batch_size", "2"]
    args += ["--seq_len", "32", "--log_every", "1", "--export", "false", "--requeue", "true"]
    env = recipe_env(slurm_cluster, out_dir, SCRIPT="examples/finetune.py")
    options = ["--nodes=2", "--ntasks-per-node=1", "--gres=none", "--cpus-per-task=1", "--time=20"]
    options += ["--open-mode=append", "--job-name=finetune"]  # append: the restarted job's lines follow the first's
    submitted = slurm_cluster.run(
        "sbatch", "--parsable", f"--output={output}", *options, str(LAUNCH / "slurm.sbatch"), *args,
        timeout=60, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and job_id.isdigit(), submitted.stdout
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        log = ""
        while not re.search(r"^step 3/40: train loss", log, re.M):
            log = output.read_text() if output.exists() else ""
            state = slurm_cluster.job(job_id, timeout=0)["JobState"]
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {state} before step 3\n{log[-6000:]}"
            assert time.monotonic() < deadline, f"no step 3 after {LAUNCH_TIMEOUT} s\n{log[-6000:]}"
            time.sleep(0.2)
        signalled = slurm_cluster.run("scancel", "--signal=USR1", job_id, timeout=30)
        assert signalled.returncode == 0, signalled.stdout
        deadline = time.monotonic() + 2 * LAUNCH_TIMEOUT
        released = False
        while True:  # REQUEUED/PENDING/RUNNING again, until the second run ends
            info = slurm_cluster.job(job_id, timeout=0)
            if not released and info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
                # slurmctld holds a requeued job back ~2 minutes on purpose (its credential's lifetime); a test
                # need not wait for that, but slurmd refuses a relaunch whose credential is from the same second as
                # the old one's revocation ("Job 1 already killed, do not launch batch job": CI, 2026-12-02)
                time.sleep(2)
                update = slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", timeout=30)
                released = update.returncode == 0
            if int(info.get("Restarts", 0)) >= 1 and info["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING",
                                                                                 "COMPLETING", "REQUEUED"):  # fmt: skip
                break
            assert time.monotonic() < deadline, f"{info}\n{output.read_text()[-6000:]}"
            time.sleep(0.5)
    finally:
        slurm_cluster.cancel_all()
    log = output.read_text()
    context = f"{info}\n{log[-8000:]}\n{slurm_cluster.logs()}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), context
    stopped = re.findall(r"^stopped at step (\d+) on a signal; requeued$", log, re.M)
    assert len(stopped) == 1 and int(stopped[0]) >= 3, context
    step = int(stopped[0])
    # every rank saved that step (rank 0 logs the save once the collective save is done), then the job came back
    assert f"saved {out_dir}/checkpoints/step-{step:06d}" in log, context
    assert "requeued SLURM job" in log, context
    assert f"resumed from {out_dir}/checkpoints/step-{step:06d} (step {step})" in log, context
    resumed = log.split("resumed from", 1)[1]
    assert re.search(rf"^step {step + 1}/40: train loss", resumed, re.M) and "done: fine-tuned val loss" in resumed
    assert not re.search(rf"^step {step}/40:", resumed, re.M), context  # no step trained twice
    assert (out_dir / "checkpoints" / "latest").resolve().name == "step-000040", context
