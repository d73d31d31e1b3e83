"""What differs across the torch and Lightning releases the package supports, in one place.

Supported and tested: torch 2.8 to 2.14 with Lightning 2.6.1 or newer (``make test-range`` runs the core tests on
torch 2.8 with Lightning 2.6.1, on 2.11 and on 2.14.1; ``make test`` the whole suite on 2.13). Each shim detects the
feature, not the version number, and says which releases need it; code elsewhere calls these instead of branching
on versions.
"""

from __future__ import annotations

import inspect
import io
import zipfile
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch


def zip_record_sizes(file: str | Path) -> dict[str, int]:
    """The size in bytes of every record of a torch zip file, by its name inside the archive (``"data/0"``).

    ``torch._C.PyTorchFileReader.get_record_size`` exists from torch 2.13 only, so the sizes come from the zip's
    central directory (for every release: one path). Names drop the archive's top folder, as torch's reader does.
    """
    with zipfile.ZipFile(file) as archive:
        return {info.filename.split("/", 1)[-1]: info.file_size for info in archive.infolist()}


def load_on_meta(file: str | Path | IO[bytes], *, weights_only: bool) -> Any:
    """``torch.load`` with every tensor on the meta device and its storage's byte offset in the file
    (``storage._checkpoint_offset``), reading no tensor data; sizes with :func:`stored_bytes`.

    torch >= 2.11 sets the offsets for ``map_location="meta"``; torch 2.8 only under ``FakeTensorMode`` (its meta
    load reads every storage and keeps no offset).
    """
    if _meta_load_sets_offsets():
        return torch.load(file, map_location="meta", weights_only=weights_only)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.load(file, map_location="meta", weights_only=weights_only)


def stored_bytes(tensor: torch.Tensor) -> int:
    """The byte size of the storage of a tensor from :func:`load_on_meta`.

    torch 2.8's fake-mode load makes each storage ``element size`` times its real size (it passes a byte count
    where the element count is expected).
    """
    nbytes = tensor.untyped_storage().nbytes()
    return nbytes if _meta_load_sets_offsets() else nbytes // tensor.element_size()


@cache
def _meta_load_sets_offsets() -> bool:
    probe = io.BytesIO()
    torch.save(torch.zeros(2), probe)
    probe.seek(0)
    loaded = torch.load(probe, map_location="meta", weights_only=True)
    return getattr(loaded.untyped_storage(), "_checkpoint_offset", None) is not None


@cache
def accepts(function: Any, parameter: str) -> bool:
    """Whether ``function``'s signature has ``parameter`` (keyword arguments added in later releases)."""
    return parameter in inspect.signature(function).parameters


def may_bind_device(backend: str) -> bool:
    """Whether the default process group may be bound to this rank's device (``init_process_group(device_id=)``).

    A bound group makes DeviceMesh split its dim groups off it. Before ``ProcessGroup.split_group`` (torch < 2.11),
    the split groups get the CUDA backend only, so with ``cpu:gloo,cuda:nccl`` (CPU offload) every CPU collective on
    a mesh group fails with "No backend type associated with device type cpu". There a group with a CPU part stays
    unbound, and DeviceMesh builds its groups with ``new_group``, every backend included.
    """
    import torch.distributed as dist

    return "cpu:" not in backend or hasattr(dist.ProcessGroup, "split_group")


def passing_plan_validator() -> Any:
    """A stand-in for DCP's private ``default_planner._validate_global_plan`` that passes every save plan (the dry
    run's plan holds one rank's chunks of tensors that span many ranks).

    torch < 2.13 answers ``True`` for a valid plan, 2.13 and later a list of errors (empty when valid); the stand-in
    answers what torch's own validator answers for an empty plan.
    """
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.metadata import Metadata

    valid = default_planner._validate_global_plan([], Metadata(state_dict_metadata={}))
    return lambda *args, **kwargs: valid


def gloo_reduces_average_as_sum(device_type: str) -> bool:
    """Whether FSDP2's gradient reductions must be sums it divides itself, not ``ReduceOp.AVG``.

    torch 2.8's gloo ``reduce_scatter_tensor`` sums when asked for ``AVG`` (seen: ranks holding 1 and 2 get 3, not
    1.5), so FSDP2 (which averages fp32/bf16 gradients with ``AVG``) returned ``shard_size`` times the gradient on CPU.
    Summing and dividing is exact on every release, so CPU meshes (gloo) always do it; CUDA's NCCL averages.
    """
    return device_type == "cpu"
