"""benchmarks/gpu_check.py: without CUDA it says so and exits 0; its list covers the CUDA-only paths of #24; the GPU
machine's prepared run (benchmarks/gpu_session.py) rehearsed on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


@pytest.mark.timeout(900)
def test_the_prepared_gpu_session_rehearses_end_to_end_on_cpu(tmp_path):
    """``benchmarks/gpu_session.py --rehearse``: every part of the GPU machine's prepared run, on CPU with tiny sizes
    (the CUDA-only checks and float8 skip, saying why), each part's results written to its own file."""
    script = REPO_ROOT / "benchmarks" / "gpu_session.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--rehearse"], capture_output=True, text=True, timeout=850
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    for part in ("gpu_check: exit 0", "throughput: exit 0", "probe: exit 0", "core tests: exit 0"):
        assert part in summary, summary
    checks = (tmp_path / "gpu_check.txt").read_text()
    passed = {line.split()[1] for line in checks.splitlines() if line.startswith("PASS")}
    assert {"nccl_init", "bf16_mixed", "meta_init_raw_load", "async_save"} <= passed, checks
    assert "FAIL" not in checks and "SKIP  float8                 needs CUDA" in checks, checks
    results = {
        line["variant"]: line for line in map(json.loads, (tmp_path / "throughput.jsonl").read_text().split("\n")[:-1])
    }
    assert results["float8"] == {"variant": "float8", "skipped": "float8 needs CUDA"}
    for variant in ("selective", "handwritten", "full", "save"):
        assert results[variant]["tokens_per_s"] > 0 and results[variant]["graphs"] >= 1, results[variant]  # compiled
    assert results["save"]["load_exact"] is True and results["save"]["save2"]["blocked_s"] > 0, results["save"]
    assert "ours (compile + selective AC) / hand-written torchtitan-style loop = " in summary
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["reduce_scatter_tensor"] == "ok" and probe["fsdp2_step"].startswith("ok: 2 ranks on cpu:0"), probe
