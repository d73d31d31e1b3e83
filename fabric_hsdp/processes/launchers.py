"""Which launcher started this process, and the Lightning cluster environment that reads its variables.

Lightning picks a cluster environment in a fixed order: torchrun, SLURM, LSF's jsrun, MPI. Two common launches fall
through that order:

* ``mpirun`` inside a SLURM allocation. Every MPI process inherits SLURM variables that describe someone else: the
  batch step's (``SLURM_PROCID=0`` for every rank on the first node) or those of the ``srun`` step that started Open
  MPI's daemon on the other nodes (``SLURM_NTASKS=1``). Lightning picks ``SLURMEnvironment``, several processes
  believe they are rank 0 (``EADDRINUSE`` on the store port) and others see a world of one.
* ``srun`` inside ``salloc``: the job is named ``interactive`` (or ``bash``), which Lightning takes for a login shell,
  so it skips SLURM, and its MPI check then initialises MPI in a process that no MPI launcher started.

The launcher that started this process is the innermost one, and its variables are the ones that describe it:
torchrun's (``fabric run``'s when its ``LT_CLI_USED`` is set too), then jsrun's (which also sets Open MPI's), then
an MPI launcher's, then srun's. ``HybridFSDPStrategy`` asks this module which one it is, takes Lightning's
environment for it where Lightning's own order would not, and says in its start-up log what it found and why.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # detection itself needs no Lightning
    from lightning.fabric.plugins import ClusterEnvironment

TORCHRUN, FABRIC_RUN, JSRUN, MPIRUN, SRUN, SBATCH_SCRIPT, NO_LAUNCHER = (
    "torchrun",
    "fabric run",
    "jsrun",
    "mpirun",
    "srun",
    "sbatch script",
    "none",
)
_SLURM_SHELL_JOB_NAMES = ("bash", "interactive")  # Lightning's test for "a shell in an allocation, not srun"


@dataclass(frozen=True)
class Launcher:
    """The program that started this process, as the variables it sets show.

    Attributes:
        name: ``"torchrun"``, ``"fabric run"`` (Lightning's ``fabric run`` or ``fabric-hsdp run``, which start
            torchrun), ``"jsrun"``, ``"mpirun"`` (Open MPI, MPICH/Intel MPI's Hydra, MVAPICH),
            ``"srun"``, ``"sbatch script"`` (a SLURM batch script that started Python without ``srun``) or
            ``"none"`` (Fabric starts the processes itself, or the variables were set by hand).
        evidence: ``NAME=value`` of the variables that identify the launcher.
        world_size: Processes it started in all, where it says (for a batch script: the tasks the job asked for).
        ranks_per_node: Processes it started on this node, where it says.
        num_nodes: Nodes it started them on, where it says.
        flavour: Which implementation, e.g. ``"Open MPI"``; empty if there is only one.
        job_name: ``SLURM_JOB_NAME`` for srun (Lightning takes ``bash``/``interactive`` for a shell, not srun).
    """

    name: str
    evidence: tuple[str, ...] = ()
    world_size: int | None = None
    ranks_per_node: int | None = None
    num_nodes: int | None = None
    flavour: str = ""
    job_name: str | None = None

    @property
    def title(self) -> str:
        return f"{self.name} ({self.flavour})" if self.flavour else self.name


def detect_launcher(environ: Mapping[str, str] | None = None) -> Launcher:
    """Identify the launcher of this process from its environment (``os.environ`` by default)."""
    env = os.environ if environ is None else environ

    def evidence(*names: str) -> tuple[str, ...]:
        return tuple(f"{name}={env[name]}" for name in names if name in env)

    if "TORCHELASTIC_RUN_ID" in env:
        world, per_node = _int(env.get("WORLD_SIZE")), _int(env.get("LOCAL_WORLD_SIZE"))
        if env.get("LT_CLI_USED") == "1":  # `fabric run` sets it, then runs torchrun with its default id "none"
            names = ("LT_CLI_USED", "LT_DEVICES", "LT_NUM_NODES", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
            return Launcher(FABRIC_RUN, evidence(*names), world, per_node, _nodes(world, per_node))
        return Launcher(
            TORCHRUN,
            evidence("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
            world,
            per_node,
            _nodes(world, per_node),
        )
    if {"LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE"} <= env.keys():
        world, per_node = _int(env.get("JSM_NAMESPACE_SIZE")), _int(env.get("JSM_NAMESPACE_LOCAL_SIZE"))
        names = ("LSB_JOBID", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_SIZE", "JSM_NAMESPACE_RANK")
        return Launcher(JSRUN, evidence(*names), world, per_node, _nodes(world, per_node))
    for flavour, size, local_size in (
        ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("MPICH/Intel MPI Hydra", "PMI_SIZE", "MPI_LOCALNRANKS"),  # srun --mpi=pmi2 sets PMI_SIZE alone
        ("MVAPICH", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ):
        if size in env and local_size in env:
            world, per_node = _int(env.get(size)), _int(env.get(local_size))
            return Launcher(MPIRUN, evidence(size, local_size), world, per_node, _nodes(world, per_node), flavour)
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is not None and "SLURM_PROCID" in env:
        world = _int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS")))
        per_node = _uniform_count(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")))
        nodes = _int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES")))
        names = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_NAME")
        return Launcher(SRUN, evidence(*names), world, per_node, nodes, job_name=env.get("SLURM_JOB_NAME"))
    if "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in _SLURM_SHELL_JOB_NAMES:
        # the batch script itself: it runs once, on the first node, however many tasks the job asked for
        names = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NNODES")
        return Launcher(SBATCH_SCRIPT, evidence(*names), _int(env.get("SLURM_NTASKS")))
    return Launcher(NO_LAUNCHER)


def environment_for(launcher: Launcher) -> ClusterEnvironment | None:
    """Lightning's cluster environment for ``launcher`` where Lightning's own order would pick another; else ``None``.

    Raises:
        ModuleNotFoundError: An MPI launcher started this process but ``mpi4py`` is not installed.
    """
    if launcher.name == MPIRUN:
        from lightning.fabric.plugins.environments import MPIEnvironment
        from lightning.fabric.plugins.environments.mpi import _MPI4PY_AVAILABLE

        if not _MPI4PY_AVAILABLE:
            raise ModuleNotFoundError(
                f"this process was started by {launcher.title} ({', '.join(launcher.evidence)}), and Lightning's"
                " MPIEnvironment needs mpi4py to learn the ranks and agree on rank 0's address. Install it where"
                " the MPI that provides mpirun is found: `pip install mpi4py`."
            )
        return MPIEnvironment()
    if launcher.name == SRUN and (launcher.world_size or 1) > 1 and launcher.job_name in _SLURM_SHELL_JOB_NAMES:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        with warnings.catch_warnings():  # "srun is available but not used": it is used, Lightning misreads the name
            warnings.filterwarnings("ignore", message=".*`srun` command is available.*")
            return SLURMEnvironment()
    return None


def check_launch(
    launcher: Launcher, environment: ClusterEnvironment, num_nodes: int, ranks_per_node: int, local_rank: int
) -> None:
    """Stop before the process group exists if the launcher did not start what ``Fabric(...)`` expects.

    The checks on the launch as a whole come first: every rank sees the same values and fails with the same message
    instead of waiting in ``init_process_group`` for ranks that already exited. The launcher's layout and world size
    are checked only when ``environment`` reads that launcher's variables (not, e.g., when Fabric started the
    processes itself under a one-task ``srun``).

    Raises:
        ValueError: The launcher's processes per node, nodes or world size differ from ``Fabric(devices=...,
            num_nodes=...)``, or this process's local rank has no device.
    """
    expected = num_nodes * ranks_per_node
    by = f"{launcher.title} ({', '.join(launcher.evidence)})" if launcher.evidence else launcher.title
    reads_launcher = _reads(launcher, environment)
    if launcher.name == SBATCH_SCRIPT and reads_launcher and (launcher.world_size or 1) > 1:
        raise ValueError(
            f"this process was started by a SLURM batch script without srun ({', '.join(launcher.evidence)}): the"
            " script runs once, on the first node, and would wait for ranks that never start. Start Python with"
            " `srun python ...` (see examples/launch/slurm.sbatch)."
        )
    if reads_launcher and launcher.ranks_per_node is not None and launcher.ranks_per_node != ranks_per_node:
        raise ValueError(
            f"{by} started {launcher.ranks_per_node} process(es) on this node, but Fabric(devices={ranks_per_node})"
            f" expects {ranks_per_node}. Pass devices= equal to the processes the launcher starts per node (torchrun"
            " --nproc-per-node, srun --ntasks-per-node, fabric run --devices)."
        )
    if reads_launcher and launcher.num_nodes is not None and launcher.num_nodes != num_nodes:
        raise ValueError(
            f"{by} started processes on {launcher.num_nodes} node(s), but Fabric(num_nodes={num_nodes}) expects"
            f" {num_nodes}. Pass num_nodes= equal to the nodes of the job (torchrun --nnodes, srun --nodes,"
            " fabric run --num-nodes)."
        )
    world_size = environment.world_size()  # Lightning's own environment learns it from Fabric: nothing to check then
    if reads_launcher and world_size != expected:
        raise ValueError(
            f"num_nodes({num_nodes}) * devices({ranks_per_node}) != WORLD_SIZE({world_size}) reported by"
            f" {type(environment).__name__} (launcher: {by}). Pass Fabric(num_nodes=..., devices=...) matching what"
            " the launcher started."
        )
    if local_rank >= ranks_per_node:
        raise ValueError(
            f"this process has LOCAL_RANK={local_rank}, but Fabric(devices={ranks_per_node}) knows only"
            f" {ranks_per_node} device(s) per node. Pass devices= equal to the processes the launcher starts per"
            " node (torchrun --nproc-per-node, srun --ntasks-per-node, fabric run --devices)."
        )


def one_gpu_per_task(environ: Mapping[str, str] | None = None) -> str | None:
    """What to change when SLURM binds one GPU to each task of several on a node, else ``None``.

    With ``--gpus-per-task=1`` (or ``--gpu-bind`` giving one GPU per task) every process sees one device, ``cuda:0``,
    and ``Fabric(devices=8)`` stops with Lightning's "only has [0]" before the strategy can say why.
    """
    env = os.environ if environ is None else environ
    tasks = _uniform_count(env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    visible = [device for device in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if device]
    bound = env.get("SLURM_GPUS_PER_TASK") == "1" or (len(visible) == 1 and "SLURM_STEP_GPUS" in env)
    if "SLURM_JOB_ID" not in env or (tasks or 1) < 2 or not bound:
        return None
    return (
        f"SLURM binds one GPU to each of the {tasks} tasks on this node (--gpus-per-task=1 or --gpu-bind), so each"
        f" process sees only cuda:0 and Fabric(devices={tasks}) fails with 'only has [0]'. Ask for the node's GPUs"
        f" instead: `#SBATCH --gpus-per-node={tasks}` (or --gres=gpu:{tasks}) without --gpus-per-task, and keep"
        f" --ntasks-per-node={tasks}: each rank then takes cuda:LOCAL_RANK."
    )


def describe_launch(
    launcher: Launcher, environment: ClusterEnvironment | None, environ: Mapping[str, str] | None = None
) -> str:
    """One line for the start-up log: the launcher, the variables that identify it, the environment in use."""
    env = os.environ if environ is None else environ
    name = type(environment).__name__ if environment is not None else "none"
    found = f"launched by {launcher.title}"
    if launcher.evidence:
        found += f" ({', '.join(launcher.evidence)})"
    if launcher.name == NO_LAUNCHER:
        found = "no launcher variables (Fabric starts the processes, or they were set by hand)"
    notes = []
    if launcher.name in (TORCHRUN, FABRIC_RUN, JSRUN, MPIRUN) and "SLURM_JOB_ID" in env:
        inherited = ", ".join(f"{key}={env[key]}" for key in ("SLURM_PROCID", "SLURM_NTASKS") if key in env)
        notes.append(
            f"the SLURM variables it inherited ({inherited or 'SLURM_JOB_ID=' + env['SLURM_JOB_ID']}) describe the"
            " allocation, not these processes"
        )
    if launcher.name == SRUN and launcher.job_name in _SLURM_SHELL_JOB_NAMES:
        notes.append(f"SLURM_JOB_NAME={launcher.job_name} is a salloc shell's, but srun started this step")
    if launcher.name != NO_LAUNCHER and environment is not None and not _reads(launcher, environment):
        notes.append(f"{name} does not read its variables (passed in, or Fabric started these processes)")
    note = f"; {'; '.join(notes)}" if notes else ""
    return f"{found}{note}: cluster environment {name}"


def _reads(launcher: Launcher, environment: ClusterEnvironment) -> bool:
    """Whether ``environment`` takes its ranks from ``launcher``'s variables."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    kinds = {
        TORCHRUN: TorchElasticEnvironment,
        FABRIC_RUN: TorchElasticEnvironment,
        JSRUN: LSFEnvironment,
        MPIRUN: MPIEnvironment,
        SRUN: SLURMEnvironment,
        SBATCH_SCRIPT: SLURMEnvironment,
    }
    return launcher.name in kinds and isinstance(environment, kinds[launcher.name])


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None


def _nodes(world_size: int | None, ranks_per_node: int | None) -> int | None:
    if world_size is None or not ranks_per_node or world_size % ranks_per_node:
        return None
    return world_size // ranks_per_node


def _uniform_count(tasks_per_node: str) -> int | None:
    """SLURM's ``2(x3),1`` notation: the count if every node has the same, else ``None``."""
    counts = {int(match.group(1)) for match in re.finditer(r"(\d+)(?:\(x\d+\))?", tasks_per_node)}
    return counts.pop() if len(counts) == 1 else None
