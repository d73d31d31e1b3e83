"""A user's install brings no torchao: ``pip install .``, ``.[examples]`` and ``make setup`` / ``make main``.

Where torchao is installed, every process that imports transformers imports it too (transformers' quantizers do), and
its import logs "Failed to load .../torchao/_C_mxfp8...so" (its CUDA kernels, on a CPU build) and two torch
deprecation warnings (its enums registered as pytree constants): lines a user takes for failures. Only
``.[float8]`` needs it, and the test extras (the float8 conversion test).
"""

from __future__ import annotations

import re
import subprocess

import tomllib

from tests.helpers.launch import REPO_ROOT


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_pip_install_and_the_examples_extra_bring_no_torchao():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "torchao" not in _names(project["dependencies"])
    assert "torchao" not in _names(extras["examples"]) and {"litgpt", "transformers"} <= _names(extras["examples"])
    assert "torchao" in _names(extras["float8"])


def test_make_setup_and_make_main_install_no_test_extras(tmp_path):
    """What the README's `make main` installs into a fresh venv (``make -n``: the commands printed, not run)."""

    def installs(target: str) -> list[str]:
        printed = subprocess.run(
            ["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        assert printed.returncode == 0, printed.stderr
        return [line for line in printed.stdout.splitlines() if " install " in line]

    for target in ("setup", "main"):
        lines = installs(target)
        assert any('-e ".[examples]"' in line for line in lines), lines
        assert not any("[test]" in line or "torchao" in line for line in lines), lines
    assert any('-e ".[test]"' in line for line in installs("test")), installs("test")
