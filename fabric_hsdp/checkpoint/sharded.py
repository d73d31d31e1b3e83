"""Save and load the strategy's state: sharded DCP directories (default) and consolidated full files.

Layout of a sharded checkpoint (the same as Lightning's ``ModelParallelStrategy``, so each reads the other's): DCP
entries ``<model key>.<param>`` and ``<optimizer key>.*`` written by every rank in parallel, each replicated shard
once (DCP's planner dedups replicas), plus ``meta.pt`` with the plain values, written by rank 0. A save becomes
visible at its path only when complete (see :mod:`fabric_hsdp.checkpoint.commit`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint import background, commit, replica_split
from fabric_hsdp.checkpoint.sources import LazyTensor

_logger = logging.getLogger("fabric_hsdp")
META_FILE = "meta.pt"


def split_state(state: dict[str, Any]) -> tuple[str, nn.Module, dict[str, Optimizer], dict[str, Any]]:
    """``(model key, sharded model, optimizers by key, everything else)``; exactly one sharded model is required."""
    from torch.distributed.tensor import DTensor

    models = {
        key: value
        for key, value in state.items()
        if isinstance(value, nn.Module) and any(isinstance(p, DTensor) for p in value.parameters())
    }
    if len(models) != 1:
        found = "no model set up by the strategy" if not models else f"{len(models)} sharded models ({list(models)})"
        raise ValueError(
            f"The checkpoint state must hold exactly one model set up with fabric.setup_module; found {found}. Pass"
            " it as state={'model': model, 'optimizer': optimizer, ...}; save other models under other paths."
        )
    (model_key, model), *_ = models.items()
    optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
    plain = {key: value for key, value in state.items() if key not in models and key not in optimizers}
    return model_key, model, optimizers, plain


def _plain_values(plain: dict[str, Any]) -> dict[str, Any]:
    return {key: value.state_dict() if isinstance(value, _Stateful) else value for key, value in plain.items()}


def save_sharded(
    path: Path, state: dict[str, Any], broadcast: Callable[[Any], Any], background_group: Any = None
) -> background.BackgroundSave | None:
    """Every rank writes its shards into a staging sibling; rank 0 commits it to ``path`` once all have finished.

    With ``background_group`` (a gloo process group for DCP's own collectives) the shards are copied to CPU memory
    and written from a thread: the returned save is committed when done; ``wait()`` on it raises its failure.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_key, model, optimizers, plain = split_state(state)
    rank = dist.get_rank()
    staged = Path(broadcast(commit.staging_path(path)))
    started = time.monotonic()
    with fail_together(f"preparing to save checkpoint '{path}'"):
        if rank == 0:
            commit.remove_leftovers(path)
            staged.mkdir(parents=True)
            _save_meta(_plain_values(plain), staged / META_FILE)
    tensors: dict[str, Any] = {model_key: get_model_state_dict(model)}
    for key, optimizer in optimizers.items():
        tensors[key] = get_optimizer_state_dict(model, optimizer)
    try:
        if background_group is not None:
            with fail_together(f"copying the shards of checkpoint '{path}' to CPU memory"):
                copies = background.copy_to_cpu(tensors)
            return background.start(copies, staged, path, background_group, started)
        with fail_together(f"saving checkpoint '{path}'"):
            _save_dcp(tensors, staged, path)
        with fail_together(f"committing checkpoint '{path}'"):
            if rank == 0:
                commit.commit(staged, path)
    except BaseException:
        if rank == 0:
            commit.discard(staged)  # the previous checkpoint at `path` is untouched
        raise
    if rank == 0:
        background.log_throughput("saved", path, time.monotonic() - started)
    return None


def _save_dcp(tensors: dict[str, Any], staged: Path, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(staged)))
    except CheckpointException as error:
        raise background.save_error(error, path) from None


def _save_meta(values: dict[str, Any], file: Path) -> None:
    with open(file, "wb") as stream:
        torch.save(values, stream)
        stream.flush()
        os.fsync(stream.fileno())


def load_sharded(
    path: Path, state: dict[str, Any], strict: bool, weights_only: bool | None, split_mesh: Any = None
) -> dict[str, Any]:
    """Restore the model, optimizers and plain values of ``state`` in place from a DCP directory, on any topology.

    With ``split_mesh`` (the strategy's mesh), HSDP replicas each read a ``1/R`` part of their shards and
    all-gather the rest (:mod:`fabric_hsdp.checkpoint.replica_split`).

    Returns:
        What the checkpoint holds beyond what ``state`` asked for (Fabric's ``load`` semantics).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fabric_hsdp.checkpoint._dcp import SafeLoadPlanner, _SingleCopyReader, first_failure

    safe = weights_only is not False
    with fail_together(f"opening checkpoint '{path}'"):
        metadata = commit.check_complete_dcp(path, weights_only=safe)
        model_key, model, optimizers, plain = split_state(state)
        saved_keys = _top_level_keys(metadata)
        wanted = [model_key, *optimizers]
        missing = [key for key in wanted if key not in saved_keys]
        if missing:
            raise KeyError(
                f"checkpoint '{path}' has no entry {missing[0]!r} (it holds {sorted(saved_keys)}). Use the keys it was"
                " saved with, e.g. state={'model': model, 'optimizer': optimizer}."
            )
    started = time.monotonic()
    # one read of the model and every optimizer: DCP plans once and each rank reads each file once
    tensors: dict[str, Any] = {model_key: get_model_state_dict(model)}
    for key, optimizer in optimizers.items():
        tensors[key] = get_optimizer_state_dict(model, optimizer)
    targets, splits = replica_split.split_for_load(tensors, split_mesh) if split_mesh is not None else (tensors, [])
    planner = SafeLoadPlanner(allow_partial_load=not strict, weights_only=safe)
    try:
        dcp.load(targets, storage_reader=_SingleCopyReader(path, metadata), planner=planner)
    except CheckpointException as error:
        raise first_failure(error) from None  # e.g. SafeLoadPlanner's "pass weights_only=False"
    replica_split.gather_and_restore(splits, split_mesh)
    set_model_state_dict(model, targets[model_key], options=StateDictOptions(strict=strict))
    for key, optimizer in optimizers.items():
        set_optimizer_state_dict(model, optimizer, targets[key])
    meta_file = path / META_FILE
    meta = torch.load(meta_file, weights_only=safe) if meta_file.exists() else {}
    _validate_keys_for_strict_loading(plain.keys(), meta.keys(), strict=strict)
    _move_state_into(source=meta, destination=state, keys=set(plain))
    if dist.get_rank() == 0:
        background.log_throughput("loaded", path, time.monotonic() - started)
    return meta


def is_sharded_checkpoint(path: Path, model_key: str, *, weights_only: bool = True) -> bool:
    """A DCP directory (or a broken one) with ``model_key`` entries: loaded with resharding, not as a raw source."""
    from fabric_hsdp.checkpoint._dcp import read_metadata

    if not path.is_dir() or (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return False
    if not (path / ".metadata").is_file():
        return any(path.glob("*.distcp"))  # an interrupted save: load_sharded names what is missing
    try:
        metadata = read_metadata(path, weights_only=weights_only)
    except ValueError:
        return True  # load_sharded reports why its metadata cannot be read
    return model_key in _top_level_keys(metadata)


def _top_level_keys(metadata: Any) -> set[str]:
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {mapping[fqn][0] if fqn in mapping else fqn.split(".")[0] for fqn in metadata.state_dict_metadata}


def save_full(path: Path, state: dict[str, Any]) -> None:
    """Write one consolidated file from rank 0, gathering one tensor at a time (``.pth`` Fabric layout or safetensors).

    Rank 0 asks for each tensor by name; every rank then takes part in that one all-gather. Rank 0 thus holds the
    file it writes plus one full tensor; the others hold one full tensor at most.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from fabric_hsdp.checkpoint.writers import write_safetensors, write_torch_file

    model_key, model, optimizers, plain = split_state(state)
    if path.suffix == ".safetensors" and optimizers:
        raise ValueError(
            f"'{path}' is a safetensors file, which holds model tensors only, but the state has optimizer(s)"
            f" {list(optimizers)}. Save {{'model': model}} alone to .safetensors, or use a .pth path for the rest."
        )
    sharded: dict[str, torch.Tensor] = {}

    def lazy(name: str, tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        sharded[name] = tensor
        return LazyTensor(name, tensor.shape, tensor.dtype, lambda: _gather(name, sharded[name], request=True))

    model_tensors = {name: lazy(f"{model_key}.{name}", t) for name, t in get_model_state_dict(model).items()}
    extras: dict[str, Any] = {}
    for key, optimizer in optimizers.items():
        optimizer_state = get_optimizer_state_dict(model, optimizer)
        extras[key] = {
            "state": {
                fqn: {name: lazy(f"{key}.{fqn}.{name}", value) for name, value in entries.items()}
                for fqn, entries in optimizer_state["state"].items()
            },
            "param_groups": optimizer_state["param_groups"],
        }
    extras.update(_plain_values(plain))
    with fail_together(f"saving full checkpoint '{path}'"):
        if dist.get_rank() == 0:
            try:
                if path.suffix == ".safetensors":
                    write_safetensors(path, model_tensors, overwrite=True)
                else:
                    write_torch_file(path, model_tensors, extras=extras, model_key=model_key, overwrite=True)
            finally:
                _broadcast_name(None)  # releases the other ranks, also when writing failed
        else:
            while (name := _broadcast_name(None)) is not None:
                _gather(name, sharded[name], request=False)


def _broadcast_name(name: str | None) -> str | None:
    box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(name: str, tensor: torch.Tensor, request: bool) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if request:
        _broadcast_name(name)
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone() if request else tensor
