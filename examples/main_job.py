"""The main job, end to end on one CPU machine: 2 simulated nodes x 2 ranks, sharded save, convert, inspect, load.

1. train: two ``fabric run`` launches (``--node-rank 0`` and ``1``, ``--main-address 127.0.0.1``, a free port), as
   on two machines; ``examples/train.py`` saves sharded DCP checkpoints ``step-<N>`` (every rank writes its shards).
2. convert: ``fabric-hsdp convert <last step-N> model.pth``: one consolidated file, streamed tensor by tensor.
3. inspect: ``fabric-hsdp inspect model.pth``: format, tensors, sizes, without reading the data.
4. load: a short second 2 x 2 run with ``--init_from model.pth``: each rank reads only its own shard of the file.
   Its step-0 validation loss must equal the first run's final one: the weights came back exactly.

Every step has a timeout and the job exits non-zero at the first failure. Takes about a minute or two on 2 cores.

    python examples/main_job.py [--work_dir out/main_job] [--max_steps 40]
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN = REPO_ROOT / "examples" / "train.py"


class StepFailed(RuntimeError):
    pass


def tool(name: str, module: str) -> list[str]:
    """The console script next to this Python (the venv's), else ``python -m module``."""
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [str(script)]
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_together(commands: dict[str, list[str]], timeout: float, grace: float = 20.0) -> dict[str, str]:
    """Run the commands at once, echoing their output line by line with a prefix; return each one's output.

    Raises StepFailed when one exits non-zero (the others get ``grace`` seconds, then are killed: a node whose peer
    died would otherwise wait for it until its rendezvous timeout) or when ``timeout`` passes.
    """
    processes: dict[str, subprocess.Popen] = {}
    outputs: dict[str, list[str]] = {name: [] for name in commands}
    threads = []

    def pump(name: str, stream) -> None:
        for line in stream:
            outputs[name].append(line)
            print(f"  [{name}] {line}", end="", flush=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    for name, command in commands.items():
        print(f"  $ {' '.join(command)}", flush=True)
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # one process group per command, killed as a whole below
        )
        processes[name] = process
        thread = threading.Thread(target=pump, args=(name, process.stdout), daemon=True)
        thread.start()
        threads.append(thread)

    deadline, failed_at = time.monotonic() + timeout, None
    reason = None
    while any(process.poll() is None for process in processes.values()):
        now = time.monotonic()
        failed = [name for name, process in processes.items() if process.poll() not in (None, 0)]
        if failed and failed_at is None:
            failed_at = now
        if now > deadline:
            reason = f"timed out after {timeout:.0f} s"
            break
        if failed_at is not None and now - failed_at > grace:
            break
        time.sleep(0.2)
    for process in processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for thread in threads:
        thread.join(timeout=5)
    codes = {name: process.returncode for name, process in processes.items()}
    if reason or any(code != 0 for code in codes.values()):
        raise StepFailed(reason or f"exit codes {codes}")
    return {name: "".join(lines) for name, lines in outputs.items()}


def two_node_train(train_args: list[str], timeout: float) -> str:
    """Two ``fabric run`` launches on 127.0.0.1, as node 0 and node 1 of one job; returns node 0's output."""
    port = free_port()
    fabric = tool("fabric", "lightning.fabric.cli")
    commands = {
        f"node{rank}": [
            *fabric,
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--num-nodes",
            "2",
            "--node-rank",
            str(rank),
            "--main-address",
            "127.0.0.1",
            "--main-port",
            str(port),
            str(TRAIN),
            *train_args,
        ]
        for rank in (0, 1)
    }
    return run_together(commands, timeout)["node0"]


def find_float(pattern: str, text: str, what: str) -> float:
    matches = re.findall(pattern, text)
    if not matches:
        raise StepFailed(f"could not find {what} in the output (pattern {pattern!r})")
    return float(matches[-1])


def main(work_dir: Path = Path("out/main_job"), max_steps: int = 40, timeout: float = 300.0) -> None:
    """Run the main job.

    Args:
        work_dir: Where the checkpoints and the converted file go (emptied first).
        max_steps: Training steps of the first run (checkpoints every max_steps / 2).
        timeout: Seconds each step may take before it is killed.
    """
    work_dir = (work_dir if work_dir.is_absolute() else REPO_ROOT / work_dir).resolve()
    if work_dir.exists():
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True)
    run1, run2, consolidated = work_dir / "run1", work_dir / "run2", work_dir / "model.pth"
    hsdp = tool("fabric-hsdp", "fabric_hsdp")
    started = time.monotonic()

    step = 1
    print(f"[{step}/4] train: 2 nodes x 2 ranks (two `fabric run` launches), {max_steps} steps -> {run1}", flush=True)
    t0 = time.monotonic()
    out1 = two_node_train(
        ["--out_dir", str(run1), "--max_steps", str(max_steps), "--save_every", str(max(1, max_steps // 2))], timeout
    )
    checkpoints = sorted(path for path in run1.glob("step-*") if path.is_dir())
    if not checkpoints:
        raise StepFailed(f"training finished but wrote no step-* checkpoint in {run1}")
    final_val = find_float(r"done: val loss ([0-9.]+)", out1, "the final validation loss")
    last = checkpoints[-1]
    files = sorted(entry.name for entry in last.iterdir())
    print(
        f"[{step}/4] ok in {time.monotonic() - t0:.0f} s: checkpoints {[path.name for path in checkpoints]};"
        f" {last.name} holds {files}; final val loss {final_val:.4f}",
        flush=True,
    )

    step = 2
    print(f"[{step}/4] convert: sharded {last.name} -> one file {consolidated.name}", flush=True)
    t0 = time.monotonic()
    run_together({"convert": [*hsdp, "convert", str(last), str(consolidated)]}, timeout)
    print(f"[{step}/4] ok in {time.monotonic() - t0:.0f} s: {consolidated} ({consolidated.stat().st_size:,} bytes)")

    step = 3
    print(f"[{step}/4] inspect {consolidated.name}", flush=True)
    run_together({"inspect": [*hsdp, "inspect", str(consolidated)]}, timeout)
    print(f"[{step}/4] ok", flush=True)

    step = 4
    print(f"[{step}/4] load: a fresh 2 x 2 run, --init_from {consolidated.name}, 5 steps -> {run2}", flush=True)
    t0 = time.monotonic()
    out2 = two_node_train(
        ["--out_dir", str(run2), "--init_from", str(consolidated), "--max_steps", "5", "--save_every", "0"], timeout
    )
    start_val = find_float(r"step 0: val loss ([0-9.]+)", out2, "the step-0 validation loss")
    if "initialised from" not in out2:
        raise StepFailed("the second run did not report loading --init_from")
    if abs(start_val - final_val) > 1e-4:
        raise StepFailed(
            f"the second run starts at val loss {start_val:.4f}, but the first ended at {final_val:.4f}: the weights"
            " did not come back"
        )
    print(
        f"[{step}/4] ok in {time.monotonic() - t0:.0f} s: loaded weights give val loss {start_val:.4f} ="
        f" the first run's final {final_val:.4f}",
        flush=True,
    )
    print(f"main job: all 4 steps passed in {time.monotonic() - started:.0f} s; outputs in {work_dir}")


def cli() -> int:
    from jsonargparse import CLI

    try:
        CLI(main, as_positional=False)
    except StepFailed as error:
        print(f"main job: FAILED: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
