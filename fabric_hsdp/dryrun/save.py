"""A save in a dry run: this rank's DCP files go to a scratch directory; nothing is committed at the script's path.

A sharded save's commit needs every rank's files (rank 0 renames the pending directory once all have written), and
the other ranks' files do not exist in a dry run: the commit is skipped, and the report says so. What this rank
writes here is all of its shards; in the real save DCP's planner spreads the writes of a chunk held by ``k`` ranks
(replicas, or tensor-parallel peers of an unsplit tensor) over those ``k``, so the report also gives this rank's
expected share.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fabric_hsdp.checkpoint.training.state import Filter
    from fabric_hsdp.topology import ParallelMesh


@dataclass
class SaveRecord:
    """One ``fabric.save`` in the dry run: where the script asked, what this rank wrote where, and its share."""

    path: str
    kind: str
    written: int = 0
    expected_share: int = 0
    files: list[str] = field(default_factory=list)
    scratch: str = ""
    by_dry_run: bool = False


def save_this_rank(
    strategy: Any, path: Path, state: dict[str, Any], scratch: Path, rank: int, filter: Filter | None = None
) -> SaveRecord:
    """Write ``rank``'s part of the sharded checkpoint ``path`` of ``state`` under ``scratch``; return the record.
    ``filter``: the script's ``fabric.save(filter=)`` (an adapter-only save writes the adapters only, as it would)."""
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.wrappers import _unwrap_objects

    from fabric_hsdp.checkpoint.formats.dcp_metadata import META_FILE
    from fabric_hsdp.checkpoint.training.sharded import save_meta, write_shards
    from fabric_hsdp.checkpoint.training.state import CheckpointState
    from fabric_hsdp.models.fused_rows import held_row_order

    state = _unwrap_objects(state)
    if strategy._checkpoints.state_dict_type == "full" or path.suffix == ".safetensors":
        return full_save_record(path, state, rank, filter)
    checkpoint = CheckpointState(state)
    target = scratch / f"{path.name or 'checkpoint'}.rank{rank}"
    target.mkdir(parents=True, exist_ok=True)
    with held_row_order():  # as the strategy's save: the checkpoint code maps TP's regrouped rows shard by shard
        tensors = checkpoint.tensors(filter)
    share = _expected_share(tensors, strategy.parallel_mesh)
    if rank == 0:  # rank 0 writes the plain values beside the shards
        save_meta(checkpoint.plain_values(filter), target / META_FILE)
        share += (target / META_FILE).stat().st_size
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is, on purpose
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        write_shards(checkpoint.stored(tensors)[0], dcp.FileSystemWriter(str(target)), path, no_dist=True)
    (target / ".metadata").unlink(missing_ok=True)  # the coordinator's index of every rank's files: not ours
    files = sorted(file for file in target.iterdir() if file.is_file())
    return SaveRecord(
        path=str(path),
        kind="sharded",
        written=sum(file.stat().st_size for file in files),
        expected_share=share,
        files=[file.name for file in files],
        scratch=str(target),
    )


def full_save_record(path: Path, state: dict[str, Any], rank: int, filter: Filter | None = None) -> SaveRecord:
    """A consolidated save: rank 0 would gather and write every model tensor ``filter`` keeps; nothing is written in
    a dry run."""
    from lightning.fabric.wrappers import _unwrap_objects

    from fabric_hsdp.checkpoint.training.state import CheckpointState

    checkpoint = CheckpointState(_unwrap_objects(state))
    model = checkpoint.tensors(filter)[checkpoint.model_key]  # DTensors: numel() counts the whole tensor
    total = sum(tensor.numel() * tensor.element_size() for tensor in model.values() if isinstance(tensor, torch.Tensor))
    return SaveRecord(path=str(path), kind="full", expected_share=total if rank == 0 else 0)


def _expected_share(tree: Any, mesh: ParallelMesh) -> int:
    """Bytes this rank writes once DCP spreads each chunk's writes over the ranks holding it."""
    from fabric_hsdp.checkpoint.core.tree import tree_leaves

    return sum(_tensor_share(leaf, mesh) for _, leaf in tree_leaves(tree, torch.Tensor))


def _tensor_share(tensor: torch.Tensor, mesh: ParallelMesh) -> int:
    """This rank's share of writing ``tensor``'s local part: the ranks holding the same values (along every dim of
    the job's mesh it is replicated on, e.g. both tensor-parallel peers of a norm the plan leaves whole) split it."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # a plain tensor: the same on every rank
    holders = math.prod(mesh.size(dim) for dim in mesh.replicated_dims(tensor))
    return local.numel() * local.element_size() // holders
