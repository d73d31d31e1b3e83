"""Launch N simulated nodes x M ranks as real processes, the way Lightning's launchers set up the environment.

Each rank runs ``tests/helpers/worker.py``, which imports a scenario function (``module:function``: the body beside
the test that launches it, or a shared one in ``tests/helpers/``), calls it with the JSON arguments, and saves what it
returns with ``torch.save`` to ``<out_dir>/rank<R>.pt``. The launcher enforces a timeout, ends every rank as soon as
one fails (after a short grace period), and returns what each rank reported.
Ranks are forked from a process that has imported torch and Lightning once (see ``forkserver.py``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
FORKSERVER = Path(__file__).with_name("forkserver.py")


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


class _ForkServer:
    """Client of ``forkserver.py``: starts ranks as forks of one process that has imported torch and Lightning."""

    def __init__(self, deadline: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        self._process = subprocess.Popen(
            [sys.executable, str(FORKSERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO_ROOT
        )
        self._pending = b""
        self._returncodes: dict[int, int] = {}
        self._started: list[int] = []
        while not self._read_replies(block=True).get("ready"):
            if time.monotonic() > deadline or self._process.poll() is not None:
                code = self._process.poll()
                self._process.kill()
                raise RuntimeError(f"the fork server did not start in what the test's timeout left (exit {code})")

    def _read_replies(self, block: bool) -> dict[str, Any]:
        """Read what the server has written; returns the last non-exit message (``{"pid"}`` or ``{"ready"}``)."""
        last: dict[str, Any] = {}
        fd = self._process.stdout.fileno()
        while True:
            readable, _, _ = select.select([fd], [], [], 1.0 if block else 0)
            if not readable:
                return last
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the fork server exited (exit {self._process.wait()})")
            self._pending += chunk
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = json.loads(line)
                if "returncode" in message:
                    self._returncodes[message["pid"]] = message["returncode"]
                else:
                    last = message
                    if "pid" in message:
                        self._started.append(message["pid"])
            if last or not block:
                return last

    def start(self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> _ForkedRank:
        request = {"argv": argv, "env": env, "cwd": str(REPO_ROOT), "stdout": str(stdout), "stderr": str(stderr)}
        self._process.stdin.write((json.dumps(request) + "\n").encode())
        self._process.stdin.flush()
        count = len(self._started)
        while len(self._started) == count:
            self._read_replies(block=True)
        return _ForkedRank(self, self._started[-1])

    def returncode(self, pid: int) -> int | None:
        self._read_replies(block=False)
        return self._returncodes.get(pid)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=30)


class _ForkedRank:
    """The ``poll``/``wait``/``pid``/``returncode`` of ``subprocess.Popen`` for a rank the fork server started."""

    def __init__(self, server: _ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode


_server: _ForkServer | None = None

# (seconds, deadline) of the running test's pytest timeout, set by tests/conftest.py; None outside pytest
test_budget: tuple[float, float] | None = None
MARGIN = 15.0  # seconds left to the test after a launch's budget: to collect and report its ranks


def _budget(timeout: float) -> float:
    """``timeout``, cut to what the running test's pytest timeout leaves (see tests/conftest.py)."""
    if test_budget is None:
        return timeout
    seconds, deadline = test_budget
    if timeout > seconds - MARGIN:
        raise ValueError(
            f"launch(timeout={timeout:.0f}) is more than this test's whole pytest timeout ({seconds:.0f} s) allows:"
            f" give the test @pytest.mark.timeout({int(timeout + MARGIN) + 1}) or more"
        )
    return max(1.0, min(timeout, deadline - time.monotonic() - MARGIN))


def _fresh_processes() -> bool:
    return os.environ.get("FABRIC_HSDP_TEST_FRESH_PROCESSES") == "1"


def _start_server() -> None:
    """Start the fork server once (imports torch, Lightning, transformers: a minute or more on a loaded machine).

    Its start is not charged to the launch that needs it first, only to the test: it may take what the test's pytest
    timeout leaves (300 s outside pytest).
    """
    global _server
    if _server is None and not _fresh_processes():
        deadline = test_budget[1] - MARGIN if test_budget is not None else time.monotonic() + 300
        _server = _ForkServer(deadline)
        atexit.register(_server.close)


def _start(command: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> Any:
    """Start one rank: forked from the fork server, or a fresh ``python`` if ``FABRIC_HSDP_TEST_FRESH_PROCESSES=1``."""
    stdout.touch()
    stderr.touch()
    if _fresh_processes():
        with open(stdout, "w") as out, open(stderr, "w") as err:
            return subprocess.Popen([sys.executable, *command], env=env, stdout=out, stderr=err, start_new_session=True)
    return _server.start(command, env, stdout, stderr)


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


def launch(
    scenario: Callable[..., Any] | str,
    args: dict[str, Any] | None = None,
    *,
    num_nodes: int = 2,
    ranks_per_node: int = 2,
    timeout: float = 180.0,
    fail_grace: float = 30.0,
    env: dict[str, str] | None = None,
    out_dir: str | Path | None = None,
    interpreter_exit: bool = False,
) -> LaunchResult:
    """Run ``scenario`` (a module-level function of the tests, or its ``"tests.test_file:function"``) on
    ``num_nodes x ranks_per_node`` CPU processes; each rank imports it by its module and name.

    The environment is what Lightning's launchers set: ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` (so Fabric picks ``LightningEnvironment`` and the processes are created externally).
    The scenario receives the JSON ``args`` plus ``num_nodes`` and ``devices``.

    ``MASTER_PORT`` is one the OS reported free, which another process may take before rank 0 binds it (other jobs
    on the machine launch too): when rank 0 then fails with ``EADDRINUSE`` on it, before any rank has run the
    scenario, the ranks are ended and started again on another port, up to ``PORT_ATTEMPTS`` times in all.

    ``interpreter_exit=True``: a rank whose scenario returned ends through the interpreter's whole teardown, as a
    script does, for the tests of how a rank exits; by default it skips the teardown of the modules (``worker.py``
    says what it still runs).
    """
    scenario = _named(scenario)
    _start_server()
    timeout = _budget(timeout)
    workdir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hsdp-launch-"))
    workdir.mkdir(parents=True, exist_ok=True)
    call_args = dict(args or {}, num_nodes=num_nodes, devices=ranks_per_node)
    if interpreter_exit:
        env = dict(env or {}, FABRIC_HSDP_TEST_INTERPRETER_EXIT="1")
    deadline = time.monotonic() + timeout
    for _ in range(PORT_ATTEMPTS):
        port = free_port()
        result = _run_ranks(scenario, call_args, num_nodes, ranks_per_node, port, deadline, fail_grace, env, workdir)
        if not _lost_the_port(result, port):
            break
    if out_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)  # everything it held is in `result` now
    return result


def _named(scenario: Callable[..., Any] | str) -> str:
    """``"module:function"``, as each rank imports it."""
    return scenario if isinstance(scenario, str) else f"{scenario.__module__}:{scenario.__qualname__}"


def launch_cases(
    scenario: Callable[..., Any] | str, cases: dict[str, dict[str, Any]], **options: Any
) -> dict[str, list[Any]]:
    """``scenario`` run once per case (label -> its JSON args), one case after the other in one launch: the ranks'
    set-up (forks, process group, first-call warm-ups) paid once for a parametrized test's cases. Checked (every rank
    exited 0); returns each case's values, one per rank. ``options``: :func:`launch`'s (``timeout`` covers all)."""
    values = launch(run_cases, {"scenario": _named(scenario), "cases": cases}, **options).check().values
    return {label: [rank[label] for rank in values] for label in cases}


def run_cases(num_nodes: int, devices: int, scenario: str, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The body :func:`launch_cases` launches: each case's value, by label."""
    module_name, function_name = scenario.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    return {label: function(num_nodes=num_nodes, devices=devices, **args) for label, args in cases.items()}


PORT_ATTEMPTS = 3


def _lost_the_port(result: LaunchResult, port: int) -> bool:
    """Whether rank 0 could not bind ``port`` for the job's store (another process took it after free_port())."""
    rank0 = result.ranks[0]
    return rank0.returncode not in (0, None) and f"port: {port}," in rank0.stderr and "EADDRINUSE" in rank0.stderr


def _run_ranks(
    scenario: str,
    call_args: dict[str, Any],
    num_nodes: int,
    ranks_per_node: int,
    port: int,
    deadline: float,
    fail_grace: float,
    env: dict[str, str] | None,
    workdir: Path,
) -> LaunchResult:
    """Start every rank with ``MASTER_PORT=port`` and wait for them (see :func:`launch`)."""
    world_size = num_nodes * ranks_per_node
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
            stdout, stderr = workdir / f"rank{global_rank}.out", workdir / f"rank{global_rank}.err"
            command = [str(WORKER), scenario, json.dumps(call_args), str(out_file)]
            process = _start(command, rank_env, stdout, stderr)
            processes.append((global_rank, process, stdout, stderr, out_file))

    timed_out = False
    first_failure: float | None = None
    while True:
        codes = [p.poll() for _, p, *_ in processes]
        if all(code is not None for code in codes):
            break
        now = time.monotonic()
        if first_failure is None and any(code not in (None, 0) for code in codes):
            first_failure = now
            if codes[0] not in (None, 0) and "EADDRINUSE" in _read(processes[0][3]):
                fail_grace = 0.0  # rank 0 lost the port: the others wait for a store that is not there
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
        value = torch.load(out_file, weights_only=False) if out_file.exists() else None
        result.ranks.append(RankResult(global_rank, process.returncode, _read(stdout), _read(stderr), value))
    return result
