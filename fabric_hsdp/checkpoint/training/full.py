"""Full checkpoints of the strategy's state: one ``.pth`` (Fabric's layout) or ``.safetensors`` file, saved from rank 0
and loaded into the shards by every rank.

Saving: rank 0 asks for one tensor at a time by name; every rank takes part in that one gather, and rank 0 streams
the tensor into the file (the writers of :mod:`fabric_hsdp.checkpoint.writers.full_files`). Rank 0 thus holds the
file's structure plus one full tensor; the others one full tensor at most. The file holds the model's own layout
whatever the mesh: rows that tensor parallelism regrouped (litgpt's ``qkv``) are written in the model's order.

Loading: the model's tensors through :func:`~fabric_hsdp.checkpoint.training.raw_load.load_into_model` (any format,
each rank reading its slices), then the optimizers, one tensor at a time, and the plain values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.core.tree import read_lazy
from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
from fabric_hsdp.checkpoint.training.raw_load import copy_local_part
from fabric_hsdp.checkpoint.training.state import CheckpointState, Filter
from fabric_hsdp.checkpoint.writers.full_files import write_safetensors, write_torch_file
from fabric_hsdp.errors import CheckpointError, write_error
from fabric_hsdp.models.fused_rows import FusedRows, fused_rows_of


def save_full(path: Path, checkpoint: CheckpointState, filter: Filter | None = None) -> None:
    """Write one consolidated file from rank 0, gathering one tensor at a time (``.pth`` Fabric layout or safetensors).

    Rank 0 asks for each tensor by name; every rank then takes part in that one all-gather. Rank 0 thus holds the
    file it writes plus one full tensor; the others hold one full tensor at most. ``filter``: Fabric's
    ``save(filter=)``.
    """
    model_key, optimizers, fused = checkpoint.model_key, checkpoint.optimizers, checkpoint.fused_rows
    if path.suffix == ".safetensors" and optimizers:
        raise ValueError(
            f"'{path}' is a safetensors file, which holds model tensors only, but the state has optimizer(s)"
            f" {list(optimizers)}. Save {{'model': model}} alone to .safetensors, or use a .pth path for the rest."
        )
    sharded: dict[str, tuple[torch.Tensor, FusedRows | None]] = {}

    def lazy(name: str, tensor: Any, param: str) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        sharded[name] = (tensor, fused.get(param) if tensor.ndim else None)
        return LazyTensor(name, tensor.shape, tensor.dtype, lambda: _gather(name, *sharded[name], request=True))

    tensors = checkpoint.tensors(filter)
    model_tensors = {name: lazy(f"{model_key}.{name}", t, name) for name, t in tensors.get(model_key, {}).items()}
    extras: dict[str, Any] = {}
    for key in optimizers:
        if key not in tensors:
            continue
        optimizer_state = tensors[key]
        extras[key] = {
            "state": {
                fqn: {name: lazy(f"{key}.{fqn}.{name}", value, fqn) for name, value in entries.items()}
                for fqn, entries in optimizer_state.get("state", {}).items()
            },
            **({"param_groups": optimizer_state["param_groups"]} if "param_groups" in optimizer_state else {}),
        }
    extras.update(checkpoint.plain_values(filter))
    with fail_together(f"saving full checkpoint '{path}'"):
        if dist.get_rank() == 0:
            try:
                if path.suffix == ".safetensors":
                    write_safetensors(path, model_tensors, overwrite=True)
                else:
                    write_torch_file(path, model_tensors, extras=extras, model_key=model_key, overwrite=True)
            except OSError as error:  # e.g. a full disk: fabric.save raises SaveError for every OSError
                raise write_error(path, error) from None
            finally:
                _broadcast_name(None)  # releases the other ranks, also when writing failed
        else:
            while (name := _broadcast_name(None)) is not None:
                _gather(name, *sharded[name], request=False)


def _broadcast_name(name: str | None) -> str | None:
    box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(name: str, tensor: torch.Tensor, fused: FusedRows | None, request: bool) -> torch.Tensor:
    """The full tensor ``name`` in the model's own layout (rows tensor parallelism regrouped put back in order)."""
    from torch.distributed.tensor import DTensor

    if request:
        _broadcast_name(name)
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if not request:
        return tensor
    tensor = tensor.detach().cpu()
    return fused.to_stored_order(tensor) if fused is not None else tensor.clone()


def load_optimizer_from_extras(
    module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], name: str
) -> None:
    """Restore a full (consolidated) optimizer state into the sharded optimizer, one tensor at a time.

    ``saved`` is the optimizer entry of a wrapped checkpoint (keyed by parameter name, as Fabric saves it, or by
    index, as ``optimizer.state_dict()`` is); its tensors may be lazy.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    current = get_optimizer_state_dict(module, optimizer)  # initialises the state, sharded like the parameters
    by_name = _state_by_name(saved, current, name)
    fused = fused_rows_of(module)
    with torch.no_grad():
        for fqn, entries in current["state"].items():
            if fqn not in by_name:
                raise CheckpointError(f"optimizer entry {name!r} of the checkpoint has no state for parameter {fqn!r}")
            for key, target in entries.items():
                value = by_name[fqn][key]
                value = value.read() if isinstance(value, LazyTensor) else value
                if not isinstance(target, torch.Tensor):
                    entries[key] = value
                    continue
                copy_local_part(value, target, fused.get(fqn))
    current["param_groups"] = [
        {**saved_group, "params": group["params"]}
        for saved_group, group in zip(saved["param_groups"], current["param_groups"])
    ]
    set_optimizer_state_dict(module, optimizer, current)


def _state_by_name(saved: dict[str, Any], current: dict[str, Any], name: str) -> dict[str, Any]:
    state = saved.get("state", {})
    if all(isinstance(key, str) for key in state):
        return state
    # A plain optimizer.state_dict(): parameters are numbered in param_groups order, like ours.
    names = [fqn for group in current["param_groups"] for fqn in group["params"]]
    numbers = [number for group in saved["param_groups"] for number in group["params"]]
    if len(names) != len(numbers):
        raise CheckpointError(
            f"optimizer entry {name!r} of the checkpoint has {len(numbers)} parameters, the optimizer {len(names)}"
        )
    return {fqn: state[number] for fqn, number in zip(names, numbers) if number in state}


def restore_extras(
    path: Path, checkpoint: CheckpointState, state: dict[str, Any], *, strict: bool, weights_only: bool
) -> dict[str, Any]:
    """After the model's tensors (``load_raw``): restore the optimizers from a wrapped full checkpoint and move the
    plain values ``state`` asks for into it; return the rest (Fabric's ``load`` semantics).

    Every rank reads the optimizer tensors it needs one at a time (a full tensor, then its own slice of it).
    """
    from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
    from lightning.fabric.utilities.load import _move_state_into

    plain_keys = set(checkpoint.plain)
    with open_checkpoint(path, weights_only=weights_only) as source:
        extras = source.extras(lazy=True)
        _validate_keys_for_strict_loading(set(checkpoint.optimizers) | plain_keys, extras.keys(), strict=strict)
        for key, optimizer in checkpoint.optimizers.items():
            if key in extras:
                load_optimizer_from_extras(checkpoint.model, optimizer, extras.pop(key), key)
        requested = {key: read_lazy(extras.pop(key)) for key in plain_keys if key in extras}
        _move_state_into(source=requested, destination=state, keys=set(requested))
        return read_lazy(extras)
