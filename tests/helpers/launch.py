"""Launch N simulated nodes x M ranks as real processes, the way Lightning's launchers set up the environment.

Each rank runs ``tests/helpers/worker.py``, which imports a scenario function (``module:function``), calls it with the
JSON arguments, and saves what it returns with ``torch.save`` to ``<out_dir>/rank<R>.pt``. The launcher enforces a
timeout, ends every rank as soon as one fails (after a short grace period), and returns what each rank reported.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    """A port the OS reports as free on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RankResult:
    global_rank: int
    returncode: int | None
    stdout: str
    stderr: str
    value: Any = None
    seconds: float = 0.0


@dataclass
class LaunchResult:
    ranks: list[RankResult] = field(default_factory=list)
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def values(self) -> list[Any]:
        return [rank.value for rank in self.ranks]

    @property
    def returncodes(self) -> list[int | None]:
        return [rank.returncode for rank in self.ranks]

    def check(self) -> LaunchResult:
        """Raise with every rank's output unless all ranks exited 0 in time."""
        if self.timed_out or any(code != 0 for code in self.returncodes):
            details = "\n".join(
                f"--- rank {r.global_rank} exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
                for r in self.ranks
            )
            raise AssertionError(f"launch failed (timed_out={self.timed_out}, exits={self.returncodes}):\n{details}")
        return self


def launch(
    scenario: str,
    args: dict[str, Any] | None = None,
    *,
    num_nodes: int = 2,
    ranks_per_node: int = 2,
    timeout: float = 180.0,
    fail_grace: float = 30.0,
    env: dict[str, str] | None = None,
    out_dir: str | Path | None = None,
) -> LaunchResult:
    """Run ``scenario`` (``"tests.scenarios.module:function"``) on ``num_nodes x ranks_per_node`` CPU processes.

    The environment is what Lightning's launchers set: ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` (so Fabric picks ``LightningEnvironment`` and the processes are created externally).
    The scenario receives the JSON ``args`` plus ``num_nodes`` and ``devices``.
    """
    world_size = num_nodes * ranks_per_node
    port = free_port()
    workdir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hsdp-launch-"))
    workdir.mkdir(parents=True, exist_ok=True)
    call_args = dict(args or {}, num_nodes=num_nodes, devices=ranks_per_node)
    processes = []
    start = time.monotonic()
    for node_rank in range(num_nodes):
        for local_rank in range(ranks_per_node):
            global_rank = node_rank * ranks_per_node + local_rank
            rank_env = dict(os.environ)
            rank_env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                NODE_RANK=str(node_rank),
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(world_size),
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT), rank_env.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1",
            )
            rank_env.update(env or {})
            out_file = workdir / f"rank{global_rank}.pt"
            stdout = open(workdir / f"rank{global_rank}.out", "w+")  # noqa: SIM115
            stderr = open(workdir / f"rank{global_rank}.err", "w+")  # noqa: SIM115
            command = [sys.executable, str(WORKER), scenario, json.dumps(call_args), str(out_file)]
            process = subprocess.Popen(command, env=rank_env, stdout=stdout, stderr=stderr, start_new_session=True)
            processes.append((global_rank, process, stdout, stderr, out_file))

    timed_out = False
    deadline = start + timeout
    first_failure: float | None = None
    while True:
        codes = [p.poll() for _, p, *_ in processes]
        if all(code is not None for code in codes):
            break
        now = time.monotonic()
        if first_failure is None and any(code not in (None, 0) for code in codes):
            first_failure = now
        if now > deadline or (first_failure is not None and now - first_failure > fail_grace):
            timed_out = now > deadline
            for _, process, *_ in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
            for _, process, *_ in processes:
                process.wait()
            break
        time.sleep(0.05)

    result = LaunchResult(timed_out=timed_out, seconds=time.monotonic() - start)
    for global_rank, process, stdout, stderr, out_file in processes:
        stdout.seek(0)
        stderr.seek(0)
        value = torch.load(out_file, weights_only=False) if out_file.exists() else None
        result.ranks.append(RankResult(global_rank, process.returncode, stdout.read(), stderr.read(), value))
        stdout.close()
        stderr.close()
    if out_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)  # everything it held is in `result` now
    return result
