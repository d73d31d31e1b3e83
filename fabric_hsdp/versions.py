"""What differs across the torch and Lightning releases the package supports, in one place.

Supported and tested: torch 2.8 to 2.14 with Lightning 2.6.1 or newer (``make test-range`` runs the core tests on
torch 2.8 with Lightning 2.6.1, on 2.11 and on 2.14.1; ``make test`` the whole suite on 2.13). Each shim detects the
feature, not the version number, and says which releases need it; code elsewhere calls these instead of branching
on versions. The private torch names the package uses are reached through here only (see the end of the file).
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
    with fake_tensor_mode():
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
    return checkpoint_offset(loaded.untyped_storage()) is not None


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


def backend_for_device(backend: str, device_type: str) -> str:
    """The backend a process group uses for ``device_type``'s tensors: ``"gloo"`` from ``"gloo"``, ``"nccl"`` from
    ``"cpu:gloo,cuda:nccl"`` for ``"cuda"`` (``dist.get_backend``'s two spellings)."""
    if ":" not in backend:
        return backend
    by_device = dict(part.split(":", 1) for part in backend.split(","))
    return by_device.get(device_type, backend)


def gloo_reduces_average_as_sum(backend: str) -> bool:
    """Whether FSDP2's gradient reductions over ``backend`` (the one the mesh's device type uses) must be sums it
    divides itself, not ``ReduceOp.AVG``.

    torch 2.8's gloo ``reduce_scatter_tensor`` sums when asked for ``AVG`` (seen on CPU: ranks holding 1 and 2 get
    3, not 1.5), so FSDP2 (which averages fp32/bf16 gradients with ``AVG``) returned ``shard_size`` times the
    gradient. 2.13's gloo averages on CPU; gloo with CUDA tensors (copied through host memory) on 2.11 is unknown
    (``benchmarks/gpu_session.py``'s probe asks it). Keyed on the backend, not the device: gloo is gloo whatever
    tensors it carries, and summing then dividing is exact on every release, so every gloo reduction does it. NCCL
    averages.
    """
    return backend == "gloo"


# Private torch names: every use in the package goes through here.
#
# A torch release that moves or renames one breaks this file only (tests/test_versions.py checks that no other module
# names one). Each is looked up when called, so importing this module imports no more of torch than ``import torch``.

# torch._C: the zip reader and writer of torch.save's format.


def torch_file_reader(file: str) -> Any:
    """``torch._C.PyTorchFileReader``: the records of the torch zip file ``file``."""
    return torch._C.PyTorchFileReader(file)


def torch_file_writer(file: Any) -> Any:
    """``torch._C.PyTorchFileWriter``: writes torch zip records to a path or a stream."""
    return torch._C.PyTorchFileWriter(file)


# torch.storage, torch.serialization: what torch.save pickles and torch.load sets.


def dtype_to_storage_type_map() -> dict[torch.dtype, str]:
    """``torch.storage._dtype_to_storage_type_map()``: ``torch.float32`` -> ``"FloatStorage"``, ..."""
    return torch.storage._dtype_to_storage_type_map()


def serialization_get_layout() -> Any:
    """``torch.serialization._get_layout``, a global that DCP's pickled ``.metadata`` names."""
    return torch.serialization._get_layout


def checkpoint_offset(storage: Any) -> int | None:
    """The byte offset in its file of a storage from :func:`load_on_meta` (``_checkpoint_offset``), else None."""
    return getattr(storage, "_checkpoint_offset", None)


# torch._subclasses.fake_tensor


def fake_tensor_mode(**kwargs: Any) -> Any:
    """``FakeTensorMode(**kwargs)``: tensors made within it have a shape and a dtype but no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def data_dependent_output_error() -> type:
    """The error a fake tensor raises when asked for a value it does not hold (``.item()`` of a computed loss)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    return DataDependentOutputException


def active_fake_mode() -> Any:
    """The innermost active ``FakeTensorMode`` (``torch._guards.active_fake_mode``), None outside one."""
    from torch._guards import active_fake_mode

    return active_fake_mode()


def item_op() -> Any:
    """``aten._local_scalar_dense``: the op behind ``Tensor.item()`` (a tensor without data has no value to give)."""
    return torch.ops.aten._local_scalar_dense.default


def torch_dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: sees every ATen call made within it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def dtensor_sharding_propagator() -> type:
    """DTensor's ``ShardingPropagator``, whose ``_propagate_tensor_meta_non_cached`` runs each op once more on fake
    tensors of the global shapes (under the active fake mode, if any) to learn its output's shape."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    return ShardingPropagator


def storages_of(tensor: torch.Tensor) -> list[Any]:
    """The untyped storages behind ``tensor``, through wrapper subclasses (a DTensor's local tensor)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    return list(get_untyped_storages(tensor))


# torch.nn: Module's own dicts and hooks, the dropout base class.


def module_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """``module._parameters``: its own parameters by name (setting an entry skips ``register_parameter``)."""
    return module._parameters


def module_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """``module._buffers``: its own buffers by name."""
    return module._buffers


def module_hook_dicts(module: torch.nn.Module) -> tuple[dict, ...]:
    """Every dict of forward and backward hooks ``module`` holds."""
    return (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._forward_pre_hooks_with_kwargs,
        module._forward_hooks_with_kwargs,
        module._backward_pre_hooks,
        module._backward_hooks,
    )


def forward_hooks(module: torch.nn.Module) -> Any:
    """``module._forward_hooks``: its forward hooks by handle id, an ``OrderedDict`` in the order they run."""
    return module._forward_hooks


def register_state_dict_hook(module: torch.nn.Module, hook: Any) -> Any:
    """``module._register_state_dict_hook(hook)``: ``hook(module, state_dict, prefix, local_metadata)``."""
    return module._register_state_dict_hook(hook)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Any) -> Any:
    """``module._register_load_state_dict_pre_hook(hook)``: ``hook(state_dict, prefix, *args)``."""
    return module._register_load_state_dict_pre_hook(hook)


def dropout_base_class() -> type:
    """``torch.nn.modules.dropout._DropoutNd``: the base of every ``nn.Dropout`` kind."""
    return torch.nn.modules.dropout._DropoutNd


# torch.utils._pytree


def tree_map_only(type_or_types: Any, function: Any, tree: Any) -> Any:
    """``tree_map_only``: ``function`` applied to the leaves of ``tree`` of the given type(s)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(type_or_types, function, tree)


# torch.distributed.distributed_c10d, torch.distributed.device_mesh


def default_process_group_store() -> Any:
    """``distributed_c10d._get_default_store()``: the default process group's store."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``DeviceMesh._flatten(name)``: one mesh dim named ``name`` over all of ``mesh``'s dims."""
    return mesh._flatten(name)


def split_shard_dim_unsupported() -> str | None:
    """Why this torch cannot split the shard dim for expert or context parallelism, or ``None``. torch 2.8 slices no
    sub-mesh of a mesh whose ``shard`` dim is flattened from two of its dims ("Cannot create a submesh from a
    submesh", seen in ``make_replicas_identical``) and has no CPU ``torch._grouped_mm``; 2.9.1, 2.11, 2.13 and 2.14.1
    ran the expert- and context-parallel tests here. A structural difference, not one feature to probe before the
    processes exist: by release."""
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release < (2, 9):
        return f"torch {torch.__version__} lacks the device-mesh slicing it needs (torch 2.9 or newer has it)"
    return None


def slice_with_flattened(mesh: Any, names: tuple[str, ...]) -> Any:
    """``mesh[names]`` where some of ``names`` were made by :func:`flatten_mesh` on ``mesh`` (torchtitan's
    ``world_mesh["dp_replicate", "dp_shard_cp"]``). torch 2.11-2.14 warn that this "will be deprecated in PT 2.11"
    and still do it; the replacement (``_unflatten``) is missing before 2.11."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Slicing a flattened dim from root mesh")
        return mesh[names]


# torch.distributed.tensor._utils


def compute_local_shape_and_global_offset(global_shape: Any, mesh: Any, placements: Any) -> tuple:
    """The shape of this rank's local shard of a DTensor and its offset in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


# torch.distributed._functional_collectives, torch.ops._c10d_functional


def async_collective_tensor() -> type:
    """``AsyncCollectiveTensor``: a functional collective's result, waited for on first use."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return AsyncCollectiveTensor


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``wait_tensor``: wait for ``tensor``'s functional collective."""
    from torch.distributed._functional_collectives import wait_tensor

    return wait_tensor(tensor)


def all_to_all_single(
    tensor: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None, group: Any
) -> torch.Tensor:
    """The functional ``all_to_all_single`` (no gradient): rows ``input_splits`` to each rank, ``output_splits``
    from each (``None``: even)."""
    from torch.distributed._functional_collectives import all_to_all_single

    return all_to_all_single(tensor, output_splits, input_splits, group)


def functional_collectives_module() -> Any:
    """``torch.distributed._functional_collectives``, whose functions :func:`all_to_all_single` looks up at each call
    (so a dry run can stand in for one)."""
    import torch.distributed._functional_collectives as functional_collectives

    return functional_collectives


def all_to_all_single_autograd(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
) -> torch.Tensor:
    """The differentiable functional ``all_to_all_single``: backward sends the gradients the opposite way."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(tensor, output_splits, input_splits, group)


def causal_lower_right(queries: int, keys: int) -> Any:
    """torch's bottom-right causal attention bias (``torch.nn.attention.bias``), built outside any dispatch mode:
    under selective activation checkpointing's mode making the ``CausalBias`` subclass fails (torch 2.13: "Creating
    a new Tensor subclass CausalBias but the raw Tensor object is already associated to a python object of type
    Tensor"). It holds no data: the attention under the mode is unchanged."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return causal_lower_right(queries, keys)


def all_reduce(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """The functional ``all_reduce`` (no gradient), ``op`` "sum", "avg", "max", ..."""
    from torch.distributed._functional_collectives import all_reduce

    return all_reduce(tensor, op, group)


def all_gather_tensor(tensor: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """The functional all-gather (no gradient): every rank's ``tensor`` concatenated along ``gather_dim``, in rank
    order. ``all_gather_single`` from torch 2.13 (``all_gather_tensor``, the name before, warns there)."""
    import torch.distributed._functional_collectives as functional

    gather = getattr(functional, "all_gather_single", None) or functional.all_gather_tensor
    return gather(tensor, gather_dim, group)


def all_gather_tensor_autograd(tensor: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """The differentiable functional all-gather: backward reduce-scatters the gradient (a sum).
    ``all_gather_single_autograd`` from torch 2.13 (``all_gather_tensor_autograd`` before)."""
    import torch.distributed._functional_collectives as functional

    gather = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd
    return gather(tensor, gather_dim, group)


def c10d_functional_ops() -> Any:
    """``torch.ops._c10d_functional``: the functional collectives' ops."""
    return torch.ops._c10d_functional


# torch.distributed._composable


def composable_state_keys() -> tuple[str, str]:
    """``STATE_KEY`` and ``REGISTRY_KEY``: where composable APIs (``fully_shard``) keep state in a module's
    ``__dict__``."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

    return STATE_KEY, REGISTRY_KEY


# torch.distributed.checkpoint: _nested_dict, _traverse, _dedup_save_plans, state_dict, filesystem, utils


def flatten_state_dict(state_dict: Any) -> tuple[dict, dict]:
    """DCP's ``flatten_state_dict``: the nested state dict flat, and the mapping back."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)


def unflatten_state_dict(state_dict: Any, mapping: Any) -> dict:
    """DCP's ``unflatten_state_dict``: the inverse of :func:`flatten_state_dict`."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict(state_dict, mapping)


def set_element(root: Any, path: Any, value: Any) -> None:
    """DCP's ``set_element``: set ``value`` at ``path`` inside the nested ``root``."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def dedup_save_plans(plans: list) -> list:
    """DCP's ``dedup_save_plans``: each item written by one rank only."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    return dedup_save_plans(plans)


def get_fqns(model: torch.nn.Module, name: str) -> set[str]:
    """DCP's ``_get_fqns``: the state-dict names of ``model``'s parameter ``name``."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return _get_fqns(model, name)


def dcp_storage_info() -> type:
    """``filesystem._StorageInfo``: where a DCP item's bytes lie (``relative_path``, ``offset``, ``length``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def create_file_view(stream: Any, offset: int, length: int) -> Any:
    """DCP's ``_create_file_view``: ``length`` bytes of ``stream`` from ``offset``, as a stream."""
    from torch.distributed.checkpoint.utils import _create_file_view

    return _create_file_view(stream, offset, length)


def dcp_dist_wrapper() -> type:
    """``utils._DistWrapper``, DCP's collectives; the dry run patches it in place."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    return _DistWrapper


# torch.testing._internal


def fake_store_class() -> type:
    """``FakeStore``, the fake process group's store; the import registers the ``"fake"`` backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore
