"""``tools/callpath.py``, the count behind "one way down": it sees a back-call and an up-call when there is one, and
the package's load and save flows have none."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def callpath():
    spec = importlib.util.spec_from_file_location("callpath", ROOT / "tools" / "callpath.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["callpath"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    del sys.modules["callpath"]


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        file = root / "fabric_hsdp" / name
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(textwrap.dedent(text))
    for directory in (root / "fabric_hsdp").rglob("*"):
        if directory.is_dir():
            (directory / "__init__.py").touch()
    (root / "fabric_hsdp" / "__init__.py").touch()


def _walk(callpath, root: Path):
    walk = callpath.Walk(callpath.load_package(root))
    walk.run("fabric_hsdp.strategy:HybridFSDPStrategy.save_checkpoint")
    return walk


def test_a_core_module_calling_back_into_the_training_path_is_a_back_call_and_an_up_call(callpath, tmp_path):
    _package(
        tmp_path,
        {
            "strategy.py": """
                from fabric_hsdp.checkpoint.training.sharded import save_sharded
                class HybridFSDPStrategy:
                    def save_checkpoint(self, path):
                        save_sharded(path)
            """,
            "checkpoint/training/sharded.py": """
                from fabric_hsdp.checkpoint.core.commit import commit
                def save_sharded(path):
                    commit(path)
                def log_saved(path):
                    pass
            """,
            "checkpoint/core/commit.py": """
                from fabric_hsdp.checkpoint.training import sharded
                def commit(path):
                    sharded.log_saved(path)
            """,
        },
    )
    walk = _walk(callpath, tmp_path)
    assert walk.back_calls == [
        "fabric_hsdp.checkpoint.core.commit:commit -> fabric_hsdp.checkpoint.training.sharded:log_saved"
    ]
    assert walk.up_calls == walk.back_calls
    assert len(walk.files) == 3 and len(walk.reentries) == 1


def test_a_helper_shared_by_two_callers_is_a_re_entry_only(callpath, tmp_path):
    _package(
        tmp_path,
        {
            "strategy.py": """
                from fabric_hsdp.checkpoint.training import sharded, full
                class HybridFSDPStrategy:
                    def save_checkpoint(self, path):
                        sharded.save(path)
                        full.save(path)
            """,
            "checkpoint/training/sharded.py": """
                from fabric_hsdp.checkpoint.core.fileio import write
                def save(path):
                    write(path)
            """,
            "checkpoint/training/full.py": """
                from fabric_hsdp.checkpoint.core import fileio
                def save(path):
                    fileio.write_all(path)
                    names = set()
                    names.add(path)  # a set's method, not the package's one `add`
            """,
            "checkpoint/core/fileio.py": """
                def write(path):
                    pass
                def write_all(path):
                    pass
                class Registry:
                    def add(self, item):
                        pass
            """,
        },
    )
    walk = _walk(callpath, tmp_path)
    assert walk.back_calls == [] and walk.up_calls == []
    assert [Path(file).name for file in walk.reentries] == ["fileio.py"]
    assert not any("Registry.add" in line for line in walk.lines)


@pytest.mark.parametrize("flow", ["load", "load_raw", "save"])
def test_the_package_flows_go_one_way_down(callpath, flow):
    walk = callpath.Walk(callpath.load_package(ROOT))
    walk.run(callpath.FLOWS[flow])
    assert len(walk.files) > 10  # the walk followed the flow down, not stopped at the strategy
    assert walk.back_calls == []
    assert walk.up_calls == []
    # what the checkpoint code knows about models lives in models/: a checkpoint flow enters no other sub-package
    # (tensor_parallel/, adapters/, expert_parallel/, ...), only checkpoint/, models/ and top-level helpers
    assert _rooms_outside(walk.files, {"checkpoint", "models"}) == []


def test_the_setup_flow_does_not_enter_checkpoint(callpath):
    walk = callpath.Walk(callpath.load_package(ROOT))
    walk.run("fabric_hsdp.setup.pipeline:set_up_module")
    assert len(walk.files) > 10  # the walk followed the setup down
    # LoRA wrappers, fused rows and tied weights are asked of models/, not of the checkpoint code
    assert [file for file in walk.files if _parts(file)[1] == "checkpoint"] == []


def _rooms_outside(files, allowed: set[str]) -> list[str]:
    """The files in a sub-package of ``fabric_hsdp`` other than ``allowed`` (top-level modules are helpers)."""
    return [file for file in files if len(_parts(file)) > 2 and _parts(file)[1] not in allowed]


def _parts(file: str) -> tuple[str, ...]:
    return Path(file).relative_to(ROOT).parts  # ("fabric_hsdp", "checkpoint", "core", "keys.py")
