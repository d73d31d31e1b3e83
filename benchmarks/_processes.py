"""Shared by ``gpu_session.py``, ``gpu_check.py`` and ``gpu_throughput.py``: run a command with its whole output
streamed to a log file, and end it at its timeout together with every process it started.

torchrun starts its workers in sessions of their own (``start_new_session=True``), so killing torchrun, or even its
process group, leaves them running and holding the GPU. :func:`end_tree` collects the command's descendants from
``/proc`` first, asks the command to stop (torchrun forwards SIGTERM to its workers), and after a grace period kills
whatever of them is still alive, each by its id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

GRACE = 10.0  # seconds between SIGTERM and SIGKILL


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we read
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended, its parent has not reaped it yet


def end_tree(process: subprocess.Popen, grace: float = GRACE) -> list[int]:
    """End ``process`` and every process it started; returns the ids that had to be killed after the grace."""
    tree = descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    stop = time.monotonic() + grace
    while time.monotonic() < stop and (process.poll() is None or any(map(_alive, tree))):
        time.sleep(0.1)
    killed = [pid for pid in [process.pid, *tree, *descendants(process.pid)] if _alive(pid)]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):  # ended since
            os.kill(pid, signal.SIGKILL)
    process.wait()
    return killed


def run_logged(
    command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[int | None, float]:
    """Run ``command`` with stdout and stderr streamed to ``log`` as they come (unbuffered Python); returns its exit
    status (None when it ran out of ``timeout`` and was ended with all its processes) and the seconds it took."""
    start = time.monotonic()
    env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            code: int | None = process.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            killed = end_tree(process)
            output.write(f"\n[ended at its timeout of {timeout:.0f} s; killed after the grace: {killed or 'none'}]\n")
            code = None
    return code, time.monotonic() - start


def last_error(text: str) -> str:
    """The line of a log that says what went wrong: the last one naming an error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and not line.startswith(("File ", "raise ", "torch.distributed")):
            return line[:300]
    return lines[-1][:300] if lines else "no output"
