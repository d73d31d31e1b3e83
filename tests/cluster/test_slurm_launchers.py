"""The shipped launch recipes on a real two-node SLURM cluster on this machine (tests/helpers/slurm_cluster.py).

Every launch starts examples/train.py as the recipe does (2 nodes x 2 CPU ranks, a 2-layer model, 2 steps) and each
rank writes a JSON report (``--report_dir``): the launcher and cluster environment it detected, its global/node/local
rank, host, device and mesh coordinates, and the launcher's own variables. The tests check those against what the
launcher set, and chain the launches through one checkpoint directory, so each launch resumes what another launcher
wrote. Job states come from ``scontrol show job``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.launch import REPO_ROOT
from tests.helpers.slurm_cluster import NODES, SlurmCluster

pytestmark = pytest.mark.slow

TRAIN = REPO_ROOT / "examples" / "train.py"
LAUNCH = REPO_ROOT / "examples" / "launch"
TINY = ["--model.n_layers", "2", "--batch_size", "2", "--seq_len", "32", "--save_every", "0"]
VENV = Path(sys.executable).parents[1]
ON_CPU = ["--nodes=2", "--ntasks-per-node=2", "--gres=none", "--cpus-per-task=1", "--time=10"]  # over #SBATCH lines
MESH_COORDINATES = {0: [0, 0], 1: [0, 1], 2: [1, 0], 3: [1, 1]}  # (replicate, shard) of 2 nodes x 2 ranks
LAUNCH_TIMEOUT = 240  # seconds; a launch takes 15-40 s on 2 cores depending on load

Ranks = Callable[[dict[str, Any]], tuple[int, int, int]]


def recipe_env(cluster: SlurmCluster, out_dir: Path, **extra: str) -> dict[str, str]:
    """The recipes' settings for CPU (see their headers); the venv's programs first on PATH."""
    path = f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"
    settings = dict(ACCELERATOR="cpu", PRECISION="32-true", OUT_DIR=str(out_dir), VENV=str(VENV), PATH=path)
    return cluster.env(**settings, **extra)


def sbatch(
    cluster: SlurmCluster, output: Path, options: list[str], script: Path, args: list[str], env: dict[str, str]
) -> tuple[dict[str, str], str]:
    """Submit a batch script and wait for its end; returns (``scontrol show job``'s fields, the job's output).

    Polls ``scontrol`` every 0.2 s rather than ``sbatch --wait``, which checks every few seconds only.
    """
    result = cluster.run(
        "sbatch", "--parsable", f"--output={output}", *options, str(script), *args,
        timeout=60, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    job = re.match(r"\d+", result.stdout.strip())
    assert job and result.returncode == 0, f"sbatch failed: {result.stdout}\n{cluster.logs()}"
    info = cluster.job(job.group(), timeout=LAUNCH_TIMEOUT)
    return info, output.read_text() if output.exists() else ""


def read_reports(directory: Path, count: int = 4) -> list[dict[str, Any]]:
    reports = [json.loads(path.read_text()) for path in directory.glob("rank*.json")]
    assert len(reports) == count, f"{len(reports)} rank reports in {directory}, expected {count}"
    return sorted(reports, key=lambda report: report["global_rank"])


def check_completed(cluster: SlurmCluster, info: dict[str, str], log: str) -> None:
    state = (info["JobState"], info["ExitCode"])
    assert state == ("COMPLETED", "0:0"), f"job {info['JobId']}: {state}\n{log[-6000:]}\n{cluster.logs()}"


def check_ranks(
    reports: list[dict[str, Any]],
    log: str,
    *,
    launcher: str,
    environment: str,
    launcher_ranks: Ranks,
    step: int,
    resumed_from: int,
    hosts_in_node_order: bool = True,
) -> None:
    """Every rank's facts against what its launcher set; hosts against node ranks; training finished."""
    context = f"\n{json.dumps(reports, indent=1)[-6000:]}\n{log[-4000:]}"
    assert [report["global_rank"] for report in reports] == [0, 1, 2, 3], context
    for report in reports:
        ranks = (report["global_rank"], report["node_rank"], report["local_rank"])
        assert ranks == launcher_ranks(report), context
        assert (report["launcher"], report["cluster_environment"]) == (launcher, environment), context
        assert (report["world_size"], report["num_nodes"], report["device"]) == (4, 2, "cpu"), context
        expected_mesh = MESH_COORDINATES[report["global_rank"]]
        assert report["topology_coordinates"] == report["mesh_coordinate"] == expected_mesh, context
        assert (report["finished"], report["step"], report["resumed_from"]) == (True, step, resumed_from), context
        if hosts_in_node_order:
            assert report["hostname"] == NODES[report["node_rank"]], context
    hosts = [{report["hostname"] for report in reports if report["node_rank"] == node} for node in (0, 1)]
    assert all(len(names) == 1 for names in hosts) and hosts[0] | hosts[1] == set(NODES), context
    # the strategy's start-up line, on global rank 0 only
    start_up = rf"fabric_hsdp: launched by {launcher}\b.*: cluster environment {environment}"
    assert len(re.findall(start_up, log)) == 1, log[-6000:]


def slurm_ranks(report: dict[str, Any]) -> tuple[int, int, int]:
    variables = report["variables"]
    return int(variables["SLURM_PROCID"]), int(variables["SLURM_NODEID"]), int(variables["SLURM_LOCALID"])


def mpi_ranks(report: dict[str, Any]) -> tuple[int, int, int]:
    variables = report["variables"]
    # MPIEnvironment's node rank: the host's place among the sorted host names
    node = sorted(NODES).index(report["hostname"])
    return int(variables["OMPI_COMM_WORLD_RANK"]), node, int(variables["OMPI_COMM_WORLD_LOCAL_RANK"])


def torchrun_ranks(report: dict[str, Any]) -> tuple[int, int, int]:
    variables = report["variables"]
    return int(variables["RANK"]), int(variables["GROUP_RANK"]), int(variables["LOCAL_RANK"])


def assert_slurm_variables_misled(reports: list[dict[str, Any]]) -> None:
    """What Lightning alone would have used under mpirun/torchrun: SLURM's variables, which name other ranks."""
    claimed = [int(report["variables"]["SLURM_PROCID"]) for report in reports]
    assert claimed != [0, 1, 2, 3] and len(set(claimed)) < 4, claimed


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_sbatch_recipe_then_mpirun_inside_sbatch_resumes_its_checkpoint(slurm_cluster, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    env = recipe_env(slurm_cluster, checkpoints)
    args = [*TINY, "--log_every", "1", "--max_steps", "2", "--report_dir", str(tmp_path / "srun")]
    info, log = sbatch(slurm_cluster, tmp_path / "srun.out", ON_CPU, LAUNCH / "slurm.sbatch", args, env)
    check_completed(slurm_cluster, info, log)
    reports = read_reports(tmp_path / "srun")
    check_ranks(reports, log, launcher="srun", environment="SLURMEnvironment", launcher_ranks=slurm_ranks, step=2,
                resumed_from=0)  # fmt: skip
    assert {report["variables"]["SLURM_JOB_NAME"] for report in reports} == {"hsdp-train"}
    assert (checkpoints / "step-000002").is_dir()

    # mpirun.sh as the batch script: Open MPI starts its daemon on n2 through srun; every rank inherits SLURM variables
    args = [*TINY, "--log_every", "1", "--max_steps", "4", "--report_dir", str(tmp_path / "mpirun")]
    options = ["--nodes=2", "--ntasks-per-node=2", "--time=10"]
    info, log = sbatch(slurm_cluster, tmp_path / "mpirun.out", options, LAUNCH / "mpirun.sh", args, env)
    check_completed(slurm_cluster, info, log)
    reports = read_reports(tmp_path / "mpirun")
    check_ranks(reports, log, launcher="mpirun", environment="MPIEnvironment", launcher_ranks=mpi_ranks, step=4,
                resumed_from=2)  # fmt: skip
    assert_slurm_variables_misled(reports)
    assert "the SLURM variables it inherited (SLURM_PROCID=0, SLURM_NTASKS=4) describe the allocation" in log
    assert "resumed from" in log and "step-000002 (step 2)" in log


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_salloc_mpirun_then_interactive_srun_then_torchrun_resume_each_other(slurm_cluster, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    env = recipe_env(slurm_cluster, checkpoints)

    def run(*command: str, name: str, steps: int, extra_env: dict[str, str] | None = None) -> str:
        args = [*TINY, "--log_every", "1", "--max_steps", str(steps), "--report_dir", str(tmp_path / name)]
        result = slurm_cluster.run(
            *command, *args, timeout=LAUNCH_TIMEOUT, env=dict(env, **(extra_env or {})), cwd=REPO_ROOT
        )
        assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}\n{result.stdout[-6000:]}"
        return result.stdout

    # mpirun inside an interactive allocation: mpirun runs here (outside n1/n2) and starts orted on both through srun
    log = run("salloc", "--nodes=2", "--ntasks-per-node=2", "bash", str(LAUNCH / "mpirun.sh"), name="salloc-mpirun",
              steps=2)  # fmt: skip
    reports = read_reports(tmp_path / "salloc-mpirun")
    check_ranks(reports, log, launcher="mpirun", environment="MPIEnvironment", launcher_ranks=mpi_ranks, step=2,
                resumed_from=0)  # fmt: skip
    assert_slurm_variables_misled(reports)
    check_completed(slurm_cluster, slurm_cluster.job(reports[0]["variables"]["SLURM_JOB_ID"]), log)

    # srun in a salloc allocation: the job is named "interactive", which Lightning alone takes for a login shell
    train = [sys.executable, str(TRAIN), "--accelerator", "cpu", "--out_dir", str(checkpoints)]
    log = run("salloc", "--nodes=2", "--ntasks-per-node=2", "srun", "--kill-on-bad-exit=1", *train,
              name="salloc-srun", steps=4)  # fmt: skip
    reports = read_reports(tmp_path / "salloc-srun")
    check_ranks(reports, log, launcher="srun", environment="SLURMEnvironment", launcher_ranks=slurm_ranks, step=4,
                resumed_from=2)  # fmt: skip
    assert {report["variables"]["SLURM_JOB_NAME"] for report in reports} == {"interactive"}
    assert "SLURM_JOB_NAME=interactive is a salloc shell's, but srun started this step" in log
    check_completed(slurm_cluster, slurm_cluster.job(reports[0]["variables"]["SLURM_JOB_ID"]), log)

    # torchrun.sh once per node (the seed user's two launches, c10d rendezvous at n1); node ranks by arrival. Port
    # 29400 is n1's in the cluster's network namespace: nothing outside it can hold it
    rendezvous = dict(RDZV_HOST="n1", RDZV_PORT="29400", NNODES="2", GPUS_PER_NODE="2", JOB_ID=f"hsdp-{os.getpid()}")
    log = run("srun", "--nodes=2", "--ntasks-per-node=1", "bash", str(LAUNCH / "torchrun.sh"), name="torchrun",
              steps=6, extra_env=rendezvous)  # fmt: skip
    reports = read_reports(tmp_path / "torchrun")
    check_ranks(reports, log, launcher="torchrun", environment="TorchElasticEnvironment",
                launcher_ranks=torchrun_ranks, step=6, resumed_from=4, hosts_in_node_order=False)  # fmt: skip
    check_completed(slurm_cluster, slurm_cluster.job(reports[0]["variables"]["SLURM_JOB_ID"]), log)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-000002", "step-000004", "step-000006"]


def srun_task_states(log: str) -> dict[int, str]:
    """``srun: error: n2: tasks 2-3: Killed`` lines as {task: state}."""
    states = {}
    for tasks, state in re.findall(r"srun: error: \S+: tasks? ([\d,\-]+): (.+)", log):
        for part in tasks.split(","):
            first, _, last = part.partition("-")
            for task in range(int(first), int(last or first) + 1):
                states[task] = state.strip()
    return states


@pytest.mark.timeout(LAUNCH_TIMEOUT + 180)
def test_a_node_killed_mid_training_ends_every_rank_and_fails_the_job_within_60_s(slurm_cluster, tmp_path):
    """SIGKILL to n2's two ranks while training: the recipe's job ends FAILED, every task non-zero, in < 60 s."""
    reports_dir, output = tmp_path / "reports", tmp_path / "job.out"
    args = [*TINY, "--log_every", "50", "--max_steps", "1000000", "--report_dir", str(reports_dir)]
    env = recipe_env(slurm_cluster, tmp_path / "checkpoints")
    submitted = slurm_cluster.run(
        "sbatch", "--parsable", f"--output={output}", *ON_CPU, str(LAUNCH / "slurm.sbatch"), *args,
        timeout=60, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and job_id.isdigit(), submitted.stdout
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while len(list(reports_dir.glob("rank*.json"))) < 4:  # written once set up, just before the first step
            log = output.read_text() if output.exists() else ""
            state = slurm_cluster.job(job_id, timeout=0)["JobState"]
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {state} before training\n{log[-6000:]}"
            assert time.monotonic() < deadline, f"ranks not training after {LAUNCH_TIMEOUT} s\n{log[-6000:]}"
            time.sleep(0.5)
        time.sleep(2)  # into the training loop
        reports = read_reports(reports_dir)
        victims = [report["pid"] for report in reports if report["hostname"] == "n2"]
        survivors = [report["pid"] for report in reports if report["hostname"] == "n1"]
        assert len(victims) == len(survivors) == 2 and not any(report["finished"] for report in reports)
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        while any(os.path.exists(f"/proc/{pid}") for pid in survivors) and time.monotonic() < killed_at + 90:
            time.sleep(0.1)
        ranks_gone = time.monotonic() - killed_at
        info = slurm_cluster.job(job_id, timeout=90)  # polls every 0.2 s (sbatch --wait polls far less often)
        job_ended = time.monotonic() - killed_at
    finally:
        slurm_cluster.cancel_all()  # nothing left to cancel unless the test failed
    log = output.read_text()
    states = srun_task_states(log)
    print(
        f"n2 killed: n1's ranks gone after {ranks_gone:.1f} s, job {info['JobState']} after {job_ended:.1f} s: {states}"
    )
    assert ranks_gone < 60 and job_ended < 60, f"{ranks_gone:.1f} s, {job_ended:.1f} s\n{log[-6000:]}"
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{log[-6000:]}"
    assert sorted(states) == [0, 1, 2, 3] and "exit code 0" not in " ".join(states.values()), f"{states}\n{log[-6000:]}"


def test_tasks_per_node_unlike_devices_stops_every_rank_with_one_message(slurm_cluster, tmp_path):
    """srun --ntasks-per-node=2 with Fabric(devices=1): each rank stops before any process group, same message."""
    started = time.monotonic()
    result = slurm_cluster.run(
        "srun", "--label", "--nodes=1", "--ntasks-per-node=2", sys.executable, str(TRAIN), "--accelerator", "cpu",
        "--devices", "1", "--out_dir", str(tmp_path / "out"),
        timeout=LAUNCH_TIMEOUT, env=slurm_cluster.env(), cwd=REPO_ROOT,
    )  # fmt: skip
    seconds = time.monotonic() - started
    assert result.returncode != 0, result.stdout[-6000:]
    message = "started 2 process(es) on this node, but Fabric(devices=1) expects 1. Pass devices= equal to"
    # one line for the job, from task 0 (fabric_hsdp/processes/failures.py); task 1 exits 1 quietly
    pattern = rf"^0: fabric-hsdp: error: srun \(SLURM_JOB_ID=\d+, .*\) {re.escape(message)}"
    assert re.search(pattern, result.stdout, re.MULTILINE), result.stdout[-6000:]
    assert not re.search(r"^1: .*(Error|error)", result.stdout, re.MULTILINE), result.stdout[-6000:]
    assert "Initializing distributed" not in result.stdout and not (tmp_path / "out").exists()
    assert seconds < LAUNCH_TIMEOUT / 2, f"{seconds:.0f} s"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_srun_cyclic_distribution_fails_every_rank_with_the_fix(slurm_cluster, tmp_path):
    """``srun --distribution=cyclic`` numbers ranks round-robin over n1 and n2: setup stops every rank and says why."""
    env = recipe_env(slurm_cluster, tmp_path / "checkpoints")
    train = [sys.executable, str(TRAIN), "--accelerator", "cpu", "--out_dir", str(tmp_path / "checkpoints")]
    result = slurm_cluster.run(
        "salloc", "--nodes=2", "--ntasks-per-node=2", "srun", "--distribution=cyclic", *train, *TINY,
        "--max_steps", "1", timeout=LAUNCH_TIMEOUT, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    log = result.stdout
    assert result.returncode != 0, log[-6000:]
    assert srun_task_states(log) == dict.fromkeys(range(4), "Exited with exit code 1"), log[-6000:]
    assert "n1 (node rank 0): ranks [0, 2]; n2 (node rank 1): ranks [1, 3]" in log, log[-6000:]
    assert "srun --distribution=block" in log
