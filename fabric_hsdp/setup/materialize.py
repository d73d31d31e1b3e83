"""Meta-device init, and turning a sharded meta model into real local shards.

Under ``empty_init=True`` every *parameter* is moved to the meta device as soon as the module registers it, so
building a 70B model costs no memory and no init time. Buffers are left alone: they are small, and non-persistent
ones (RoPE ``inv_freq``, ``cos``/``sin`` caches) are computed in ``__init__`` from values that a meta tensor would
lose. After sharding, each rank allocates only its local shards on its own device and runs ``reset_parameters()``
of the modules that owned meta parameters, as Lightning does; transformers models get their own ``_init_weights``.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.fabric.utilities import rank_zero_warn
from torch import nn

from fabric_hsdp.adapters.init import initialize_adapters
from fabric_hsdp.models.transformers import pretrained_owners
from fabric_hsdp.versions import compute_local_shape_and_global_offset, module_buffers, module_parameters

if TYPE_CHECKING:
    from fabric_hsdp.topology import ParallelMesh

_META = torch.device("meta")


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within this context, parameters registered by any module land on the meta device; buffers stay real."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            # __init__ usually calls reset_parameters() right after this: on meta it costs nothing.
            module_parameters(module)[name] = nn.Parameter(param.to(_META), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _initialize(module: nn.Module, owners: list[nn.Module]) -> set[str]:
    """Initialise each owner as its model would; returns the classes that have no way to initialise themselves.

    A transformers ``PreTrainedModel`` initialises its submodules itself (``_init_weights``: normal(0,
    ``initializer_range``), zero padding rows, ones for norms), not with torch's ``reset_parameters()`` (Kaiming,
    normal(0, 1) embeddings): the model's own init is used for every submodule it contains, as ``from_config`` does.
    Elsewhere each owner's ``reset_parameters()``, else the root's ``_init_weights(submodule)``.
    """
    pretrained = pretrained_owners(module)
    hf_init = getattr(module, "_init_weights", None)
    uninitialized = set()
    for sub in owners:
        reset = getattr(sub, "reset_parameters", None)
        if id(sub) in pretrained:
            _init_like_transformers(pretrained[id(sub)], sub)
        elif callable(reset):
            reset()
        elif callable(hf_init):
            hf_init(sub)
        else:
            uninitialized.add(type(sub).__name__)
    initialize_adapters(module, owners)  # LoRA adapters: their library's init (peft: B = 0), not the model's
    return uninitialized


@torch.no_grad()
def _init_like_transformers(pretrained: nn.Module, sub: nn.Module) -> None:
    """``pretrained._init_weights(sub)``, with an embedding's padding row zeroed through the local shard.

    transformers zeroes ``weight[padding_idx]``, an index into a sharded DTensor's rows; here the rank whose local
    shard holds that row zeroes it.
    """
    padding_idx = sub.padding_idx if isinstance(sub, nn.Embedding) else None
    if padding_idx is not None:
        sub.padding_idx = None
    try:
        pretrained._init_weights(sub)
    finally:
        if padding_idx is not None:
            sub.padding_idx = padding_idx
    if padding_idx is not None:
        _zero_row(sub.weight, padding_idx)


def _zero_row(weight: torch.Tensor, row: int) -> None:
    """Zero row ``row`` of the full tensor ``weight`` (a DTensor: in the local shard, if this rank holds it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        weight.data[row].zero_()
        return
    local = weight.to_local()
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    if offset[0] <= row < offset[0] + shape[0]:
        local[row - offset[0]].zero_()


def make_replicas_identical(module: nn.Module, mesh: ParallelMesh) -> None:
    """Make every local shard equal on the ranks that should hold the same values: broadcast along each such dim.

    Replicas (``replicate``) must start from identical shards, and so must tensor-parallel peers for the parameters
    tensor parallelism does not split (norms), but ranks seeded differently (``seed_everything(seed + rank)``) build
    or initialise different weights, and neither FSDP2 nor tensor parallelism synchronises them. Each tensor is
    broadcast from index 0 along every dim it is replicated on (:meth:`ParallelMesh.replicated_dims`); costs one
    shard per rank and dim, once.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            for dim in mesh.replicated_dims(tensor):
                if mesh.size(dim) > 1:
                    dist.broadcast(local, group=mesh.group(dim), group_src=0)


def local_shards_on_cpu(module: nn.Module) -> bool:
    """Whether a parameter's local shard is in CPU memory: the device that decides how random init is seeded."""
    from torch.distributed.tensor import DTensor

    return any((p.to_local() if isinstance(p, DTensor) else p).device.type == "cpu" for p in module.parameters())


def has_meta_tensors(module: nn.Module, recurse: bool = True) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(recurse), module.buffers(recurse)))


def materialize_local_shards(module: nn.Module, device: torch.device, position_in_copy: int) -> None:
    """Allocate the meta parameters' local shards on ``device`` and initialise them with ``reset_parameters()``.

    Real buffers keep their values (``to_empty`` would replace them with uninitialised memory); only modules that
    owned meta tensors are re-initialised. On CUDA, DTensor's random ops give each shard its own part of one random
    stream. Local shards in CPU memory (a CPU run, or CPU offload on CUDA, whose mesh is still CUDA's) draw from each
    rank's own CPU generator, so every shard peer would draw the *same* numbers (each full parameter its first shard
    repeated): there each part of a model copy (``position_in_copy``: shard and
    tensor-parallel index) gets its own seed, derived from rank 0's; :func:`make_replicas_identical` then makes the
    copies of replicated values equal.
    """
    if not has_meta_tensors(module):
        return
    owners = [sub for sub in module.modules() if has_meta_tensors(sub, recurse=False)]
    saved_buffers = [
        (sub, name, buffer)
        for sub in module.modules()
        for name, buffer in module_buffers(sub).items()
        if buffer is not None and not buffer.is_meta
    ]
    # Called on the root so FSDP2 swaps its sharded parameters consistently.
    module.to_empty(device=device)
    for sub, name, buffer in saved_buffers:
        module_buffers(sub)[name] = buffer.to(device)
    if local_shards_on_cpu(module):
        seed = [torch.initial_seed()]
        dist.broadcast_object_list(seed, src=0)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
            torch.random.default_generator.manual_seed(seed[0] + 1 + position_in_copy)  # the CPU generator only
            uninitialized = _initialize(module, owners)
    else:
        uninitialized = _initialize(module, owners)
    if uninitialized:
        rank_zero_warn(
            "Parameter initialization incomplete: these modules hold parameters or buffers on the meta device but"
            f" define no reset_parameters(), so their local shards are uninitialised memory: {sorted(uninitialized)}."
            " Load weights into the model (fabric.load / fabric.load_raw) before training, or build it with"
            " fabric.init_module(empty_init=False)."
        )
