"""Save and load the strategy's state as a sharded DCP directory, written and read by every rank in parallel.

Layout of a sharded checkpoint (the same as Lightning's ``ModelParallelStrategy``, so each reads the other's): DCP
entries ``<model key>.<param>`` and ``<optimizer key>.*`` written by every rank in parallel, each replicated shard
once (DCP's planner dedups replicas), plus ``meta.pt`` with the plain values, written by rank 0. A save becomes
visible at its path only when complete (see :mod:`fabric_hsdp.checkpoint.core.commit`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities import rank_zero_warn
from lightning.fabric.utilities.load import _move_state_into

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core import boxes, commit
from fabric_hsdp.checkpoint.core.dcp_errors import first_failure, save_error
from fabric_hsdp.checkpoint.core.dcp_planners import SafeLoadPlanner, SavePlanner
from fabric_hsdp.checkpoint.core.keys import KeyMatch, format_key_errors
from fabric_hsdp.checkpoint.core.mismatch import Configs, model_config
from fabric_hsdp.checkpoint.core.progress import log_throughput
from fabric_hsdp.checkpoint.formats.dcp_metadata import (
    META_FILE,
    check_complete,
    read_meta,
    read_metadata,
    top_level_keys,
)
from fabric_hsdp.checkpoint.formats.dcp_reader import OneCopyReader
from fabric_hsdp.checkpoint.training import background, optimizer_state, replica_split
from fabric_hsdp.checkpoint.training.state import CheckpointState, Filter
from fabric_hsdp.checkpoint.writers.direct_writer import DirectWriter
from fabric_hsdp.errors import CheckpointError


def save_sharded(
    path: Path,
    checkpoint: CheckpointState,
    broadcast: Callable[[Any], Any],
    background_saves: background.BackgroundSaves | None = None,
    filter: Filter | None = None,
) -> None:
    """Every rank writes its shards into a pending sibling; rank 0 commits it to ``path`` once all have finished.

    With ``background_saves`` the chunks this rank writes are copied to CPU memory (its stager's kept buffers) and
    written from a thread: that save is in flight in ``background_saves`` (committed when done; its ``wait()``
    raises its failure). ``filter``: Fabric's ``save(filter=)``, e.g. ``{"model": lambda name, value: "lora_" in
    name}`` for an adapter-only checkpoint.
    """
    tensors, _ = checkpoint.stored(checkpoint.tensors(filter))  # a filter that keeps no tensor fails before any file
    save = commit.PendingSave(path, broadcast, dist.get_rank())
    with fail_together(f"preparing to save checkpoint '{path}'"):
        save.create(lambda directory: save_meta(checkpoint.plain_values(filter), directory / META_FILE))
    try:
        with fail_together(f"checking that every rank sees the pending directory of checkpoint '{path}'"):
            save.check_shared(META_FILE)
        if background_saves is not None:
            background_saves.start(tensors, save)
            return
        with fail_together(f"saving checkpoint '{path}'"):
            write_shards(tensors, DirectWriter(save.directory), path)
        with fail_together(f"committing checkpoint '{path}'"):
            save.commit("saved")
    except BaseException:
        save.discard()  # the previous checkpoint at `path` is untouched
        raise


def write_shards(tensors: dict[str, Any], writer: Any, path: Path, *, no_dist: bool = False) -> None:
    """This rank's part of the sharded checkpoint ``path``: DCP writes ``tensors`` (from
    :meth:`CheckpointState.stored`) through ``writer`` (a pending directory's; the dry run's scratch one, alone with
    ``no_dist``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    try:
        dcp.save(tensors, storage_writer=writer, planner=SavePlanner(), no_dist=no_dist)
    except CheckpointException as error:
        raise save_error(error, path) from None


def save_meta(values: dict[str, Any], file: Path) -> None:
    """Write the plain values of a sharded checkpoint (``meta.pt``), flushed to disk."""
    with open(file, "wb") as stream:
        torch.save(values, stream)
        stream.flush()
        os.fsync(stream.fileno())


def load_sharded(
    path: Path,
    checkpoint: CheckpointState,
    state: dict[str, Any],
    strict: bool,
    weights_only: bool,
    split_mesh: Any = None,
    metadata: Any = None,
) -> dict[str, Any]:
    """Restore the model, optimizers and plain values of ``state`` (sorted as ``checkpoint``) in place from a DCP
    directory, on any topology.

    With ``split_mesh`` (the strategy's :class:`~fabric_hsdp.topology.ParallelMesh`), replicas each read a
    ``1/R`` part of their shards and all-gather the rest (:mod:`fabric_hsdp.checkpoint.training.replica_split`).

    Returns:
        What the checkpoint holds beyond what ``state`` asked for (Fabric's ``load`` semantics).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    with fail_together(f"opening checkpoint '{path}'"):
        metadata = check_complete(path, weights_only=weights_only, metadata=metadata)
        model_key, model, optimizers = checkpoint.model_key, checkpoint.model, checkpoint.optimizers
        saved_keys = top_level_keys(metadata)
        wanted = [model_key, *optimizers]
        missing = [key for key in wanted if key not in saved_keys]
        if missing:
            raise CheckpointError(
                f"checkpoint '{path}' has no entry {missing[0]!r} (it holds {sorted(saved_keys)}). Use the keys it was"
                " saved with, e.g. state={'model': model, 'optimizer': optimizer}."
            )
    started = time.monotonic()
    # one read of the model and every optimizer: DCP plans once and each rank reads each file once
    for key, optimizer in optimizers.items():
        optimizer_state.allocate_from_metadata(model, optimizer, key, metadata)  # else DCP runs a zero step first
    tensors = checkpoint.tensors()
    with fail_together(f"matching the model to checkpoint '{path}'"):
        _check_model_keys(path, metadata, model_key, tensors[model_key], strict, model_config(model))
    if split_mesh is not None:
        targets, replaced, splits = replica_split.replica_parts(tensors, split_mesh, checkpoint.fused_rows)
    else:
        (targets, replaced), splits = checkpoint.stored(tensors), []
    planner = SafeLoadPlanner(allow_partial_load=not strict, weights_only=weights_only)
    try:
        dcp.load(targets, storage_reader=OneCopyReader(path, metadata), planner=planner)
    except CheckpointException as error:
        raise first_failure(error) from None  # e.g. SafeLoadPlanner's "pass weights_only=False"
    replica_split.gather(splits, split_mesh)
    boxes.put_back(replaced)
    checkpoint.restore(targets, strict)
    meta = read_meta(path, weights_only=weights_only)
    _validate_keys_for_strict_loading(checkpoint.plain.keys(), meta.keys(), strict=strict)
    _move_state_into(source=meta, destination=state, keys=set(checkpoint.plain))
    if dist.get_rank() == 0:
        log_throughput("loaded", path, time.monotonic() - started)
    return meta


def _check_model_keys(
    path: Path, metadata: Any, model_key: str, model_state: dict[str, Any], strict: bool, config: dict | None
) -> None:
    """Name both sides when the checkpoint holds another model (DCP would say only "Missing key in checkpoint
    state_dict: model.model.embed_tokens.weight", with no path and no fix), and why; with ``strict=False`` only when
    no tensor fits at all: that load would change nothing and return as if it had resumed."""
    prefix = f"{model_key}."
    stored = {
        key[len(prefix) :]: (tuple(entry.size), entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    model = {key: value for key, value in model_state.items() if isinstance(value, torch.Tensor)}
    match = KeyMatch(
        mapping={key: key for key in model if key in stored},
        missing=[key for key in model if key not in stored],
        unexpected=[key for key in stored if key not in model],
    )
    fits = [key for key in match.mapping if tuple(model[key].shape) == stored[key][0]]
    also = " or pass strict=False to load the tensors both have" if fits else ""
    message = format_key_errors(
        match,
        model,
        stored,
        source_name=str(path),
        hint=f"Is it a checkpoint of this model (entry {model_key!r})? Resume from one{also}.",
        configs=Configs(model=config),
    )
    if message is not None and strict:
        raise CheckpointError(message)
    if message is not None and not fits:
        raise CheckpointError(
            f"No tensor of entry {model_key!r} in checkpoint '{path}' fits the model ({len(stored)} in the checkpoint,"
            f" {len(model)} in the model), so the load would change nothing. {message}"
        )
    if match.missing or match.unexpected:  # strict=False, as the raw loads say it
        unused = f"; {len(match.unexpected)} of it are not the model's (e.g. {match.unexpected[:3]})"
        rank_zero_warn(
            f"Loaded {len(fits)} of the model's {len(model)} tensors from '{path}' (strict=False):"
            f" {len(match.missing)} not in it keep their values (e.g. {match.missing[:3]})"
            f"{unused if match.unexpected else ''}."
        )


def find_sharded(path: Path, model_key: str, *, weights_only: bool) -> tuple[bool, Any]:
    """Whether ``path`` is loaded with resharding (a DCP directory with ``model_key`` entries, or a broken one), not
    as a raw source; and its DCP metadata when read here (:func:`load_sharded` then does not read it again)."""
    if not path.is_dir() or (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return False, None
    if not (path / ".metadata").is_file():
        return any(path.glob("*.distcp")), None  # an interrupted save: load_sharded names what is missing
    try:
        metadata = read_metadata(path, weights_only=weights_only)
    except CheckpointError:
        return True, None  # load_sharded reports why its metadata cannot be read
    return model_key in top_level_keys(metadata), metadata
