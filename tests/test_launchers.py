"""Launcher detection (fabric_hsdp/processes/launchers.py) from the variables each launcher sets, in-process.

The variables are those seen on the SLURM test cluster (tests/cluster/, which runs the real launchers) and, for LSF's
jsrun, which cannot run here, those IBM documents and Lightning's LSFEnvironment reads.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
from lightning.fabric.plugins.environments import (
    LightningEnvironment,
    LSFEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from fabric_hsdp import HybridFSDPStrategy
from fabric_hsdp.processes.launchers import (
    FABRIC_RUN,
    JSRUN,
    MPIRUN,
    NO_LAUNCHER,
    SBATCH_SCRIPT,
    SRUN,
    TORCHRUN,
    Launcher,
    check_launch,
    describe_launch,
    detect_launcher,
    environment_for,
)

# What `sbatch --nodes=2 --ntasks-per-node=2` gives the batch script (SLURM 22.05, seen on the test cluster).
BATCH_STEP = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NAME": "hsdp-train",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}
# ... and one task of `srun` in it
SRUN_TASK = dict(
    BATCH_STEP,
    SLURM_STEP_ID="0",
    SLURM_STEP_NUM_TASKS="4",
    SLURM_STEP_NUM_NODES="2",
    SLURM_STEP_TASKS_PER_NODE="2(x2)",
    SLURM_PROCID="3",
    SLURM_LOCALID="1",
    SLURM_NODEID="1",
)
OPEN_MPI = {
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "PMIX_RANK": "2",
}
# rank 2 of `mpirun -np 4` in that batch script runs on the second node, under the srun step that started orted
MPI_RANK_ON_SECOND_NODE = dict(
    BATCH_STEP, SLURM_STEP_ID="0", SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0", **OPEN_MPI
)
TORCHRUN_WORKER = {
    "TORCHELASTIC_RUN_ID": "run42",
    "WORLD_SIZE": "16",
    "LOCAL_WORLD_SIZE": "8",
    "RANK": "9",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
}
# what a `fabric run --accelerator cpu --devices 2 --num-nodes 2` process sees (measured with `fabric-hsdp run`):
# Lightning's LT_* variables, then torchrun's, whose rendezvous id Lightning leaves at torchrun's default "none"
FABRIC_RUN_WORKER = {
    "LT_CLI_USED": "1",
    "LT_ACCELERATOR": "cpu",
    "LT_DEVICES": "2",
    "LT_NUM_NODES": "2",
    "LT_STRATEGY": "hsdp",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
}
JSRUN_TASK = {
    "LSB_JOBID": "4242",
    "JSM_NAMESPACE_SIZE": "4",
    "JSM_NAMESPACE_LOCAL_SIZE": "2",
    "JSM_NAMESPACE_RANK": "3",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
    # jsrun (IBM Spectrum MPI underneath) also sets Open MPI's variables
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "3",
}


@pytest.mark.parametrize(
    ("environ", "name", "world_size", "ranks_per_node", "num_nodes"),
    [
        pytest.param({}, NO_LAUNCHER, None, None, None, id="nothing"),
        pytest.param(SRUN_TASK, SRUN, 4, 2, 2, id="srun"),
        pytest.param(dict(SRUN_TASK, SLURM_JOB_NAME="interactive"), SRUN, 4, 2, 2, id="srun-in-salloc"),
        pytest.param(dict(SRUN_TASK, PMIX_RANK="3"), SRUN, 4, 2, 2, id="srun-mpi-pmix-direct"),
        pytest.param(dict(SRUN_TASK, PMI_SIZE="4", PMI_RANK="3"), SRUN, 4, 2, 2, id="srun-mpi-pmi2-direct"),
        pytest.param(dict(SRUN_TASK, SLURM_STEP_TASKS_PER_NODE="2,1"), SRUN, 4, None, 2, id="srun-uneven"),
        pytest.param(BATCH_STEP, SBATCH_SCRIPT, 4, None, None, id="batch-script-without-srun"),
        pytest.param(
            {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "interactive"},
            NO_LAUNCHER,
            None,
            None,
            None,
            id="salloc-shell",
        ),  # fmt: skip
        pytest.param(dict(BATCH_STEP, **OPEN_MPI), MPIRUN, 4, 2, 2, id="mpirun-in-sbatch-first-node"),
        pytest.param(MPI_RANK_ON_SECOND_NODE, MPIRUN, 4, 2, 2, id="mpirun-in-sbatch-second-node"),
        pytest.param(dict(PMI_SIZE="8", PMI_RANK="5", MPI_LOCALNRANKS="4"), MPIRUN, 8, 4, 2, id="mpich-hydra"),
        pytest.param(dict(SRUN_TASK, **TORCHRUN_WORKER), TORCHRUN, 16, 8, 2, id="torchrun-under-srun"),
        pytest.param(FABRIC_RUN_WORKER, FABRIC_RUN, 4, 2, 2, id="fabric-run"),
        pytest.param(dict(TORCHRUN_WORKER, TORCHELASTIC_RUN_ID="none"), TORCHRUN, 16, 8, 2, id="torchrun-no-rdzv-id"),
        pytest.param(dict(JSRUN_TASK, LSB_DJOB_RANKFILE="/x"), JSRUN, 4, 2, 2, id="jsrun-with-openmpi-variables"),
        pytest.param(dict(OPEN_MPI, LSB_JOBID="4242", LSB_DJOB_RANKFILE="/x"), MPIRUN, 4, 2, 2, id="mpirun-in-bsub"),
    ],
)
def test_the_innermost_launcher_is_detected(environ, name, world_size, ranks_per_node, num_nodes):
    launcher = detect_launcher(environ)
    assert (launcher.name, launcher.world_size, launcher.ranks_per_node, launcher.num_nodes) == (
        name,
        world_size,
        ranks_per_node,
        num_nodes,
    )


def test_evidence_names_the_variables_that_decided():
    launcher = detect_launcher(MPI_RANK_ON_SECOND_NODE)
    assert launcher.title == "mpirun (Open MPI)"
    assert launcher.evidence == ("OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_SIZE=2")


def test_srun_inside_salloc_gets_slurm_environment_without_the_srun_warning(monkeypatch):
    environ = dict(SRUN_TASK, SLURM_JOB_NAME="interactive")
    _set_environ(monkeypatch, environ)
    with pytest.warns(UserWarning, match="`srun` command is available on your system but is not used"):
        assert not SLURMEnvironment.detect()  # what Lightning alone concludes: "a shell, srun not used"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        environment = environment_for(detect_launcher())
    assert isinstance(environment, SLURMEnvironment)
    assert (environment.global_rank(), environment.local_rank(), environment.node_rank()) == (3, 1, 1)
    assert [str(warning.message) for warning in caught] == []
    # a job Lightning does recognise, and a single task, are left to Lightning
    _set_environ(monkeypatch, SRUN_TASK)
    assert environment_for(detect_launcher()) is None
    single = dict(SRUN_TASK, SLURM_JOB_NAME="bash", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
    assert environment_for(detect_launcher(single)) is None


def test_mpirun_needs_mpi4py_and_says_how_to_get_it(monkeypatch):
    import lightning.fabric.plugins.environments.mpi as lightning_mpi

    monkeypatch.setattr(lightning_mpi, "_MPI4PY_AVAILABLE", False)
    with pytest.raises(
        ModuleNotFoundError, match=r"^this process was started by mpirun \(Open MPI\).*`pip install mpi4py`"
    ):
        environment_for(detect_launcher(MPI_RANK_ON_SECOND_NODE))
    for environ in (SRUN_TASK, TORCHRUN_WORKER, {}):
        assert environment_for(detect_launcher(environ)) is None


class _RecordingMPIEnvironment(LightningEnvironment):
    """Stands in for Lightning's MPIEnvironment, which would initialise MPI in the test process (singleton, size 1).

    The real one runs under mpirun on the test cluster (tests/cluster/test_slurm_launchers.py).
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True


def test_the_strategy_takes_mpi_over_slurm_and_fabric_keeps_it(monkeypatch):
    import lightning.fabric.plugins.environments as environments
    import lightning.fabric.plugins.environments.mpi as lightning_mpi

    monkeypatch.setattr(environments, "MPIEnvironment", _RecordingMPIEnvironment)
    monkeypatch.setattr(lightning_mpi, "_MPI4PY_AVAILABLE", True)  # CI keeps mpi4py off the venv's path
    _set_environ(monkeypatch, dict(BATCH_STEP, **OPEN_MPI))
    assert SLURMEnvironment.detect()  # Lightning alone would take SLURM's variables: SLURM_PROCID=0 on every rank
    fabric = L.Fabric(strategy=HybridFSDPStrategy(), accelerator="cpu", devices=2, num_nodes=2)
    assert type(fabric.strategy.cluster_environment) is _RecordingMPIEnvironment
    # a cluster environment passed in is kept
    explicit = LightningEnvironment()
    assert HybridFSDPStrategy(cluster_environment=explicit).cluster_environment is explicit


@pytest.mark.filterwarnings("ignore:The `srun` command is available")  # Lightning's, wherever srun is installed
def test_lsf_jsrun_ranks_hosts_and_port_in_process(monkeypatch, tmp_path):
    """What Lightning's LSFEnvironment makes of jsrun's variables (jsrun cannot run here)."""
    import lightning.fabric.plugins.environments.lsf as lightning_lsf

    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch1\nh1\nh1\nh2\nh2\n")  # launch node first, then one line per slot
    _set_environ(monkeypatch, dict(JSRUN_TASK, LSB_DJOB_RANKFILE=str(rankfile)))
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # LSFEnvironment writes both; monkeypatch restores them
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setattr(lightning_lsf.socket, "gethostname", lambda: "h2")
    fabric = L.Fabric(strategy=HybridFSDPStrategy(), accelerator="cpu", devices=2, num_nodes=2)
    environment = fabric.strategy.cluster_environment
    assert isinstance(environment, LSFEnvironment) and environment.creates_processes_externally
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (3, 1, 1, 4)
    assert (environment.main_address, environment.main_port) == ("h1", 10000 + 4242 % 1000)
    launcher = detect_launcher()
    assert launcher.name == JSRUN
    check_launch(launcher, environment, num_nodes=2, ranks_per_node=2, local_rank=1)
    with pytest.raises(ValueError, match=r"jsrun \(LSB_JOBID=4242.*started 2 process\(es\) on this node, but Fabric"):
        check_launch(launcher, environment, num_nodes=1, ranks_per_node=4, local_rank=1)
    assert describe_launch(launcher, environment).endswith("cluster environment LSFEnvironment")


class _SlurmWorld(SLURMEnvironment):
    """SLURMEnvironment as it reads a launch that started ``world_size`` tasks, without SLURM variables here."""

    def __init__(self, world_size: int) -> None:  # no super().__init__(): it checks this process's variables
        self._world_size = world_size

    def world_size(self) -> int:
        return self._world_size


def _lightning_world(world_size: int) -> LightningEnvironment:
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    return environment


def test_check_launch_stops_every_rank_on_a_mismatch_before_any_process_group():
    srun = detect_launcher(SRUN_TASK)
    check_launch(srun, _SlurmWorld(4), num_nodes=2, ranks_per_node=2, local_rank=1)
    # --ntasks-per-node=2 but Fabric(devices=1): the same message on every rank, whatever its local rank
    for local_rank in (0, 1):
        with pytest.raises(ValueError) as error:
            check_launch(srun, _SlurmWorld(4), num_nodes=2, ranks_per_node=1, local_rank=local_rank)
        assert str(error.value) == (
            "srun (SLURM_JOB_ID=7, SLURM_STEP_ID=0, SLURM_NTASKS=4, SLURM_STEP_TASKS_PER_NODE=2(x2),"
            " SLURM_JOB_NAME=hsdp-train) started 2 process(es) on this node, but Fabric(devices=1) expects 1. Pass"
            " devices= equal to the processes the launcher starts per node (torchrun --nproc-per-node, srun"
            " --ntasks-per-node, fabric run --devices)."
        )
    with pytest.raises(ValueError, match=r"started processes on 2 node\(s\), but Fabric\(num_nodes=1\) expects 1"):
        check_launch(srun, _SlurmWorld(4), num_nodes=1, ranks_per_node=2, local_rank=0)
    # a launcher that gives no layout: the world size its environment reads, then this rank's local rank
    srun_without_layout = Launcher(SRUN, ("SLURM_STEP_ID=0",))
    with pytest.raises(ValueError, match=r"num_nodes\(2\) \* devices\(2\) != WORLD_SIZE\(8\) reported by _SlurmWorld"):
        check_launch(srun_without_layout, _SlurmWorld(8), num_nodes=2, ranks_per_node=2, local_rank=0)
    with pytest.raises(
        ValueError, match=r"^this process has LOCAL_RANK=2, but Fabric\(devices=2\) knows only 2 device"
    ):
        check_launch(Launcher(NO_LAUNCHER), _lightning_world(1), num_nodes=2, ranks_per_node=2, local_rank=2)


def test_the_launcher_layout_counts_only_when_the_environment_reads_that_launcher():
    """A one-task srun (job named "interactive") whose Python lets Fabric start 2 processes: srun's 1 per node is not
    the layout then; each of Fabric's processes has LightningEnvironment and the world Fabric made."""
    one_task = dict(SRUN_TASK, SLURM_JOB_NAME="interactive", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NUM_NODES="1")
    one_task.update(SLURM_STEP_TASKS_PER_NODE="1", SLURM_NTASKS="1")
    launcher = detect_launcher(one_task)
    assert (launcher.name, launcher.ranks_per_node) == (SRUN, 1)
    check_launch(launcher, _lightning_world(2), num_nodes=1, ranks_per_node=2, local_rank=1)
    with pytest.raises(ValueError, match=r"started 1 process\(es\) on this node, but Fabric\(devices=2\)"):
        check_launch(launcher, _SlurmWorld(1), num_nodes=1, ranks_per_node=2, local_rank=0)


def test_a_batch_script_without_srun_is_stopped_unless_the_job_has_one_task():
    with pytest.raises(ValueError, match=r"SLURM batch script without srun .*`srun python \.\.\.`"):
        check_launch(detect_launcher(BATCH_STEP), _SlurmWorld(4), num_nodes=2, ranks_per_node=2, local_rank=0)
    one_task = dict(BATCH_STEP, SLURM_NTASKS="1", SLURM_NNODES="1")
    check_launch(detect_launcher(one_task), _SlurmWorld(1), num_nodes=1, ranks_per_node=1, local_rank=0)


@pytest.mark.filterwarnings("ignore:The `srun` command is available")  # SLURMEnvironment() outside srun
def test_the_start_up_line_says_which_launcher_and_why():
    mpi = describe_launch(detect_launcher(MPI_RANK_ON_SECOND_NODE), LightningEnvironment(), MPI_RANK_ON_SECOND_NODE)
    assert mpi == (
        "launched by mpirun (Open MPI) (OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_SIZE=2); the SLURM variables it"
        " inherited (SLURM_PROCID=0, SLURM_NTASKS=1) describe the allocation, not these processes;"
        " LightningEnvironment does not read its variables (passed in, or Fabric started these processes): cluster"
        " environment LightningEnvironment"
    )
    interactive = dict(SRUN_TASK, SLURM_JOB_NAME="interactive")
    line = describe_launch(detect_launcher(interactive), SLURMEnvironment(), interactive)
    assert "SLURM_JOB_NAME=interactive is a salloc shell's, but srun started this step" in line
    torchrun = describe_launch(detect_launcher(TORCHRUN_WORKER), TorchElasticEnvironment(), TORCHRUN_WORKER)
    assert torchrun.startswith("launched by torchrun (TORCHELASTIC_RUN_ID=run42, WORLD_SIZE=16")
    assert describe_launch(Launcher(NO_LAUNCHER), LightningEnvironment(), {}).startswith("no launcher variables")
    fabric_run = describe_launch(detect_launcher(FABRIC_RUN_WORKER), TorchElasticEnvironment(), FABRIC_RUN_WORKER)
    assert fabric_run == (
        "launched by fabric run (LT_CLI_USED=1, LT_DEVICES=2, LT_NUM_NODES=2, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2,"
        " GROUP_RANK=1): cluster environment TorchElasticEnvironment"
    )


def _set_environ(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]) -> None:
    """Replace every launcher variable of this process by ``environ``'s."""
    prefixes = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "MV2_", "JSM_", "LSB_", "TORCHELASTIC_")
    for name in list(os.environ):
        if name.startswith(prefixes) or name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK"):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def test_one_gpu_bound_per_slurm_task_names_the_fix():
    from fabric_hsdp.processes.launchers import one_gpu_per_task

    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "8"}
    message = one_gpu_per_task({**slurm, "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "3"})
    assert "--gpus-per-node=8" in message and "only has [0]" in message and "--ntasks-per-node=8" in message
    assert one_gpu_per_task({**slurm, "SLURM_STEP_GPUS": "3", "CUDA_VISIBLE_DEVICES": "3"}) is not None  # --gpu-bind
    assert one_gpu_per_task({**slurm, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) is None  # the node's GPUs
    assert one_gpu_per_task({**slurm, "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_PER_TASK": "1"}) is None
    assert one_gpu_per_task({"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "0"}) is None  # not in SLURM
