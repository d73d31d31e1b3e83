"""A real two-node SLURM cluster on this machine: munge, ``slurmctld`` and two ``slurmd`` (``n1``, ``n2``).

Everything lives in one temporary directory: ``slurm.conf``, the munge key and socket, state and spool directories,
and every daemon's log (``*.log``, ``*.out``). The daemons and every client command run in a private network namespace
whose only interface is loopback: they listen on nothing outside it, and two clusters on one machine (two test runs)
cannot collide on a port, so Slurm's default ports are used inside it. Each ``slurmd`` also runs in its own UTS
namespace with host name ``n1`` / ``n2``: its tasks see that host name, so tools that group ranks by host name
(Lightning's ``MPIEnvironment``, Open MPI's local ranks) see two nodes. ``n1`` and ``n2`` resolve to 127.0.0.1
through ``/etc/hosts`` (a line is added when missing).

Client commands (``sbatch``, ``srun``, ``salloc``, ``scontrol``, ...) must run in the namespace too: build them with
``cluster.command(...)`` or run them with ``cluster.run(...)``, with ``cluster.env()`` as their environment.

Needs root (namespaces, ``slurmd``), Debian's ``slurmctld slurmd slurm-client munge openmpi-bin`` (``.ci/install-
launchers`` installs them), ``ip`` (iproute2), ``unshare``/``nsenter`` (util-linux) and ``mpi4py``: in this Python,
or (what CI does) in ``<venv>/mpi4py``, which ``env()`` puts on the jobs' ``PYTHONPATH``. Kept out of the venv itself
because with mpi4py importable, Lightning's cluster-environment detection initialises MPI (about 0.5 s) in every
process of every other test.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # slots per node for the scheduler; slurmd is told to trust the config (config_overrides)
HOSTS_LINE = "127.0.0.1 n1 n2  # fabric-hsdp test cluster (tests/helpers/slurm_cluster.py)"
PROGRAMS = {
    "munged": "munge",
    "munge": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "srun": "slurm-client",
    "salloc": "slurm-client",
    "scontrol": "slurm-client",
    "sinfo": "slurm-client",
    "squeue": "slurm-client",
    "scancel": "slurm-client",
    "mpirun": "openmpi-bin",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "ip": "iproute2",
}
MPI4PY_DIR = Path(sys.executable).parent.parent / "mpi4py"  # pip install --target <venv>/mpi4py mpi4py
INSTALL_HINT = (
    "run `bash .ci/install-launchers` as root (apt-get install slurmctld slurmd slurm-client munge openmpi-bin"
)


def missing_requirements() -> list[str]:
    """What this machine lacks to run the cluster, each with how to get it; empty when all is there."""
    problems = []
    if os.geteuid() != 0:
        problems.append("the cluster needs root (network and UTS namespaces, slurmd running tasks)")
    missing = sorted({package for program, package in PROGRAMS.items() if shutil.which(program) is None})
    if missing:
        problems.append(f"missing packages {missing}: {INSTALL_HINT} iproute2 util-linux, pip install mpi4py)")
    if importlib.util.find_spec("mpi4py") is None and not (MPI4PY_DIR / "mpi4py").is_dir():
        problems.append(
            f"mpi4py not found: pip install --target {MPI4PY_DIR} mpi4py (a wheel; it loads the system MPI)"
        )
    return problems


def ensure_node_names_resolve() -> None:
    """Make ``n1``/``n2`` resolve to 127.0.0.1, adding a line to ``/etc/hosts`` if needed (idempotent)."""
    if all(_resolves_to_loopback(node) for node in NODES):
        return
    hosts = Path("/etc/hosts")
    try:
        with hosts.open("a") as file:
            file.write(f"\n{HOSTS_LINE}\n")
    except OSError as error:
        raise RuntimeError(f"n1/n2 do not resolve and {hosts} is not writable ({error}); add: {HOSTS_LINE}") from error
    if not all(_resolves_to_loopback(node) for node in NODES):
        raise RuntimeError(f"added '{HOSTS_LINE}' to {hosts}, but n1/n2 still do not resolve to 127.0.0.1")


def _resolves_to_loopback(name: str) -> bool:
    try:
        return socket.gethostbyname(name) == "127.0.0.1"
    except OSError:
        return False


class SlurmCluster:
    """Start with ``start()``, stop with ``stop()`` (both idempotent); see the module docstring."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory or tempfile.mkdtemp(prefix="hsdp-slurm-"))
        self.conf = self.directory / "slurm.conf"
        self._namespace_holder: subprocess.Popen | None = None
        self._daemons: dict[str, subprocess.Popen] = {}
        self._log_files: list = []

    # -- clients ------------------------------------------------------------------------------------------------------

    def command(self, *args: str) -> list[str]:
        """``args`` run inside the cluster's network namespace."""
        if self._namespace_holder is None:
            raise RuntimeError("the cluster is not running: call start() first")
        return ["nsenter", f"--net=/proc/{self._namespace_holder.pid}/ns/net", *args]

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment plus what clients and Open MPI need on this cluster, plus ``extra``."""
        env = dict(os.environ, SLURM_CONF=str(self.conf), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        # Open MPI refuses root unless told, and by default skips loopback, the namespace's only interface.
        env.update(
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_btl_tcp_if_include="lo",
            OMPI_MCA_oob_tcp_if_include="lo",
        )
        if (MPI4PY_DIR / "mpi4py").is_dir():
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(MPI4PY_DIR), env.get("PYTHONPATH")]))
        env.update(extra)
        return env

    def run(
        self, *args: str, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        """Run a client command in the namespace; the output is returned, stdout and stderr together."""
        try:
            return subprocess.run(
                self.command(*args),
                env=env or self.env(),
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as error:
            output = error.output.decode() if isinstance(error.output, bytes) else (error.output or "")
            self.cancel_all()
            raise AssertionError(
                f"{' '.join(args)} did not finish in {timeout:.0f} s; jobs cancelled.\n{output[-4000:]}\n{self.logs()}"
            ) from error

    def job(self, job_id: str | int, timeout: float = 30) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode``, ...) once the job has ended.

        Waits ``timeout`` seconds at most for a final state (a job is ``COMPLETING`` a moment after its last process
        exited). Ended jobs stay listed for 5 minutes (``MinJobAge``).
        """
        deadline = time.monotonic() + timeout
        while True:
            result = self.run("scontrol", "show", "job", "--oneliner", str(job_id), timeout=30)
            if result.returncode != 0:
                raise AssertionError(f"scontrol show job {job_id} failed: {result.stdout}\n{self.logs()}")
            info = dict(re.findall(r"(\w+)=(\S*)", result.stdout))
            if info.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") or (
                time.monotonic() > deadline
            ):
                return info
            time.sleep(0.2)

    def cancel_all(self) -> None:
        """Cancel every job and wait (10 s at most) until the queue is empty."""
        if self._namespace_holder is None or self._namespace_holder.poll() is not None:
            return
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            jobs = subprocess.run(
                self.command("squeue", "--noheader", "--format=%i"), env=self.env(), capture_output=True, text=True
            ).stdout.split()
            if jobs:
                subprocess.run(self.command("scancel", *jobs), env=self.env(), capture_output=True, timeout=30)
            deadline = time.monotonic() + 10
            while jobs and time.monotonic() < deadline:
                time.sleep(0.2)
                jobs = subprocess.run(
                    self.command("squeue", "--noheader", "--format=%i"), env=self.env(), capture_output=True, text=True
                ).stdout.split()

    def logs(self, lines: int = 40) -> str:
        """The last ``lines`` of every daemon log, for failure messages."""
        parts = [f"=== cluster directory {self.directory}"]
        for path in sorted(self.directory.glob("*.log")) + sorted(self.directory.glob("*.out")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- life cycle ---------------------------------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Bring the cluster up and wait until ``sinfo`` shows both nodes idle."""
        if self._namespace_holder is not None:
            return self
        problems = missing_requirements()
        if problems:
            raise RuntimeError("cannot start the SLURM test cluster: " + "; ".join(problems))
        ensure_node_names_resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o755)  # munged wants every directory above its socket searchable by all
        for sub in ("state", *(f"spool-{node}" for node in NODES)):
            (self.directory / sub).mkdir(exist_ok=True)
        key = self.directory / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(self._slurm_conf())
        try:
            self._start_namespace()
            self._spawn(
                "munged",
                ["munged", "--foreground", f"--socket={self.directory / 'munge.sock'}", f"--key-file={key}"]
                + [f"--pid-file={self.directory / 'munged.pid'}", f"--seed-file={self.directory / 'munged.seed'}"]
                + [f"--log-file={self.directory / 'munged.log'}"],
            )
            self._wait_for(lambda: (self.directory / "munge.sock").exists(), "the munge socket", 20)
            self._spawn("slurmctld", self.command("slurmctld", "-D", "-f", str(self.conf)))
            for node in NODES:
                # its own UTS namespace: the node's tasks see host name n1 / n2
                self._spawn(
                    f"slurmd-{node}",
                    self.command("unshare", "--uts", "sh", "-c", f'hostname {node} && exec slurmd -D -N {node} -f "$0"')
                    + [str(self.conf)],
                )
            self._wait_for(self._nodes_idle, "both nodes idle in sinfo", timeout)
        except BaseException:
            self.stop(keep_directory=True)
            raise
        atexit.register(self.stop, keep_directory=True)  # if the caller never gets to stop(): no daemons left behind
        return self

    def stop(self, keep_directory: bool = False) -> None:
        """Cancel jobs, stop every daemon and every process left in the namespace; remove the directory unless kept."""
        if self._namespace_holder is None:
            return
        self.cancel_all()
        for name in sorted(self._daemons, key=lambda n: n != "munged"):  # Slurm first, munge after
            if name != "munged":
                self._terminate(self._daemons[name])
        self._kill_namespace_leftovers()
        if "munged" in self._daemons:
            self._terminate(self._daemons["munged"])
        self._terminate(self._namespace_holder)
        self._daemons.clear()
        self._namespace_holder = None
        for file in self._log_files:
            file.close()
        self._log_files.clear()
        if not keep_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _slurm_conf(self) -> str:
        # fixed ports (6817, 6818+) are safe: the daemons listen in the cluster's own network namespace, so another
        # cluster or job on the machine cannot hold them
        path = self.directory
        nodes = "\n".join(
            f"NodeName={node} NodeAddr=127.0.0.1 Port={6818 + index} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for index, node in enumerate(NODES)
        )
        return f"""# fabric-hsdp test cluster: {len(NODES)} nodes on one machine, in a private network namespace
ClusterName=hsdp-test
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={path / "munge.sock"}
StateSaveLocation={path / "state"}
SlurmdSpoolDir={path}/spool-%n
SlurmctldPidFile={path / "slurmctld.pid"}
SlurmdPidFile={path}/slurmd-%n.pid
SlurmctldLogFile={path / "slurmctld.log"}
SlurmdLogFile={path}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdTimeout=30
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _start_namespace(self) -> None:
        # A second loopback address: with only 127.0.0.1, glibc's getaddrinfo(AI_ADDRCONFIG) finds no IPv4 address
        # configured and Slurm's name lookups fail.
        script = "ip link set lo up && ip addr add 127.0.0.2/8 dev lo && exec sleep 1000000"
        self._namespace_holder = self._popen("namespace", ["unshare", "--net", "sh", "-c", script])

        def ready() -> bool:
            probe = subprocess.run(self.command("ip", "-o", "addr", "show", "lo"), capture_output=True, text=True)
            return "127.0.0.2" in probe.stdout

        self._wait_for(ready, "the private network namespace", 20)

    def _spawn(self, name: str, command: list[str]) -> None:
        self._daemons[name] = self._popen(name, command)

    def _popen(self, name: str, command: list[str]) -> subprocess.Popen:
        output = open(self.directory / f"{name}.out", "w")  # noqa: SIM115 - closed in stop()
        self._log_files.append(output)
        return subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )

    def _nodes_idle(self) -> bool:
        for name, process in self._daemons.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} while starting\n{self.logs()}")
        result = subprocess.run(
            self.command("sinfo", "--noheader", "--Node", "--format=%N %T"),
            env=self.env(),
            capture_output=True,
            text=True,
        )
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    def _wait_for(self, condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    def _kill_namespace_leftovers(self) -> None:
        """SIGKILL every process still in the cluster's network namespace (tasks, slurmstepd): all started by us."""
        holder = self._namespace_holder
        if holder is None or holder.poll() is not None:
            return
        try:
            namespace = os.readlink(f"/proc/{holder.pid}/ns/net")
        except OSError:
            return
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == holder.pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == namespace:
                    os.kill(int(entry.name), signal.SIGKILL)

    @staticmethod
    def _terminate(process: subprocess.Popen) -> None:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
