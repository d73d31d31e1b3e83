"""The prepared run for a lent GPU machine: the most evidence in 6-7 minutes, written as it goes, with time left on
the loan to rerun the part that failed.

Run first thing when a GPU is lent: ``python benchmarks/gpu_session.py --out "$OUT"`` (no install: every part puts
the repository on ``PYTHONPATH``). One deadline (``--deadline``, 400 s) holds for the whole run; each part gets the
time the parts before it left, less what the parts after it need. Every part writes its own files under ``--out``
while it runs, so a timeout still returns what finished, and a part ended at its time leaves its log:

0. ``preflight.json``, ``env.txt`` (at most 30 s): nvidia-smi (with a timeout), versions, lightning and this package
   import, CUDA and the device, a C compiler for Triton, a tiny ``torch.compile`` on the device. Without lightning or
   CUDA the run stops here (nothing after could work); when compile cannot work, both throughput sides run without it
   and the summary says so;
1. ``gpu_check.txt``: ``benchmarks/gpu_check.py`` (the world-1 checks in one process, at most 90 s);
2. ``throughput.jsonl``, ``throughput.txt``, ``throughput-<variant>.log``: ``benchmarks/gpu_throughput.py`` (what
   is left but the experts' and the probe's time: this package on a 1.3B model against torchtitan's recipe, the
   async-save figures inside the selective run, full AC, float8), each variant's whole log in its own file;
3. ``experts.jsonl``, ``experts.txt``, ``experts-<variant>.log``: ``benchmarks/gpu_experts.py`` (at most 40 s): the
   local half of expert parallelism, all that one GPU can run of it (NCCL refuses two ranks on one device): one
   Qwen3-30B-A3B layer's experts forward and backward with transformers' grouped_mm, all 128 gathered as under FSDP
   only against the 16 an EP8 rank holds, on the rows each gets at 4096 tokens per rank: tokens/s and peak memory;
4. ``probe.json``, ``probe.log``: two ranks on one GPU over gloo with CUDA tensors: which collectives FSDP2 needs work,
   whether gloo averages when asked to (``ReduceOp.AVG``), and one FSDP2 step of 2 ranks on cuda:0 against one
   process (at most 45 s; the answers written after each attempt);
5. ``summary.txt``: every part's line, its time and budget, and what a one-GPU run leaves untested.

``--core_tests`` adds the core tests on CPU cores 8-15 in the background (``core-tests.log``; not in the first run:
CI runs them). ``--rehearse`` runs all of it on CPU with tiny sizes (the suite does, so the prepared run is known
to work).
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
sys.path.insert(0, str(BENCHMARKS))

from _processes import end_tree, run_logged  # noqa: E402

DEADLINE = 400.0  # seconds for the whole run: 6-7 minutes, leaving time on the loan to rerun the part that failed
PREFLIGHT = 30.0  # seconds for the preflight
NVIDIA_SMI = 10.0  # seconds nvidia-smi may take (a hung driver hangs it)
GPU_CHECK = 90.0  # seconds for gpu_check's checks
EXPERTS = 40.0  # seconds kept for the experts' local half after the throughput (two processes' start-up, mostly)
PROBE = 45.0  # seconds kept for the probe after the experts
WRAP_UP = 10.0  # seconds kept for the summary (and the throughput driver's last words)
REHEARSAL_TESTS = ["tests/test_versions.py"]  # the rehearsal's "core tests": the script, not the range
NOT_TESTED = """\
NOT TESTED by this run (one GPU, world 1 -- a pass here does not mean "the GPU paths work"):
- NCCL with 2 or more ranks (every NCCL group here has one rank; the probe's two ranks use gloo)
- HSDP with replicate >= 2 (the replicate all-reduce, replica consistency)
- tensor parallelism (TP, and its qkv staging W1)
- expert parallelism between ranks (the token all-to-alls; the experts line runs one rank's local half only)
- CPU offload with more than one rank (C5)
- per-GPU contexts of several local ranks on one node (M1)
- multi-node (rendezvous, NCCL between nodes)"""


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _run(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``command`` with its output streamed to ``log``; at ``timeout`` it ends with every process it started."""
    code, seconds = run_logged(command, log, timeout, env or _env(), cwd=REPO_ROOT)
    ended = f"exit {code}" if code is not None else f"ended at its {timeout:.0f} s (its log: {log.name})"
    return f"{ended} in {seconds:.0f} s"


def c_compiler(env: dict[str, str]) -> str | None:
    """The C compiler Triton builds its launchers with (its rule: ``$CC``, else gcc, else clang), if it exists."""
    chosen = env.get("CC") or shutil.which("gcc", path=env.get("PATH")) or shutil.which("clang", path=env.get("PATH"))
    return shutil.which(chosen, path=env.get("PATH")) if chosen else None


def preflight_child(rehearse: bool) -> None:
    """Inside the preflight's process: one JSON line per answer, printed as it comes (a hang keeps the earlier)."""

    def answer(check: str, ok: bool, detail: str) -> None:
        print(json.dumps({"check": check, "ok": ok, "detail": detail}), flush=True)

    import importlib.metadata as metadata

    found = []
    for name in ("torch", "lightning", "torchao", "transformers", "litgpt", "peft", "pytest"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} missing")
    answer("versions", True, ", ".join(found))
    try:
        import lightning  # noqa: F401

        import fabric_hsdp  # noqa: F401

        answer("lightning", True, "lightning and fabric_hsdp import")
    except Exception as error:
        answer("lightning", False, f"{type(error).__name__}: {error}")
    import torch

    if rehearse:
        answer("cuda", True, f"rehearsal on CPU (torch {torch.__version__})")
    elif not torch.cuda.is_available():
        answer("cuda", False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
    else:
        name, capability = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
        answer(
            "cuda", True, f"{torch.cuda.device_count()} x {name}, capability {capability}, CUDA {torch.version.cuda}"
        )
    compiler = c_compiler(dict(os.environ))
    answer("c_compiler", compiler is not None, compiler or f"none (CC={os.environ.get('CC')!r}, no gcc or clang)")
    if compiler is None:
        answer("compile", False, "not tried: Triton needs a C compiler (install gcc, or set CC)")
        return
    try:
        device = "cpu" if rehearse else "cuda"
        function = torch.compile(
            lambda x: torch.nn.functional.gelu(x) * 2, backend="aot_eager" if rehearse else "inductor"
        )
        start = time.monotonic()
        function(torch.ones(8, device=device))
        answer("compile", True, f"a tiny function compiled and ran on {device} in {time.monotonic() - start:.1f} s")
    except Exception as error:
        answer("compile", False, f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")


def preflight(out: Path, rehearse: bool, env: dict[str, str] | None = None) -> dict[str, str | None]:
    """At most ``PREFLIGHT`` seconds: can this run go anywhere? Returns ``abort`` (why nothing after can work, else
    None), ``compile_off`` (why compile cannot work, else None) and ``line`` (the summary's)."""
    env = env or _env()
    start = time.monotonic()
    smi = None
    if shutil.which("nvidia-smi", path=env.get("PATH")):
        smi = subprocess.Popen(["nvidia-smi"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    command = [sys.executable, __file__, "--preflight-child", "--out", str(out), *(["--rehearse"] if rehearse else [])]
    code, _ = run_logged(command, out / "preflight.log", PREFLIGHT - 2, env, cwd=REPO_ROOT)
    answers = {}
    for line in (out / "preflight.log").read_text().splitlines():
        if line.startswith('{"check"'):
            answer = json.loads(line)
            answers[answer["check"]] = answer
    smi_text = "nvidia-smi: not on PATH"
    if smi is not None:
        try:
            smi_text = smi.communicate(timeout=max(1.0, NVIDIA_SMI - (time.monotonic() - start)))[0]
        except subprocess.TimeoutExpired:
            end_tree(smi, grace=1)
            smi_text = f"nvidia-smi: timed out after {NVIDIA_SMI:.0f} s (a hung driver?)"
    versions = answers.get("versions", {}).get("detail", "unknown")
    (out / "env.txt").write_text(
        f"python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs\n{versions}\n{smi_text}\n"
    )
    timed_out = "" if code is not None else f" (the preflight ended at its {PREFLIGHT:.0f} s)"
    abort = None
    for needed in ("lightning", "cuda"):
        if needed not in answers:
            abort = f"{needed}: no answer{timed_out}"
        elif not answers[needed]["ok"]:
            abort = f"{needed}: {answers[needed]['detail']}"
        if abort:
            break
    compile_off = None
    if "compile" not in answers:
        compile_note = f"compile: unverified{timed_out}, kept on"
    elif answers["compile"]["ok"]:
        compile_note = "compile: ok"
    else:
        compile_off = answers["compile"]["detail"]
        compile_note = f"compile: OFF for both throughput sides ({compile_off})"
    decision = {"abort": abort, "compile_off": compile_off, "answers": answers, "nvidia_smi": smi_text.splitlines()[:1]}
    (out / "preflight.json").write_text(json.dumps(decision, indent=1))
    seconds = time.monotonic() - start
    smi_line = smi_text.splitlines()[0] if smi_text.startswith("nvidia-smi:") else "nvidia-smi ok"
    line = f"{'ABORT: ' + abort if abort else 'ok'}; {compile_note}; {smi_line}; {versions} [{seconds:.0f} s]"
    return {"abort": abort, "compile_off": compile_off, "line": line}


def core_tests(out: Path, rehearse: bool) -> subprocess.Popen | None:
    """The core tests (the Makefile's CORE_TESTS) on CPU cores 8-15, CUDA hidden; None without pytest."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        (out / "core-tests.log").write_text("SKIP: pytest is not installed (pip install pytest pytest-timeout)\n")
        return None
    tests = REHEARSAL_TESTS if rehearse else _core_test_files()
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *tests]
    cores = os.cpu_count() or 1
    if not rehearse and cores >= 16 and shutil.which("taskset"):
        command = ["taskset", "-c", f"8-{cores - 1}", *command]  # the GPU runs keep cores 0-7
    env = dict(_env(), CUDA_VISIBLE_DEVICES="")
    command = ["nice", "-n", "19", *command] if shutil.which("nice") else command
    log = (out / "core-tests.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)


def _core_test_files() -> list[str]:
    makefile = (REPO_ROOT / "Makefile").read_text()
    match = re.search(r"^CORE_TESTS \?=((?:.*\\\n)*.*)$", makefile, flags=re.MULTILINE)
    return match.group(1).replace("\\\n", " ").split() if match else ["tests"]


def probe(out: Path, rehearse: bool, timeout: float) -> str:
    """Two ranks on one device over gloo (``--probe-rank`` below, under torchrun): what works goes to probe.json."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
        "--probe-rank", "--out", str(out), *(["--rehearse"] if rehearse else []),
    ]  # fmt: skip
    return _run(command, out / "probe.log", timeout)


def probe_rank(out: Path, rehearse: bool) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu" if rehearse else "cuda", 0)  # both ranks on one device: gloo, not NCCL
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, str] = {}

    def record(name: str, answer: str) -> None:
        results[name] = answer
        if rank == 0:  # after each attempt: a hang or a crash keeps the answers so far
            (out / "probe.json").write_text(json.dumps(results, indent=1))

    def attempt(name: str, run, expected, summed=None) -> None:  # noqa: ANN001
        try:
            got = run().cpu()
            if torch.equal(got, expected):
                record(name, "ok" if summed is None else "averages (ok)")
            elif summed is not None and torch.equal(got, summed):
                record(name, "sums when asked to average: FSDP2 must be forced to sum (the strategy does on gloo)")
            else:
                record(name, f"wrong: {got.tolist()} (expected {expected.tolist()})")
        except Exception as error:  # the probe's answer: this collective does not run here
            record(name, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")

    mine = torch.full((2,), float(rank + 1), device=device)

    def all_reduce(op=dist.ReduceOp.SUM) -> torch.Tensor:  # noqa: ANN001
        value = mine.clone()
        dist.all_reduce(value, op=op)
        return value

    def all_gather_into_tensor() -> torch.Tensor:
        gathered = torch.empty(2 * world, device=device)
        dist.all_gather_into_tensor(gathered, mine)
        return gathered

    def reduce_scatter_tensor(op=dist.ReduceOp.SUM) -> torch.Tensor:  # noqa: ANN001
        scattered = torch.empty(1, device=device)
        dist.reduce_scatter_tensor(scattered, torch.arange(2.0, device=device) + rank, op=op)
        return scattered

    attempt("all_reduce", all_reduce, torch.full((2,), 3.0))
    attempt("all_gather_into_tensor", all_gather_into_tensor, torch.tensor([1.0, 1.0, 2.0, 2.0]))
    attempt("reduce_scatter_tensor", reduce_scatter_tensor, torch.tensor([1.0 + 2 * rank]))
    # FSDP2 reduces fp32 gradients with AVG: does gloo with these tensors average, or sum (torch 2.8 on CPU)?
    average = dist.ReduceOp.AVG
    attempt("all_reduce_avg", lambda: all_reduce(average), torch.full((2,), 1.5), summed=torch.full((2,), 3.0))
    scattered_average, scattered_sum = torch.tensor([0.5 + rank]), torch.tensor([1.0 + 2 * rank])
    attempt("reduce_scatter_tensor_avg", lambda: reduce_scatter_tensor(average), scattered_average, scattered_sum)
    if all(results[name] == "ok" for name in ("all_gather_into_tensor", "reduce_scatter_tensor")):
        for name, force_sum in (("fsdp2_step", True), ("fsdp2_step_avg", False)):
            try:
                record(name, _fsdp2_step(device, force_sum))
            except Exception as error:
                record(name, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    else:
        record("fsdp2_step", "not tried: gloo lacks a collective FSDP2 needs on this device")
    dist.destroy_process_group()


def _fsdp2_step(device, force_sum: bool) -> str:  # noqa: ANN001
    """One SGD step of a 2-layer MLP sharded over the 2 ranks on ``device``, against the same step in one process;
    ``force_sum``: FSDP2 sums and divides itself, as the strategy makes it on gloo (else it asks gloo for AVG)."""
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
    for unit in (sharded[0], sharded[2], sharded):
        unit.set_force_sum_reduction_for_comms(force_sum)
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(device)  # the same on both ranks
    for model in (reference, sharded):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(inputs).square().mean().backward()
        optimizer.step()
    full = {name: tensor.full_tensor() for name, tensor in sharded.state_dict().items()}
    difference = max((full[name] - tensor).abs().max().item() for name, tensor in reference.state_dict().items())
    how = "FSDP2 summing and dividing" if force_sum else "FSDP2 asking gloo for AVG"
    if difference > 1e-5:
        raise AssertionError(f"2 ranks on {device}, {how}, differ from one process by {difference:.2e} after a step")
    return f"ok: 2 ranks on {device}, {how}, max |diff| vs one process {difference:.1e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true", help="on CPU, tiny sizes: a test of this script")
    parser.add_argument("--deadline", type=float, default=DEADLINE, help="seconds for the whole run")
    parser.add_argument("--core_tests", action="store_true", help="the core tests on CPU cores 8-15 meanwhile")
    parser.add_argument("--probe-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preflight-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe_rank:
        probe_rank(args.out, args.rehearse)
        return 0
    if args.preflight_child:
        preflight_child(args.rehearse)
        return 0
    return session(args.out, args.rehearse, args.deadline, args.core_tests)


def throughput_command(out: Path, rehearse: bool, budget: float, compile_off: bool) -> list[str]:
    """``gpu_throughput.py`` for ``budget`` seconds: without compile on both sides when the preflight found that
    compile cannot work here."""
    backend = "none" if compile_off else "aot_eager" if rehearse else "inductor"
    tiny = ["--tiny", "--device", "cpu", "--micro_batch", "2", "--warmup", "1", "--steps", "2"]
    return [
        sys.executable, str(BENCHMARKS / "gpu_throughput.py"), "--out", str(out / "throughput.jsonl"),
        "--log_dir", str(out), "--budget", f"{budget:.0f}", "--backend", backend, *(tiny if rehearse else []),
    ]  # fmt: skip


def experts_command(out: Path, rehearse: bool, budget: float) -> list[str]:
    """``gpu_experts.py`` for ``budget`` seconds (its own deadline ends a variant at it)."""
    tiny = ["--tiny", "--device", "cpu", "--warmup", "1", "--steps", "2"]
    return [
        sys.executable, str(BENCHMARKS / "gpu_experts.py"), "--out", str(out / "experts.jsonl"),
        "--log_dir", str(out), "--budget", f"{budget:.0f}", *(tiny if rehearse else []),
    ]  # fmt: skip


def session(out: Path, rehearse: bool, seconds: float, with_core_tests: bool = False) -> int:
    started = time.monotonic()
    deadline = started + seconds
    summary = out / "summary.txt"

    def note(line: str) -> None:
        with summary.open("a") as file:
            file.write(f"[{time.monotonic() - started:5.0f} s] {line}\n")
        print(line, flush=True)

    def left(keep: float = 0.0) -> float:
        """Seconds until the deadline, less ``keep`` for the parts after this one."""
        return deadline - time.monotonic() - keep

    note(f"session: deadline {seconds:.0f} s")
    checked = preflight(out, rehearse)
    note(f"preflight: {checked['line']}")
    if checked["abort"] is not None:
        note(f"stopped: nothing after the preflight can work here ({checked['abort']})")
        note(NOT_TESTED)
        return 1
    background = core_tests(out, rehearse) if with_core_tests else None
    device = ["--device", "cpu"] if rehearse else []
    check_env = dict(_env(), GPU_CHECK_VERBOSE="1", **({"GPU_CHECK_CPU_RANKS": "1"} if rehearse else {}))
    budget = min(GPU_CHECK, left(EXPERTS + PROBE + WRAP_UP + 60))  # the throughput needs a minute at least
    check = [sys.executable, str(BENCHMARKS / "gpu_check.py"), *device, "--budget", f"{budget:.0f}"]
    note(f"gpu_check (budget {budget:.0f} s): {_run(check, out / 'gpu_check.txt', budget + 15, check_env)}")
    budget = left(EXPERTS + PROBE + WRAP_UP)  # what gpu_check left is passed on
    throughput = throughput_command(out, rehearse, budget, compile_off=checked["compile_off"] is not None)
    if checked["compile_off"]:
        note(f"throughput: both sides WITHOUT compile: {checked['compile_off']}")
    # its own deadline ends the variants at ``budget``; the margin lets it record the one it ended
    result = _run(throughput, out / "throughput.txt", budget + WRAP_UP - 2) if budget >= 30 else "out of time"
    note(f"throughput (budget {budget:.0f} s): {result}")
    budget = min(EXPERTS, left(PROBE + WRAP_UP))
    result = _run(experts_command(out, rehearse, budget), out / "experts.txt", budget + 5) if budget >= 15 else None
    note(f"experts (budget {budget:.0f} s): {result or 'out of time'}")
    budget = min(PROBE, left(WRAP_UP / 2))
    note(f"probe (budget {budget:.0f} s): {probe(out, rehearse, budget) if budget >= 10 else 'out of time'}")
    if background is not None:
        try:
            background.wait(timeout=max(1.0, left(WRAP_UP / 2)))
            note(f"core tests: exit {background.returncode}")
        except subprocess.TimeoutExpired:
            end_tree(background)
            note("core tests: stopped at the deadline")
    for name in ("gpu_check.txt", "throughput.txt", "experts.txt", "probe.json"):
        path = out / name
        if path.exists():
            note(f"--- {name}\n{path.read_text().strip()}")
    note(NOT_TESTED)
    note(f"session: done in {time.monotonic() - started:.0f} s of its {seconds:.0f} s deadline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
