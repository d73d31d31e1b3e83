"""benchmarks/gpu_check.py: without CUDA it says so and exits 0; its list covers the CUDA-only paths of #24; the GPU
machine's prepared run (benchmarks/gpu_session.py) rehearsed on CPU."""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import REPO_ROOT


def test_without_cuda_the_gpu_check_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    script = REPO_ROOT / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == (
        "gpu_check: no CUDA device on this machine: nothing checked (exit 0). Run it where a GPU is."
    )


def test_the_gpu_check_has_a_line_for_every_cuda_only_path():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    names = [check.name for check in gpu_check.CHECKS]
    assert len(names) == len(set(names))
    required = {"nccl_init", "bf16_mixed", "meta_init_raw_load", "async_save", "cpu_offload", "tensor_parallel"}
    assert required | {"shard_size_auto"} <= set(names)
    assert {check.name for check in gpu_check.CHECKS if check.min_devices >= 2} == {"tensor_parallel"}


def test_checks_that_need_a_package_name_it():
    """Without transformers, transformers_init SKIPs (it failed with ImportError); without torchao, float8 SKIPs (it
    passed as 'refused', which is no evidence)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    requires = {check.name: check.requires for check in gpu_check.CHECKS}
    assert requires["transformers_init"] == ("transformers",) and requires["float8"] == ("torchao",)
    assert requires["qlora"][0] == "bitsandbytes"


def _benchmark(name: str):  # noqa: ANN202
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))


@pytest.mark.timeout(900)
def test_the_prepared_gpu_session_rehearses_end_to_end_on_cpu(tmp_path):
    """``benchmarks/gpu_session.py --rehearse``: every part of the GPU machine's prepared run, on CPU with tiny sizes
    (the CUDA-only checks and float8 skip, saying why): the preflight, one deadline whose leftovers pass on, each
    throughput variant's whole log in its own file, this package against torchtitan's recipe compiled alike, the
    save measured inside the selective run, the experts' local half under FSDP and EP8, the probe asking gloo for
    AVG, and what one GPU leaves untested."""
    session = _benchmark("gpu_session")
    script = REPO_ROOT / "benchmarks" / "gpu_session.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--rehearse"], capture_output=True, text=True, timeout=850
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "preflight: ok; compile: ok" in summary, summary
    preflight = json.loads((tmp_path / "preflight.json").read_text())
    assert all(preflight["answers"][name]["ok"] for name in ("lightning", "cuda", "c_compiler", "compile")), preflight
    parts = ("gpu_check (budget 90 s): exit 0", "throughput (budget", "experts (budget 40 s): exit 0")
    for part in (*parts, "probe (budget 45 s): exit 0"):
        assert part in summary, summary
    # one deadline: the throughput gets all the time gpu_check left, less the experts', the probe's and the wrap-up's
    started, budget = re.search(
        r"\[ *(\d+) s\] gpu_check .*\n\[ *\d+ s\] throughput \(budget (\d+) s\)", summary
    ).groups()
    kept = session.EXPERTS + session.PROBE + session.WRAP_UP
    assert abs(int(budget) - (session.DEADLINE - int(started) - kept)) <= 2, summary
    checks = (tmp_path / "gpu_check.txt").read_text()
    passed = {line.split()[1] for line in checks.splitlines() if line.startswith("PASS")}
    assert {"nccl_init", "bf16_mixed", "meta_init_raw_load", "async_save"} <= passed, checks
    assert "FAIL" not in checks and "SKIP  float8                 needs CUDA" in checks, checks
    results = {
        line["variant"]: line for line in map(json.loads, (tmp_path / "throughput.jsonl").read_text().split("\n")[:-1])
    }
    assert results["float8"] == {"variant": "float8", "skipped": "float8 needs CUDA"}
    throughput = _benchmark("gpu_throughput")
    command = session.throughput_command(tmp_path, True, 0, False)
    tokens = int(command[command.index("--micro_batch") + 1]) * throughput.TINY["max_seq_len"]  # per step
    warmup = int(command[command.index("--warmup") + 1])
    for variant in ("selective", "torchtitan", "full"):
        result = results[variant]
        assert result["device"].startswith("cpu"), result
        log = (tmp_path / f"throughput-{variant}.log").read_text()
        assert f"{variant}: pid" in log and "step 3:" in log and "result: {" in log, log[-2000:]
        # the figures against what the run logged: step_s the median of the timed steps' seconds (the log's 3
        # decimals: 5e-4 s off at most, step_s's own 4 decimals 5e-5 s more), tokens_per_s a step's tokens
        # (micro-batch x sequence) over it (rounded to 0.1 token/s, and step_s to 5e-5 s)
        seconds = [float(found) for found in re.findall(r"^step \d+: ([\d.]+) s,", log, flags=re.MULTILINE)]
        assert len(seconds) == warmup + 2, log[-2000:]
        assert abs(result["step_s"] - statistics.median(seconds[warmup:])) <= 5.5e-4 + 1e-9, (result, seconds)
        rounding = 5e-5 / result["step_s"] + 0.05 / result["tokens_per_s"]
        counted = result["tokens_per_s"] * result["step_s"]
        print(f"{variant}: {counted:.3f} tokens a step by the result, {tokens} by the batch (rounding {rounding:.2g})")
        assert abs(counted / tokens - 1) <= rounding + 1e-9, (result, tokens)
    ours, baseline = results["selective"], results["torchtitan"]
    for key in ("compile", "graphs", "graph_breaks", "recompiles"):  # compiled alike, so the ratio measures the rest
        assert ours[key] == baseline[key], (key, ours, baseline)
    assert ours["compile"] == "aot_eager" and ours["graphs"] >= 1 and ours["graph_breaks"] == 0, ours
    assert "ours selective / torchtitan = " in summary and "best lever: " in summary, summary
    save = results["save"]  # inside the selective run: its log has the saves
    assert save["load_exact"] is True and save["staged_s"] >= save["issued_s"] > 0 and save["step_after_s"] > 0, save
    assert "save 2: issued in" in (tmp_path / "throughput-selective.log").read_text()
    experts = {line["variant"]: line for line in map(json.loads, (tmp_path / "experts.jsonl").read_text().splitlines())}
    assert experts["fsdp"]["experts"] == 16 and experts["ep8"]["experts"] == 2, experts
    assert "experts, one layer's local half (cpu): ep8 / fsdp tokens/s = " in summary, summary
    assert "result: {" in (tmp_path / "experts-ep8.log").read_text()
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["reduce_scatter_tensor"] == "ok" and probe["fsdp2_step"].startswith("ok: 2 ranks on cpu:0"), probe
    assert probe["reduce_scatter_tensor_avg"] == "averages (ok)", probe  # gloo asked for AVG directly (2.13 on CPU)
    assert session.NOT_TESTED in summary and "multi-node" in session.NOT_TESTED, summary
    assert "expert parallelism between ranks" in session.NOT_TESTED
    assert re.search(r"session: done in \d+ s of its 400 s deadline", summary), summary


@pytest.mark.timeout(120)
def test_the_experts_local_half_holds_an_eighth_of_the_experts_on_the_same_rows(tmp_path):
    """``benchmarks/gpu_experts.py``, what one GPU can run of expert parallelism: the EP8 side holds 1/8 of the
    layer's experts (1/8 of the gathered weights) and multiplies the same rows as FSDP's side (T k: its own tokens'
    choices, brought by the exchange), 8 times as many per expert, with torch's grouped GEMM; each variant's own log."""
    script = REPO_ROOT / "benchmarks" / "gpu_experts.py"
    command = [sys.executable, str(script), "--out", str(tmp_path / "experts.jsonl"), "--tiny", "--device", "cpu"]
    done = subprocess.run(command + ["--warmup", "1", "--steps", "2"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    experts = _benchmark("gpu_experts")
    results = {line["variant"]: line for line in map(json.loads, (tmp_path / "experts.jsonl").read_text().splitlines())}
    fsdp, ep = results["fsdp"], results["ep8"]
    tiny = experts.TINY
    assert (fsdp["experts"], ep["experts"]) == (tiny["experts"], tiny["experts"] // 8), results
    assert fsdp["rows"] == ep["rows"] == tiny["tokens"] * tiny["top_k"], results
    assert ep["rows_per_expert"] == 8 * fsdp["rows_per_expert"], results
    assert ep["weights_bytes"] * 8 == fsdp["weights_bytes"], results
    assert fsdp["grouped_mm"] == ep["grouped_mm"] == "torch.nn.functional.grouped_mm", results
    assert fsdp["tokens_per_s"] > 0 and ep["tokens_per_s"] > 0, results
    for variant in experts.VARIANTS:
        log = (tmp_path / f"experts-{variant}.log").read_text()
        assert f"{variant}: pid" in log and "step 3:" in log and "result: {" in log, log[-2000:]
    assert "experts, one layer's local half (cpu): ep8 / fsdp tokens/s = " in done.stdout, done.stdout


@pytest.mark.timeout(300)
def test_a_throughput_variant_ended_at_its_deadline_leaves_its_log_and_no_process(tmp_path):
    """A variant that hangs mid-way (after its first step) is ended at the deadline: its log so far stays in its own
    file, its JSON line says how far it got and where the log is, and its process is gone."""
    script = REPO_ROOT / "benchmarks" / "gpu_throughput.py"
    out = tmp_path / "throughput.jsonl"
    command = [sys.executable, str(script), "--out", str(out), "--device", "cpu", "--tiny", "--backend", "none"]
    command += ["--variants", "full", "--budget", "25", "--micro_batch", "2", "--warmup", "1", "--steps", "2"]
    env = dict(os.environ, GPU_THROUGHPUT_STALL="full:1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    log = (tmp_path / "throughput-full.log").read_text()
    assert "step 1:" in log and "stalling after step 1" in log and "ended at its timeout of 25 s" in log, log
    line = json.loads(out.read_text().splitlines()[-1])
    assert line["variant"] == "full" and line["error"].startswith("ended at the deadline after 2"), line
    assert line["steps_done"] == 1 and line["log"] == str(tmp_path / "throughput-full.log"), line
    pid = int(re.search(r"full: pid (\d+)", log).group(1))
    assert not os.path.exists(f"/proc/{pid}"), f"the variant's process {pid} is still running"
    assert "no ratio (the torchtitan baseline did not finish)" in done.stdout, done.stdout


@pytest.mark.timeout(120)
def test_the_preflight_stops_a_run_that_cannot_work_within_30_s_and_says_why(tmp_path):
    """The preflight takes at most 30 s: a hung nvidia-smi is ended and said so; without lightning nothing after it
    can work (the run stops there); without the C compiler Triton needs (``$CC`` names none), both throughput sides
    run without compile, and the summary says why."""
    session = _benchmark("gpu_session")
    bin_dir, broken = tmp_path / "bin", tmp_path / "broken" / "lightning"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 60\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('lightning is broken here')\n")
    env = session._env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", CC=str(tmp_path / "no-such-cc"))
    env["PYTHONPATH"] = f"{broken.parent}{os.pathsep}{env['PYTHONPATH']}"
    start = time.monotonic()
    checked = session.preflight(tmp_path, rehearse=True, env=env)
    assert time.monotonic() - start < session.PREFLIGHT + 2, checked
    assert checked["abort"] == "lightning: ImportError: lightning is broken here", checked
    assert checked["compile_off"] == "not tried: Triton needs a C compiler (install gcc, or set CC)", checked
    assert "compile: OFF for both throughput sides" in checked["line"], checked
    assert "nvidia-smi: timed out after 10 s" in checked["line"], checked
    assert "nvidia-smi: timed out" in (tmp_path / "env.txt").read_text()
    command = session.throughput_command(tmp_path, rehearse=False, budget=200, compile_off=True)
    assert command[command.index("--backend") + 1] == "none"  # both sides


@pytest.mark.timeout(120)
def test_a_timed_out_torchrun_is_ended_with_its_workers(tmp_path):
    """torchrun starts its workers in sessions of their own: at the timeout they are ended too, not left holding
    the GPU."""
    processes = _benchmark("_processes")
    worker = tmp_path / "worker.py"
    worker.write_text(
        f"import os, time\nwith open({str(tmp_path / 'pids')!r}, 'a') as f: f.write(f'{{os.getpid()}}\\n')\n"
        "time.sleep(300)\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker)]
    try:
        code, _ = processes.run_logged(command, tmp_path / "log", timeout=15)
        pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
        assert code is None and len(pids) == 2, (tmp_path / "log").read_text()
        alive = [pid for pid in pids if processes._alive(pid)]
        assert not alive, f"torchrun's workers {alive} outlived its timeout"
    finally:
        for pid in (
            [int(pid) for pid in (tmp_path / "pids").read_text().split()] if (tmp_path / "pids").exists() else []
        ):
            if processes._alive(pid):
                os.kill(pid, signal.SIGKILL)  # only the workers this test started


def test_mfu_counts_causal_attention():
    """6 FLOPs per non-embedding parameter and 6 x layers x dim x sequence for causal attention (full attention's
    12 would read ~13 % high at the 1.3B size): the tiny model's count by hand."""
    throughput = _benchmark("gpu_throughput")
    from examples.tiny_llama import LlamaConfig

    config = LlamaConfig(**throughput.TINY)  # vocabulary 256, dim 64, 2 layers, sequence 32: 102,720 parameters
    assert throughput.flops_per_token(config, 102_720) == 6 * (102_720 - 256 * 64) + 6 * 2 * 64 * 32 == 542_592


def test_the_ratio_is_printed_only_when_both_sides_compiled_alike(tmp_path):
    """A graph break (or another backend, other graphs, recompiles) on either side: no ratio, and the line says why."""
    throughput = _benchmark("gpu_throughput")
    line = {"device": "NVIDIA H100 80GB HBM3", "compile": "inductor", "graphs": 1, "graph_breaks": 0, "recompiles": 0}
    results = tmp_path / "throughput.jsonl"
    rows = [
        {**line, "variant": "selective", "tokens_per_s": 1200.0},
        {**line, "variant": "torchtitan", "tokens_per_s": 1000.0},
        {**line, "variant": "full", "tokens_per_s": 900.0, "graph_breaks": 2, "graphs": 3},
    ]
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    headline = throughput.headline(results)
    assert "ours selective / torchtitan = 1.20" in headline and "best lever: selective at 1.20" in headline, headline
    assert (
        "ours full: no ratio, compiled differently from torchtitan (compile inductor vs inductor, graph_breaks 2 vs 0"
        in headline
    )
    rows[1] = {**rows[1], "graph_breaks": 1}  # the baseline broke: no ratio at all
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert "/ torchtitan =" not in throughput.headline(results)


def test_the_save_figures_time_the_staging_through_its_copies_and_the_step_after_a_save_without_a_sync(
    tmp_path, monkeypatch
):
    """``fabric.save`` returns once the copies are issued: the first save is timed through a device sync (the
    copies' end), and the step right after the second save starts with no sync between, so it pays for the overlap;
    one checkpoint at a time (the first deleted before the second)."""
    import types

    import torch

    throughput = _benchmark("gpu_throughput")
    events: list[str] = []
    ticks = iter(range(1, 1000))

    def clock() -> int:
        events.append("clock")
        return next(ticks)

    class Local:  # a shard: what the figures read of a DTensor
        def __init__(self) -> None:
            self.tensor = torch.ones(4)

        def to_local(self) -> torch.Tensor:
            return self.tensor

        def element_size(self) -> int:
            return 4

    class Fabric:
        device = torch.device("cpu")
        strategy = types.SimpleNamespace(wait_for_checkpoint=lambda: events.append("written"))

        def save(self, path, state) -> None:  # noqa: ANN001
            events.append(f"save {path.name}, saves on disk {len(list(tmp_path.iterdir()))}")
            path.mkdir()

        def load(self, path, state) -> None:  # noqa: ANN001
            events.append("load")

    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(throughput, "_sync", lambda device: events.append("sync"))
    monkeypatch.setattr(throughput, "_step", lambda *args: events.append("step"))
    model = types.SimpleNamespace(state_dict=lambda: {"w": Local()})
    args = types.SimpleNamespace(save_dir=str(tmp_path))
    figures = throughput._save_figures(args, Fabric(), model, types.SimpleNamespace(state={}), [None], 1.0)
    first = events.index("save save-1, saves on disk 0")
    assert events[first : first + 4] == ["save save-1, saves on disk 0", "clock", "sync", "clock"], events
    second = events.index("save save-2, saves on disk 0")  # save-1 deleted first
    assert events[second : second + 5] == ["save save-2, saves on disk 0", "clock", "step", "sync", "clock"], events
    assert figures["issued_s"] == 1 and figures["staged_s"] == 2 and figures["step_after_s"] == 1, figures
