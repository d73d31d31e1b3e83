"""Fill a sharded model from any checkpoint source without a full copy per rank.

Load modes:

* ``"slice"`` (default): every rank opens the file lazily and reads only the elements of its own local shard of each
  tensor, straight into the shard, cast to the parameter's dtype. No collective traffic; the ranks of a node share the
  file's pages through the page cache.
* ``"turns"``: the local ranks of each node take turns, ``turn_size`` at a time; each opens the file, fills its shards
  and closes it before the next starts. For files that cannot be memory-mapped (legacy pickles, some network
  filesystems): peak memory is ``turn_size`` readers' worth per node.
* ``"rank0"``: only global rank 0 opens the file; each tensor goes out to every rank on its own (a broadcast) and
  every rank keeps the elements of its shard. For a file that exists on one machine only.

Tensors are read to CPU and only then copied to the rank's own device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core import watchdog
from fabric_hsdp.checkpoint.core.boxes import global_box, pieces_of
from fabric_hsdp.checkpoint.core.fileio import release_freed_memory
from fabric_hsdp.checkpoint.core.keys import KeyMapSpec, KeyMatch, format_key_errors, match_keys
from fabric_hsdp.checkpoint.core.mismatch import Configs, checkpoint_config, model_config
from fabric_hsdp.checkpoint.core.progress import Progress
from fabric_hsdp.checkpoint.formats.conversions import convert_for_model
from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.checkpoint.training import replica_split
from fabric_hsdp.checkpoint.training.load_names import load_names
from fabric_hsdp.errors import CheckpointError
from fabric_hsdp.logs import warning_on_rank_zero
from fabric_hsdp.models.fused_rows import FusedRows, fused_rows_of
from fabric_hsdp.models.tied import tied_names

_logger = logging.getLogger(__name__)
# Loads smaller than this show no progress.
_PROGRESS_MIN_BYTES = 256 << 20

LoadMode = Literal["slice", "turns", "rank0"]
LOAD_MODES = ("slice", "turns", "rank0")


@dataclass
class LoadResult:
    """What a raw load did: keys loaded, and (with ``strict=False``) what did not match."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def validate_load_mode(load_mode: str) -> str:
    if load_mode not in LOAD_MODES:
        raise ValueError(f"load_mode={load_mode!r} is not one of {LOAD_MODES}; see the loading guide for which to use.")
    return load_mode


def copy_local_part(full: torch.Tensor, target: torch.Tensor, fused: FusedRows | None) -> None:
    """Copy into ``target``'s local shard its elements of ``full`` (a whole tensor in the stored order)."""
    if full.dim() and fused is not None:  # in the order tensor parallelism regrouped the rows
        full = fused.to_module_order(full)
    local = _local(target)
    local.copy_((full[global_box(target).slices()] if full.dim() else full).view(local.shape))


def read_local(
    source: CheckpointSource,
    name: str,
    target: torch.Tensor,
    fused: FusedRows | None,
    rows: tuple[int, int] | None = None,
) -> None:
    """Fill ``target``'s local shard (its local ``rows`` only, when given) from tensor ``name`` of ``source``,
    reading only the elements it holds.

    A shard is one box of the stored tensor, or several when tensor parallelism regrouped its rows (``fused``).
    """
    local = _local(target)
    if not local.numel():
        return
    if local.ndim == 0:
        local.copy_(source.read(name))
        return
    for piece in pieces_of(target, fused, rows):
        part = local[piece.start : piece.stop]
        part.copy_(source.read_slice(name, piece.box(local.shape).slices()).view(part.shape))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def match_source_keys(
    source: CheckpointSource,
    targets: dict[str, torch.Tensor],
    key_map: KeyMapSpec,
    strict: bool,
    tied: dict[str, str] | None = None,
    optional: set[str] | frozenset[str] = frozenset(),
    configs: Configs | None = None,
) -> tuple[KeyMatch, list[str]]:
    """Match checkpoint keys to the model's; raise one error listing every problem when ``strict``, or when no tensor
    would be loaded at all (a load that changes nothing is never what was meant, ``strict=False`` or not).

    A model key is not missing when another name of the same tied tensor (``tied``) is loaded: that fills both, nor
    when it is ``optional`` (a LoRA adapter, which a base checkpoint does not hold). ``configs``: the model's and the
    checkpoint's, to say why they differ (another model, another config, an adapter-only checkpoint).
    """
    source_keys = source.keys()
    match = match_keys(source_keys, targets, key_map, tied)
    match.missing = [key for key in match.missing if key not in optional]
    model_infos = {name: TensorInfo(name, t.shape, t.dtype) for name, t in targets.items()}
    source_infos = {key: source.tensor_info(key) for key in source_keys}
    mismatched = [
        model_key
        for model_key, source_key in match.mapping.items()
        if tuple(source_infos[source_key].shape) != tuple(targets[model_key].shape)
    ]
    message = format_key_errors(match, model_infos, source_infos, source_name=str(source.path), configs=configs)
    if strict and message:
        raise CheckpointError(message)
    if message and len(mismatched) == len(match.mapping):
        raise CheckpointError(
            f"No tensor of checkpoint '{source.path}' fits the model ({len(source_keys)} in the checkpoint,"
            f" {len(targets)} in the model), so the load would change nothing. {message}"
        )
    if mismatched:
        message = format_key_errors(
            KeyMatch({k: match.mapping[k] for k in mismatched}, [], []),
            model_infos,
            source_infos,
            source_name=str(source.path),
            hint="strict=False: these are skipped.",
        )
        warning_on_rank_zero(_logger, "%s", message)
    return match, mismatched


def load_configs(path: Path, module: nn.Module | None) -> Configs:
    """The model's config and the one saved with the checkpoint at ``path``, to name why they differ."""
    saved = checkpoint_config(path)
    return Configs(
        model=None if module is None else model_config(module),
        checkpoint=None if saved is None else saved[0],
        checkpoint_file=None if saved is None else saved[1],
    )


@dataclass
class _Load:
    """One raw load: what to read, into which tensors, and how names and layouts map."""

    path: Path
    targets: dict[str, torch.Tensor]  # the model's state dict
    strict: bool
    key_map: KeyMapSpec
    weights_only: bool
    tied: dict[str, str]  # state-dict key -> the first key of the same tied tensor
    fused: dict[str, FusedRows]  # parameters whose rows tensor parallelism regrouped
    split_mesh: Any = None  # the mesh, when replicas split their reads
    splits: list[replica_split.Split] = field(default_factory=list)  # parts read, to all-gather after
    optional: set[str] = field(default_factory=set)  # targets a checkpoint may lack (LoRA adapters)
    module: nn.Module | None = None  # its family's conversion rules (MoE experts) apply to the source

    def open(self) -> CheckpointSource:
        source = open_checkpoint(self.path, weights_only=self.weights_only)
        try:
            return source if self.module is None else convert_for_model(source, self.module)
        except BaseException:
            source.close()
            raise

    def match(self, source: CheckpointSource) -> tuple[KeyMatch, list[str]]:
        configs = load_configs(self.path, self.module)
        return match_source_keys(source, self.targets, self.key_map, self.strict, self.tied, self.optional, configs)


def load_into_model(
    path: Path,
    module: nn.Module,
    *,
    strict: bool = True,
    key_map: KeyMapSpec = None,
    load_mode: str = "slice",
    turn_size: int = 1,
    weights_only: bool = True,
    local_rank: int = 0,
    ranks_per_node: int = 1,
    split_mesh: Any = None,
) -> LoadResult:
    """Load the model tensors of the checkpoint at ``path`` into ``module``'s shards (see the module docstring).

    With ``split_mesh`` (the strategy's :class:`~fabric_hsdp.topology.ParallelMesh`; ``"slice"`` and
    ``"turns"``), the ``R`` replicas of each shard read ``1/R`` of its rows each and all-gather the rest along
    ``replicate`` (:func:`fabric_hsdp.checkpoint.training.replica_split.raw_part`): the file is read once per replica
    group, not ``R`` times.
    """
    validate_load_mode(load_mode)
    # a LoRA model (peft, litgpt): base tensors by the base checkpoint's names, adapters optional
    names = load_names(module, module.state_dict(), tied_names(module), fused_rows_of(module), key_map)
    load = _Load(path, names.targets, strict, names.key_map, weights_only, names.tied, names.fused)
    load.split_mesh, load.optional, load.module = split_mesh, names.optional, module
    return names.model_result(_load_by_mode(load, load_mode, turn_size, local_rank, ranks_per_node))


def _load_by_mode(load: _Load, load_mode: str, turn_size: int, local_rank: int, ranks_per_node: int) -> LoadResult:
    path, split_mesh = load.path, load.split_mesh
    if load_mode == "rank0":
        return _load_from_rank0(load)
    if load_mode == "slice":
        with fail_together(f"loading '{path}'"):
            result = _load_slices(load)
        replica_split.gather(load.splits, split_mesh)
        return result
    turns = -(-ranks_per_node // max(1, turn_size))
    result = LoadResult()
    for turn in range(turns):
        with fail_together(f"loading '{path}' (turn {turn + 1} of {turns})"):
            if local_rank // max(1, turn_size) == turn:
                result = _load_slices(load)
                # glibc keeps what the reader freed in its heap; hand it back before the next turn starts, or a node
                # holds two readers' worth at once (measured by benchmarks/load_memory.py).
                release_freed_memory()
    replica_split.gather(load.splits, split_mesh)
    return result


def _progress(source: CheckpointSource, names: list[str], what: str) -> Progress:
    total = sum(source.tensor_info(name).nbytes for name in names)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Progress(total, what, enabled=rank == 0 and total >= _PROGRESS_MIN_BYTES)


def _load_slices(load: _Load) -> LoadResult:
    with (
        watchdog.doing_io("reading", str(load.path)),
        load.open() as source,
    ):
        match, mismatched = load.match(source)
        names = [k for k in match.mapping if k not in mismatched]
        bar = _progress(source, [match.mapping[k] for k in names], f"loading {load.path.name}")
        with bar, torch.no_grad():
            for model_key in names:
                target = load.targets[model_key]
                rows = None if load.split_mesh is None else replica_split.raw_part(target, load.split_mesh, load.splits)
                read_local(source, match.mapping[model_key], target, load.fused.get(model_key), rows)
                bar.update(source.tensor_info(match.mapping[model_key]).nbytes)
        return LoadResult(names, match.missing, match.unexpected, mismatched)


def _load_from_rank0(load: _Load) -> LoadResult:
    rank = dist.get_rank()
    source: CheckpointSource | None = None
    matched: list[Any] = [None]
    with fail_together(f"opening '{load.path}' on rank 0"):
        if rank == 0:
            source = load.open()
            matched = [load.match(source)]
    dist.broadcast_object_list(matched, src=0)
    match, mismatched = matched[0]
    names = [k for k in match.mapping if k not in mismatched]
    try:
        with torch.no_grad():
            for model_key in names:
                target = load.targets[model_key]
                local = _local(target)
                # one tensor at a time to every rank (a DTensor on a sub-mesh without rank 0 has no other source)
                if rank == 0:
                    full = source.read(match.mapping[model_key]).to(device=local.device, dtype=target.dtype)
                else:
                    full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
                dist.broadcast(full, src=0)
                copy_local_part(full, target, load.fused.get(model_key))
                del full
    finally:
        if source is not None:
            source.close()
    return LoadResult(names, match.missing, match.unexpected, mismatched)
