"""The main job, end to end on one CPU machine: fine-tune a Llama checkpoint on 2 simulated nodes x 2 ranks, export it
in its own format, reload the export with the library that owns the format, and check it is the fine-tuned model.

1. make: ``examples/make_tiny_llama.py`` builds a tiny random Llama locally (nothing is downloaded) in both formats:
   a transformers directory (``save_pretrained``, with a BPE tokenizer trained on ``examples/data/tiny.txt``) and a
   litgpt checkpoint directory made from it by litgpt's own converter.
2. then for litgpt, then for transformers:

   a. fine-tune: two ``fabric run`` launches (``--node-rank 0`` and ``1``, ``--main-address 127.0.0.1``, a free port),
      as on two machines, of ``examples/finetune.py --checkpoint_dir <that directory>``: built on the meta device,
      sharded, filled with ``fabric.load_raw``, trained, sharded checkpoints, exported in the source's format;
   b. check: ``examples/check_export.py`` reloads the export in a plain process with litgpt (``GPT`` +
      ``load_state_dict``) or transformers (``from_pretrained``), compares its logits and its validation loss with
      the fine-tuned model's, and generates a few tokens.

Every step has a timeout and the job exits non-zero at the first failure. About two minutes on 2 cores.

    python examples/main_job.py [--work_dir out/main_job] [--max_steps 30]
"""

from __future__ import annotations

import json
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
EXAMPLES = REPO_ROOT / "examples"


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


def two_node_run(script: Path, args: list[str], timeout: float) -> str:
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
            str(script),
            *args,
        ]
        for rank in (0, 1)
    }
    return run_together(commands, timeout)["node0"]


def find_float(pattern: str, text: str, what: str) -> float:
    matches = re.findall(pattern, text)
    if not matches:
        raise StepFailed(f"could not find {what} in the output (pattern {pattern!r})")
    return float(matches[-1])


class Steps:
    """Numbered steps: prints each one's start, and its result and duration when it passes."""

    def __init__(self, total: int) -> None:
        self.total, self.number, self.started = total, 0, 0.0

    def start(self, what: str) -> None:
        self.number += 1
        self.started = time.monotonic()
        print(f"[{self.number}/{self.total}] {what}", flush=True)

    def ok(self, result: str) -> None:
        print(f"[{self.number}/{self.total}] ok in {time.monotonic() - self.started:.0f} s: {result}", flush=True)


def main(
    work_dir: Path = Path("out/main_job"),
    max_steps: int = 30,
    timeout: float = 300.0,
    max_logit_diff: float = 1e-4,
    max_loss_diff: float = 1e-5,
) -> None:
    """Run the main job.

    Args:
        work_dir: Where the models, checkpoints and exports go (emptied first).
        max_steps: Fine-tuning steps per format (a sharded checkpoint every max_steps / 2).
        timeout: Seconds each step may take before it is killed.
        max_logit_diff: Largest |difference| accepted between the reloaded export's logits and the fine-tuned
            model's. Both compute in float32 from the same weights; only the kernels' summation order can differ,
            which moves a logit by ~1e-6 at most here (measured: exactly 0 on CPU).
        max_loss_diff: Largest |difference| accepted between the validation losses: the same windows in other batch
            shapes and summation order (measured: < 1e-6), 1000x below what one fine-tuning step changes.
    """
    work_dir = (work_dir if work_dir.is_absolute() else REPO_ROOT / work_dir).resolve()
    if work_dir.exists():
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True)
    models = work_dir / "models"
    directories = {"litgpt": models / "tiny-llama-litgpt", "transformers": models / "tiny-llama-hf"}
    started = time.monotonic()
    steps = Steps(1 + 2 * len(directories))

    steps.start(f"make a tiny random Llama in both formats (examples/make_tiny_llama.py) -> {models}")
    made = run_together(
        {"make": [sys.executable, str(EXAMPLES / "make_tiny_llama.py"), "--out_dir", str(models)]}, timeout
    )
    steps.ok(made["make"].strip().splitlines()[-1])

    results = {}
    for fmt, checkpoint_dir in directories.items():
        out_dir = work_dir / fmt
        steps.start(
            f"fine-tune the {fmt} checkpoint {checkpoint_dir.name}: 2 nodes x 2 ranks (two `fabric run` launches),"
            f" {max_steps} steps, sharded checkpoints, export -> {out_dir}"
        )
        output = two_node_run(
            EXAMPLES / "finetune.py",
            [
                "--checkpoint_dir",
                str(checkpoint_dir),
                "--out_dir",
                str(out_dir),
                "--max_steps",
                str(max_steps),
                "--save_every",
                str(max(1, max_steps // 2)),
                "--log_every",
                str(max(1, max_steps // 10)),
            ],
            timeout,
        )
        before = find_float(r"step 0: val loss ([0-9.]+)", output, "the validation loss before fine-tuning")
        after = find_float(r"done: fine-tuned val loss ([0-9.]+)", output, "the final validation loss")
        checkpoints = sorted(path.name for path in (out_dir / "checkpoints").glob("step-*"))
        exported = sorted(path.name for path in (out_dir / "export").iterdir())
        if not after < before:
            raise StepFailed(f"fine-tuning did not lower the validation loss: {before:.4f} -> {after:.4f}")
        steps.ok(f"val loss {before:.4f} -> {after:.4f}; checkpoints {checkpoints}; export/ holds {exported}")

        owner = "litgpt (GPT + load_state_dict)" if fmt == "litgpt" else "transformers (from_pretrained)"
        steps.start(f"reload the {fmt} export with {owner}; compare logits and val loss; generate")
        run_together(
            {
                "check": [
                    sys.executable,
                    str(EXAMPLES / "check_export.py"),
                    "--out_dir",
                    str(out_dir),
                    "--max_logit_diff",
                    str(max_logit_diff),
                    "--max_loss_diff",
                    str(max_loss_diff),
                ]
            },
            timeout,
        )
        results[fmt] = json.loads((out_dir / "export_check.json").read_text())
        check = results[fmt]
        steps.ok(
            f"logits max |diff| {check['max_logit_diff']:.1e}, val loss {check['val_loss']:.6f} vs fine-tuned"
            f" {check['fine_tuned_val_loss']:.6f}; generated {check['generated']!r}"
        )
    print(f"main job: all {steps.total} steps passed in {time.monotonic() - started:.0f} s; outputs in {work_dir}")


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
