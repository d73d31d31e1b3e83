"""Consolidated exports of the strategy's state: one ``.pth`` (Fabric's layout) or ``.safetensors`` file from rank 0.

Rank 0 asks for one tensor at a time by name; every rank takes part in that one gather, and rank 0 streams the tensor
into the file (the writers of :mod:`fabric_hsdp.checkpoint.writers.full_files`). Rank 0 thus holds the file's
structure plus one full tensor; the others one full tensor at most. The file holds the model's own layout whatever
the mesh: rows that tensor parallelism regrouped (litgpt's ``qkv``) are written in the model's order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.training.state import CheckpointState, Filter
from fabric_hsdp.checkpoint.writers.full_files import write_safetensors, write_torch_file
from fabric_hsdp.errors import write_error
from fabric_hsdp.models.fused_rows import FusedRows


def save_full(path: Path, state: dict[str, Any], filter: Filter | None = None) -> None:
    """Write one consolidated file from rank 0, gathering one tensor at a time (``.pth`` Fabric layout or safetensors).

    Rank 0 asks for each tensor by name; every rank then takes part in that one all-gather. Rank 0 thus holds the
    file it writes plus one full tensor; the others hold one full tensor at most. ``filter``: Fabric's
    ``save(filter=)``.
    """
    checkpoint = CheckpointState(state)
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
