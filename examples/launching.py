"""What the example scripts share about being launched: ``fabric run`` or not, devices and nodes, the newest checkpoint.

One script runs under every launcher. Lightning picks the cluster environment from the variables each one sets
(torchrun's ``TORCHELASTIC_RUN_ID``, SLURM's ``SLURM_NTASKS``, LSF's ``JSM_NAMESPACE_*``, MPI through ``mpi4py``);
the script only has to

* call ``fabric.launch()`` everywhere except under ``fabric run``: under torchrun, SLURM, LSF and MPI it creates no
  process but marks the processes as set up (``setup_module`` raises "you must call .launch()" without it); with plain
  ``python`` it starts the ``devices`` processes itself; under ``fabric run``, ``Fabric()`` has already set them up
  and ``launch()`` raises;
* pass ``devices`` and ``num_nodes`` that multiply to the launcher's world size.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


def launched_by_fabric_cli() -> bool:
    """``fabric run`` sets ``LT_CLI_USED=1`` and ``Fabric()`` then sets up the processes itself.

    In that case ``fabric.launch()`` raises ("processes have already been created"); under torchrun, SLURM, LSF, MPI
    or plain ``python`` it must be called. Lightning decides the same way (``bool(int(LT_CLI_USED))``).
    """
    return bool(int(os.environ.get("LT_CLI_USED", "0")))


def devices_and_nodes(devices: int | str, num_nodes: int | None) -> tuple[int | str, int]:
    """Fill ``"auto"`` devices and unset nodes from what torchrun, SLURM's srun or Open MPI's mpirun started.

    Lightning checks ``devices x num_nodes`` against the launcher's world size, so they must match it. Under
    ``fabric run`` the CLI's ``--devices``/``--num-nodes`` apply (Fabric reads them from the environment); for LSF
    (jsrun) and MPICH pass both explicitly.
    """
    if launched_by_fabric_cli():
        return devices, num_nodes or 1
    env = os.environ
    if devices == "auto" and "LOCAL_WORLD_SIZE" in env:  # torchrun
        devices = int(env["LOCAL_WORLD_SIZE"])
        num_nodes = num_nodes or int(env["WORLD_SIZE"]) // devices
    elif devices == "auto" and "SLURM_NTASKS" in env and env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        devices = int(env["SLURM_NTASKS_PER_NODE"])
        num_nodes = num_nodes or int(env.get("SLURM_NNODES", "1"))
    elif devices == "auto" and "OMPI_COMM_WORLD_LOCAL_SIZE" in env:  # Open MPI's mpirun
        devices = int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
        num_nodes = num_nodes or int(env["OMPI_COMM_WORLD_SIZE"]) // devices
    return devices, num_nodes or 1


def latest_checkpoint(directory: Path) -> Path | None:
    """The ``step-<N>`` directory with the highest N (writes are atomic, so any such name is complete)."""
    if not directory.is_dir():
        return None
    steps = [(int(m.group(1)), entry) for entry in directory.iterdir() if (m := CHECKPOINT_NAME.match(entry.name))]
    return max(steps)[1] if steps else None
