"""benchmarks/gpu_check.py: without CUDA it says so and exits 0; its list covers the CUDA-only paths of #24."""

from __future__ import annotations

import os
import subprocess
import sys

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
