"""What the example scripts share about being launched: ``fabric run`` or not, devices and nodes, the newest checkpoint,
a per-rank launch report.

One script runs under every launcher. The cluster environment follows the variables each one sets (torchrun's
``TORCHELASTIC_RUN_ID``, SLURM's ``SLURM_NTASKS``, LSF's ``JSM_NAMESPACE_*``, mpirun's ``OMPI_COMM_WORLD_*`` read
through ``mpi4py``; ``fabric_hsdp.processes.launchers`` picks the innermost launcher where Lightning's order would
not); the script only has to

* call ``fabric.launch()`` everywhere except under ``fabric run``: under torchrun, SLURM, LSF and MPI it creates no
  process but marks the processes as set up (``setup_module`` raises "you must call .launch()" without it); with plain
  ``python`` it starts the ``devices`` processes itself; under ``fabric run``, ``Fabric()`` has already set them up
  and ``launch()`` raises;
* pass ``devices`` and ``num_nodes`` that multiply to the launcher's world size.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from fabric_hsdp.processes.launchers import SBATCH_SCRIPT, detect_launcher

CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


def say(fabric: Any, message: str) -> None:
    """Print a fact of the whole job once, on global rank 0 (``fabric.print`` prints on every node's local rank 0: one
    copy per node)."""
    if fabric.global_rank == 0:
        print(message, flush=True)


def launched_by_fabric_cli() -> bool:
    """``fabric run`` sets ``LT_CLI_USED=1`` and ``Fabric()`` then sets up the processes itself.

    In that case ``fabric.launch()`` raises ("processes have already been created"); under torchrun, SLURM, LSF, MPI
    or plain ``python`` it must be called. Lightning decides the same way (``bool(int(LT_CLI_USED))``).
    """
    return bool(int(os.environ.get("LT_CLI_USED", "0")))


def devices_and_nodes(devices: int | str, num_nodes: int | None) -> tuple[int | str, int]:
    """Fill ``"auto"`` devices and unset nodes from what the launcher started (torchrun, srun, mpirun, jsrun).

    ``fabric_hsdp.processes.launchers`` tells which launcher started the process (mpirun inside a SLURM allocation
    included) and what it started. The strategy checks ``devices x num_nodes`` against that, so they must match it.
    Under ``fabric run`` the CLI's ``--devices``/``--num-nodes`` apply (Fabric reads them from the environment).
    """
    if launched_by_fabric_cli():
        return devices, num_nodes or 1
    launcher = detect_launcher()
    if devices == "auto" and launcher.ranks_per_node and launcher.name != SBATCH_SCRIPT:
        devices = launcher.ranks_per_node
        num_nodes = num_nodes or launcher.num_nodes
    return devices, num_nodes or 1


def write_report(report_dir: Path, fabric: Any, strategy: Any, **facts: object) -> None:
    """Write what this rank knows about its launch to ``<report_dir>/rank<R>.json`` (replaced atomically).

    The launcher and Lightning's cluster environment, global/node/local rank, host, device, mesh coordinates, the
    launcher's own variables, and ``facts``: enough to check a new cluster's launch rank by rank.
    """
    prefixes = ("SLURM_", "OMPI_COMM_WORLD_", "PMIX_RANK", "PMI_", "JSM_NAMESPACE_", "LSB_JOBID", "TORCHELASTIC_")
    torch_names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    variables = {k: v for k, v in os.environ.items() if k.startswith(prefixes) or k in torch_names}
    mesh_coordinate = strategy.device_mesh.get_coordinate()
    report = {
        "launcher": detect_launcher().name,
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "global_rank": fabric.global_rank,
        "node_rank": fabric.node_rank,
        "local_rank": fabric.local_rank,
        "world_size": fabric.world_size,
        "num_nodes": strategy.num_nodes,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(fabric.device),
        "mesh_shape": list(strategy.topology.mesh_shape),
        "topology_coordinates": list(strategy.topology.coordinates(fabric.global_rank)),
        "mesh_coordinate": list(mesh_coordinate) if mesh_coordinate is not None else None,
        "variables": variables,
        **facts,
    }
    report_dir.mkdir(parents=True, exist_ok=True)
    path = report_dir / f"rank{fabric.global_rank}.json"
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(report, indent=1))
    staging.replace(path)


def latest_checkpoint(directory: Path) -> Path | None:
    """The ``step-<N>`` directory with the highest N (writes are atomic, so any such name is complete)."""
    if not directory.is_dir():
        return None
    steps = [(int(m.group(1)), entry) for entry in directory.iterdir() if (m := CHECKPOINT_NAME.match(entry.name))]
    return max(steps)[1] if steps else None
