"""``fabric_hsdp.versions``: what differs across the supported torch releases, checked on the torch this runs on
(``make test-range`` runs this file on the floor, 2.11 and 2.14.1 as well)."""

from __future__ import annotations

import ast
from pathlib import Path
from unittest import mock

import pytest
import torch

from fabric_hsdp import versions


def test_zip_record_sizes_are_each_storage_s_bytes(tmp_path):
    file = tmp_path / "state.pth"
    tensors = {
        "a": torch.zeros(3, 5),
        "b": torch.arange(7, dtype=torch.int16),
        "c": torch.ones((), dtype=torch.bfloat16),
    }
    torch.save(tensors, file)
    sizes = versions.zip_record_sizes(file)
    records = torch._C.PyTorchFileReader(str(file)).get_all_records()
    assert set(sizes) == set(records)  # the names torch's own reader uses
    data = sorted((name for name in sizes if name.startswith("data/")), key=lambda name: int(name.split("/")[1]))
    assert sorted(sizes[name] for name in data) == sorted(t.untyped_storage().nbytes() for t in tensors.values())
    if hasattr(torch._C.PyTorchFileReader, "get_record_size"):  # torch >= 2.13: torch's own answer agrees
        reader = torch._C.PyTorchFileReader(str(file))
        assert {name: reader.get_record_size(name) for name in data} == {name: sizes[name] for name in data}


def test_accepts_reads_the_signature():
    def function(a, *, b=1):
        return a, b

    assert versions.accepts(function, "b") and not versions.accepts(function, "c")


def test_the_installed_torch_and_lightning_are_in_the_declared_range():
    """The package's declared floors are the releases ``make test-range`` tests: an older one is not supported."""
    from importlib.metadata import requires

    import lightning
    from packaging.requirements import Requirement
    from packaging.version import Version

    ranges = {Requirement(text).name: Requirement(text).specifier for text in requires("fabric-hsdp")}
    assert Version(torch.__version__.split("+")[0]) in ranges["torch"]
    assert Version(lightning.__version__) in ranges["lightning"]


def test_a_group_with_a_cpu_backend_is_bound_to_the_device_only_where_split_groups_keep_it(monkeypatch):
    """torch 2.8's split groups register CUDA only: a ``cpu:gloo,cuda:nccl`` group (CPU offload) stays unbound
    there, else its mesh groups have no CPU backend. Checked against torch's own split on this release."""
    import torch.distributed as dist

    splits_every_backend = hasattr(dist.ProcessGroup, "split_group")
    assert versions.may_bind_device("nccl") and versions.may_bind_device("cuda:nccl")
    assert versions.may_bind_device("cpu:gloo,cuda:nccl") == splits_every_backend
    if splits_every_backend:
        monkeypatch.delattr(dist.ProcessGroup, "split_group")  # what torch < 2.11 has
        assert not versions.may_bind_device("cpu:gloo,cuda:nccl")


def test_the_dry_runs_plan_validator_passes_a_plan_torchs_own_refuses():
    """A plan holding one rank's chunk of a tensor that spans two ranks: torch's validator refuses it, the stand-in
    passes it on this release, whichever form torch's answer takes (``True`` before 2.13, ``[]`` from 2.13)."""
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])
    metadata = Metadata(state_dict_metadata={"w": tensor})
    plans = [SavePlan([]), SavePlan([])]

    def passes(answer) -> bool:
        return answer is True or answer == []

    assert not passes(default_planner._validate_global_plan(plans, metadata))  # half the tensor: refused
    assert passes(versions.passing_plan_validator()(plans, metadata))
    # and DCP's own planner, which reads the answer in this release's form, takes the plan with the stand-in
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    half = WriteItem(
        index=MetadataIndex("w", torch.Size([0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=tensor.properties, size=torch.Size([4])),
    )
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        default_planner.DefaultSavePlanner().create_global_plan(
            [SavePlan([half], planner_data={}), SavePlan([], planner_data={})]
        )
    with mock.patch.object(default_planner, "_validate_global_plan", versions.passing_plan_validator()):
        _, saved = default_planner.DefaultSavePlanner().create_global_plan(
            [SavePlan([half], planner_data={}), SavePlan([], planner_data={})]
        )
    assert list(saved.state_dict_metadata) == ["w"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_torch_names(tree: ast.AST) -> list[tuple[int, str]]:
    """The lines of ``tree`` that import a private torch module or name, or read a private attribute through a name
    bound to torch (``torch._C.X``, ``dist.distributed_c10d._f``, ``nn.modules.dropout._DropoutNd``)."""
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound.add(alias.asname or "torch")
                    if any(map(_private, alias.name.split("."))):
                        found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(map(_private, [*node.module.split("."), alias.name])):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append((node.lineno, ".".join([root.id, *reversed(chain)])))
    return found


def test_no_private_torch_name_outside_the_versions_module():
    """Private torch names (``torch._C``, ``torch.distributed.checkpoint._nested_dict``, ...) are reached through
    ``fabric_hsdp/versions.py`` only, so a torch release that moves one breaks that file alone. A simple ast walk:
    private attributes of torch objects held in variables (``mesh._flatten``) are not seen."""
    package = Path(versions.__file__).parent
    uses = [
        f"{path.relative_to(package.parent)}:{line}: {name}"
        for path in sorted(package.rglob("*.py"))
        if path != package / "versions.py"
        for line, name in _private_torch_names(ast.parse(path.read_text(), str(path)))
    ]
    assert not uses, "private torch names outside fabric_hsdp/versions.py:\n" + "\n".join(uses)


def test_gloo_reductions_are_summed_whatever_tensors_gloo_carries(monkeypatch):
    """torch 2.8's gloo summed when asked to average, so FSDP2 sums and divides over gloo itself. Keyed on the
    backend, not the device: gloo with CUDA tensors gets it too, NCCL beside a CPU gloo (offload) does not."""
    import torch.distributed as dist

    from fabric_hsdp.setup.fsdp import reduces_by_sum

    class Mesh:
        def __init__(self, device_type: str, backends: list[str]) -> None:
            self.device_type, self.backends, self.ndim = device_type, backends, len(backends)

        def get_group(self, dim: int) -> str:
            return self.backends[dim]  # stands for the group: dist.get_backend below names it

    monkeypatch.setattr(dist, "get_backend", lambda group: group)
    assert versions.backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert versions.backend_for_device("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert reduces_by_sum(Mesh("cuda", ["gloo", "gloo"]))  # two ranks on one GPU over gloo
    assert reduces_by_sum(Mesh("cuda", ["cuda:gloo"]))
    assert reduces_by_sum(Mesh("cpu", ["gloo", "gloo"]))
    assert not reduces_by_sum(Mesh("cuda", ["nccl", "nccl"]))
    assert not reduces_by_sum(Mesh("cuda", ["cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"]))


@pytest.mark.parametrize("lever", ["expert_parallel_size", "context_parallel_size"])
def test_expert_and_context_parallelism_are_refused_at_construction_on_a_torch_that_cannot_run_them(lever):
    from fabric_hsdp import HybridFSDPStrategy

    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release < (2, 9):  # torch 2.8 (the floor of make test-range)
        with pytest.raises(ValueError, match=lever + r"=2\) cannot run here: torch 2\.8.*2\.9 or newer"):
            HybridFSDPStrategy(**{lever: 2})
    else:  # tests/test_expert_parallel.py and test_context_parallel.py train with them (2.9.1, 2.11, 2.13, 2.14.1)
        assert versions.split_shard_dim_unsupported() is None
        HybridFSDPStrategy(**{lever: 2})
    HybridFSDPStrategy(**{lever: 1})  # every release
