"""The prepared run for a lent GPU machine: the most evidence in about 9 minutes, written as it goes.

Run first thing when a GPU is lent: ``python benchmarks/gpu_session.py --out "$OUT"``. Every part writes its own files
under ``--out`` while it runs, so a timeout still returns what finished:

0. ``env.txt``: nvidia-smi, versions, the device's capability (seconds);
1. ``core-tests.log`` (in the background, on CPU cores 8-15, all along): the core tests under the machine's torch,
   with CUDA hidden -- the torch range CI runs, on the release the machine has;
2. ``gpu_check.txt``: ``benchmarks/gpu_check.py`` (the world-1 checks in one process, ~150 s);
3. ``throughput.jsonl`` / ``throughput.txt``: ``benchmarks/gpu_throughput.py`` (~230 s: the strategy against a
   hand-written torchtitan-style loop on a 1.3B model, float8, async save timings);
4. ``probe.json``: two ranks on one GPU over gloo with CUDA tensors: which collectives FSDP2 needs work, and if they
   do, one FSDP2 step of 2 ranks on cuda:0 against one process (~30 s);
5. ``summary.txt``: every part's lines and how long it took.

``--rehearse`` runs all of it on CPU with tiny sizes (the suite does, so the prepared run is known to work).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO_ROOT / "benchmarks"
BUDGETS = {"gpu_check": 150, "throughput": 230, "probe": 60}  # seconds; with start-up and the tests: ~9 minutes
REHEARSAL_TESTS = ["tests/test_versions.py"]  # the rehearsal's "core tests": the script, not the range


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _run(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``command`` with its output going to ``log`` as it comes; returns how it ended."""
    start = time.monotonic()
    with log.open("w") as output:
        try:
            done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=timeout, env=env or _env())
            ended = f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"timed out after {timeout:.0f} s"
    return f"{ended} in {time.monotonic() - start:.0f} s"


def environment(out: Path) -> str:
    lines = [f"python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs"]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        lines.append(smi.stdout)
    probe = (
        "import importlib.metadata as m, torch\n"
        "for name in ('torch', 'lightning', 'torchao', 'transformers', 'litgpt', 'peft', 'pytest'):\n"
        "    try: print(name, m.version(name))\n"
        "    except m.PackageNotFoundError: print(name, 'missing')\n"
        "print('cuda', torch.version.cuda, 'available', torch.cuda.is_available())\n"
        "if torch.cuda.is_available(): print('capability', torch.cuda.get_device_capability())\n"
    )
    versions = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    lines.append(versions.stdout + versions.stderr)
    (out / "env.txt").write_text("\n".join(lines))
    return " ".join(versions.stdout.split())


def core_tests(out: Path, rehearse: bool) -> subprocess.Popen | None:
    """The core tests (the Makefile's CORE_TESTS) on CPU cores 8-15, CUDA hidden; None without pytest."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        (out / "core-tests.log").write_text("SKIP: pytest is not installed (pip install pytest pytest-timeout)\n")
        return None
    tests = REHEARSAL_TESTS if rehearse else _core_test_files()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    cores = os.cpu_count() or 1
    if not rehearse and cores >= 16 and shutil.which("taskset"):
        command = ["taskset", "-c", f"8-{cores - 1}", *command]  # the GPU runs keep cores 0-7
    env = dict(_env(), CUDA_VISIBLE_DEVICES="")
    log = (out / "core-tests.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)


def _core_test_files() -> list[str]:
    makefile = (REPO_ROOT / "Makefile").read_text()
    match = re.search(r"^CORE_TESTS \?=((?:.*\\\n)*.*)$", makefile, flags=re.MULTILINE)
    return match.group(1).replace("\\\n", " ").split() if match else ["tests"]


def probe(out: Path, rehearse: bool) -> str:
    """Two ranks on one device over gloo (``--probe-rank`` below, under torchrun): what works goes to probe.json."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
        "--probe-rank", "--out", str(out), *(["--rehearse"] if rehearse else []),
    ]  # fmt: skip
    return _run(command, out / "probe.log", BUDGETS["probe"])


def probe_rank(out: Path, rehearse: bool) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu" if rehearse else "cuda", 0)  # both ranks on one device: gloo, not NCCL
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, str] = {}

    def attempt(name: str, run, expected) -> None:  # noqa: ANN001
        try:
            got = run()
            results[name] = "ok" if torch.equal(got.cpu(), expected) else f"wrong: {got.cpu().tolist()}"
        except Exception as error:  # the probe's answer: this collective does not run here
            results[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"

    mine = torch.full((2,), float(rank + 1), device=device)

    def all_reduce() -> torch.Tensor:
        value = mine.clone()
        dist.all_reduce(value)
        return value

    def all_gather_into_tensor() -> torch.Tensor:
        gathered = torch.empty(2 * world, device=device)
        dist.all_gather_into_tensor(gathered, mine)
        return gathered

    def reduce_scatter_tensor() -> torch.Tensor:
        scattered = torch.empty(1, device=device)
        dist.reduce_scatter_tensor(scattered, torch.arange(2.0, device=device) + rank)
        return scattered

    attempt("all_reduce", all_reduce, torch.full((2,), 3.0))
    attempt("all_gather_into_tensor", all_gather_into_tensor, torch.tensor([1.0, 1.0, 2.0, 2.0]))
    attempt("reduce_scatter_tensor", reduce_scatter_tensor, torch.tensor([1.0 + 2 * rank]))
    if all(results[name] == "ok" for name in ("all_gather_into_tensor", "reduce_scatter_tensor")):
        try:
            results["fsdp2_step"] = _fsdp2_step(device)
        except Exception as error:
            results["fsdp2_step"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    else:
        results["fsdp2_step"] = "not tried: gloo lacks a collective FSDP2 needs on this device"
    if rank == 0:
        (out / "probe.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def _fsdp2_step(device) -> str:  # noqa: ANN001
    """One SGD step of a 2-layer MLP sharded over the 2 ranks on ``device``, against the same step in one process."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(device)
    sharded = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(device)
    sharded.load_state_dict(reference.state_dict())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(device)  # the same on both ranks
    for model in (reference, sharded):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(inputs).square().mean().backward()
        optimizer.step()
    full = {name: tensor.full_tensor() for name, tensor in sharded.state_dict().items()}
    difference = max((full[name] - tensor).abs().max().item() for name, tensor in reference.state_dict().items())
    if difference > 1e-5:
        raise AssertionError(f"2 ranks on {device} differ from one process by {difference:.2e} after a step")
    return f"ok: 2 ranks on {device}, max |diff| vs one process {difference:.1e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true", help="on CPU, tiny sizes: a test of this script")
    parser.add_argument("--probe-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe_rank:
        probe_rank(args.out, args.rehearse)
        return 0

    started = time.monotonic()
    summary = args.out / "summary.txt"

    def note(line: str) -> None:
        with summary.open("a") as file:
            file.write(f"[{time.monotonic() - started:5.0f} s] {line}\n")
        print(line, flush=True)

    note(f"environment: {environment(args.out)}")
    background = core_tests(args.out, args.rehearse)
    device = ["--device", "cpu"] if args.rehearse else []
    check_env = dict(_env(), GPU_CHECK_VERBOSE="1", **({"GPU_CHECK_CPU_RANKS": "1"} if args.rehearse else {}))
    check = [sys.executable, str(BENCHMARKS / "gpu_check.py"), *device, "--budget", str(BUDGETS["gpu_check"])]
    note(f"gpu_check: {_run(check, args.out / 'gpu_check.txt', BUDGETS['gpu_check'] + 30, check_env)}")
    tiny = ["--tiny", "--backend", "aot_eager", "--micro_batch", "2", "--warmup", "1", "--steps", "2"]
    throughput = [
        sys.executable, str(BENCHMARKS / "gpu_throughput.py"), "--out", str(args.out / "throughput.jsonl"),
        "--budget", str(BUDGETS["throughput"]), *device, *(tiny if args.rehearse else []),
    ]  # fmt: skip
    note(f"throughput: {_run(throughput, args.out / 'throughput.txt', BUDGETS['throughput'] + 30)}")
    note(f"probe: {probe(args.out, args.rehearse)}")
    if background is not None:
        left = max(10.0, 540 - (time.monotonic() - started))
        try:
            background.wait(timeout=left)
            note(f"core tests: exit {background.returncode}")
        except subprocess.TimeoutExpired:
            background.kill()
            note(f"core tests: stopped at the session's 9 minutes ({left:.0f} s after the GPU parts)")
    for name in ("gpu_check.txt", "throughput.txt", "probe.json"):
        path = args.out / name
        if path.exists():
            note(f"--- {name}\n{path.read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
