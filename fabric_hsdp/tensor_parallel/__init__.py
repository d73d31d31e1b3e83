"""Tensor parallelism as the third mesh dim: resolve the plan, check it against the model, apply it.

``HybridFSDPStrategy(tensor_parallel_size=T, tensor_parallel_plan=...)`` calls :func:`apply_tensor_parallel` on the
``tensor`` sub-mesh before activation checkpointing and ``fully_shard`` (torchtitan's order), so parameters end up
as DTensors on the whole mesh, e.g. ``(Replicate(), _StridedShard(0), Shard(0))`` for a column-wise weight.

A plan is ``"auto"`` (:mod:`fabric_hsdp.tensor_parallel.plans`), a dict of module-name patterns (``*`` matches one
name part, as in ``parallelize_module``) to a torch ``ParallelStyle``, a transformers style name or
:class:`FusedColwise`, or a callable ``(model, tensor_mesh) -> None`` that does everything itself (Lightning's
``parallelize_fn`` style). For the first two, every dim the plan splits is checked before anything changes: the
module, the dim and its size must divide by ``T``, and so must the model's head counts. DCP writes wrong data for a
tensor whose split dim does not divide, so this check is what stands between a user and a corrupt checkpoint.

Besides the split itself: tied weights stay one parameter (:mod:`.tied`); ``sequence_parallel`` and
``loss_parallel`` change the plan's layouts (:mod:`.sequence`); the fused rows' state dicts show the model's own order
(:mod:`.fused_rows`); dropout draws the same masks on the peers where they hold the same values and different ones
where not (:mod:`.randomness`, wired in by :func:`finish_tensor_parallel` once the model is sharded and materialised).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.models.fused_rows import ATTRIBUTE, FusedRows, fused_rows_of, held_row_order
from fabric_hsdp.models.tied import tied_groups
from fabric_hsdp.tensor_parallel.fused_rows import add_state_dict_hooks
from fabric_hsdp.tensor_parallel.loss import loss_parallel
from fabric_hsdp.tensor_parallel.plans import DICT_FORM, ModelPlan, auto_plan
from fabric_hsdp.tensor_parallel.randomness import seed_split_regions, split_regions, synchronize_random_state
from fabric_hsdp.tensor_parallel.sequence import with_levers
from fabric_hsdp.tensor_parallel.styles import FusedColwise, split_dim, to_style
from fabric_hsdp.tensor_parallel.tied import retie

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AppliedPlan",
    "FusedColwise",
    "FusedRows",
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "finish_tensor_parallel",
    "fused_rows_of",
    "loss_parallel",
    "held_row_order",
]

_logger = logging.getLogger(__name__)

TensorParallelPlan = str | dict[str, Any] | Callable[[nn.Module, Any], Any]


def validate_plan(plan: TensorParallelPlan) -> TensorParallelPlan:
    """Check the form of ``tensor_parallel_plan`` when the strategy is created."""
    if plan == "auto" or callable(plan):
        return plan
    if isinstance(plan, dict) and plan and all(isinstance(key, str) for key in plan):
        for key, value in plan.items():
            to_style(value, key)
        return dict(plan)
    raise ValueError(f"HybridFSDPStrategy(tensor_parallel_plan={plan!r}) is not valid. Pass 'auto', {DICT_FORM}.")


@dataclass
class AppliedPlan:
    """What :func:`apply_tensor_parallel` did that the later setup steps need."""

    split_regions: list[str] = field(default_factory=list)  # modules whose forward runs on split values


def validate_levers(sequence_parallel: bool, loss_parallel: bool, tensor_parallel_size: int) -> None:
    """Sequence and loss parallelism split over the tensor-parallel ranks: refuse them without any."""
    for name, on in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if on and tensor_parallel_size == 1:
            raise ValueError(
                f"HybridFSDPStrategy({name}=True) splits over the tensor-parallel ranks, but tensor_parallel_size is 1."
                f" Pass tensor_parallel_size=T > 1 (e.g. 2), or drop {name}."
            )


def apply_tensor_parallel(
    model: nn.Module,
    plan: TensorParallelPlan,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    largest_size: int | None = None,
) -> AppliedPlan:
    """Split ``model``'s layers over ``mesh`` (the 1-D tensor-parallel mesh) per ``plan``, in place.

    ``sequence_parallel``/``loss_parallel``: see :mod:`fabric_hsdp.tensor_parallel.sequence`. ``largest_size``: the
    largest tensor-parallel size the job's layout allows (its divisors are the sizes error messages may suggest).

    Raises:
        ValueError: a pattern matches no module, a style does not fit its module, a split dim or head count does
            not divide by the tensor-parallel size (the message names the module, the dim and its size, and the
            sizes that pass every check), or tied weights would be split differently.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    size = mesh.size()
    tied = tied_groups(model)
    if callable(plan):
        if sequence_parallel or loss_parallel:
            raise ValueError(
                "HybridFSDPStrategy(sequence_parallel=True / loss_parallel=True) changes the layouts of a plan, but"
                " tensor_parallel_plan is a callable, which applies its own. Apply them in the callable (torch's"
                " SequenceParallel, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)), or pass"
                " 'auto' or a dict plan."
            )
        plan(model, mesh)
        retie(model, tied)
        _check_even_splits(model, size)
        return AppliedPlan()
    model_plan = auto_plan(model) if plan == "auto" else ModelPlan(styles=plan)
    assignments = _assign(model, model_plan.styles)
    sizes = list(range(1, (largest_size or size) + 1))
    sizes = [d for d in sizes if (largest_size or size) % d == 0 and _passes(model_plan, assignments, d)]
    _check_heads(model, model_plan.heads, size, sizes)
    for name, module, style in assignments:
        _check_divisible(name, module, style, size, sizes)
    assignments = with_levers(
        model,
        assignments,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        split_embedding_output=model_plan.split_embedding_output,
    )
    for name, module, style in assignments:
        if isinstance(style, FusedColwise):
            fused = FusedRows(style.block_sizes(module.weight.shape[0]), size)
            _regroup_rows(module, fused)
            add_state_dict_hooks(module, fused)
            style = ColwiseParallel()  # the regrouped rows split like any column-wise layer
        # each rank splits its own copy (src_data_rank=None), as fully_shard does: no collective here
        parallelize_module(model, mesh, {name: style}, src_data_rank=None)
    retie(model, tied)
    if model_plan.local_head_counts is not None:
        model_plan.local_head_counts(model, size)
    _check_even_splits(model, size)
    info_on_rank_zero(
        _logger, "tensor parallel over %d ranks: %d modules split (%s)", size, len(assignments), _summary(assignments)
    )
    rowwise = [name for name, module, style in assignments if isinstance(style, RowwiseParallel)]
    rowwise = [name for name in rowwise if isinstance(model.get_submodule(name), nn.Linear)]
    return AppliedPlan(split_regions=split_regions(model, rowwise, sequence_parallel))


def finish_tensor_parallel(model: nn.Module, applied: AppliedPlan, mesh: DeviceMesh, device: torch.device) -> None:
    """After sharding and materialising: seed the split regions per rank, then give the tensor-parallel peers one
    random state (a collective). Registered after activation checkpointing's hooks, so a recomputed region draws
    the same masks as its forward did."""
    seed_split_regions(model, applied.split_regions, mesh.get_local_rank(), device)
    synchronize_random_state(mesh, device)


def _passes(model_plan: ModelPlan, assignments: list[tuple[str, nn.Module, Any]], size: int) -> bool:
    if any(count % size for count in model_plan.heads.values()):
        return False
    try:
        for name, module, style in assignments:
            _check_divisible(name, module, style, size, [])
    except ValueError:
        return False
    return True


def _assign(model: nn.Module, styles: dict[str, Any]) -> list[tuple[str, nn.Module, Any]]:
    """Each module a pattern matches, with its style, in model order; raises for patterns that match nothing."""
    modules = [(name, module) for name, module in model.named_modules() if name]
    assigned: dict[str, tuple[nn.Module, Any]] = {}
    for pattern, value in styles.items():
        style = to_style(value, pattern)
        parts = pattern.split(".")
        matched = [
            (name, module)
            for name, module in modules
            if len(name.split(".")) == len(parts) and all(map(fnmatch, name.split("."), parts))
        ]
        if not matched:
            examples = ", ".join(name for name, _ in modules[:6])
            raise ValueError(
                f"tensor_parallel_plan key {pattern!r} matches no module of {type(model).__name__} (its modules are"
                f" named like {examples}, ...)."
            )
        for name, module in matched:
            assigned[name] = (module, style)
    order = {name: index for index, (name, _) in enumerate(modules)}
    return [(name, module, style) for name, (module, style) in sorted(assigned.items(), key=lambda i: order[i[0]])]


_KEY_VALUE_HEADS = ("config.num_key_value_heads", "config.n_query_groups", "config.n_kv_heads")


def _check_heads(model: nn.Module, heads: dict[str, int], size: int, sizes: list[int]) -> None:
    for what, count in heads.items():
        if count % size == 0:
            continue
        fewer = (
            " Fewer key/value heads than tensor-parallel ranks (Megatron replicates them) is not supported."
            if what in _KEY_VALUE_HEADS and count < size
            else ""
        )
        raise ValueError(
            f"tensor_parallel_size({size}) does not divide {what}({count}) of {type(model).__name__}: each"
            f" tensor-parallel rank must hold whole attention heads.{fewer} Choose a tensor_parallel_size that passes"
            f" every check of this model and layout: {sizes}."
        )


def _check_divisible(name: str, module: nn.Module, style: Any, size: int, sizes: list[int]) -> None:
    kind = type(module).__name__
    if not isinstance(module, nn.Linear | nn.Embedding):
        if split_dim(style, kind) is None:
            return  # e.g. SequenceParallel on a norm
        raise ValueError(
            f"tensor_parallel_plan gives {name} ({kind}) the style {type(style).__name__}, which splits only"
            " nn.Linear and nn.Embedding layers. Pass a callable tensor_parallel_plan for other modules."
        )
    dim = split_dim(style, kind)
    if dim is None:
        return
    index, what = dim
    extent = module.weight.shape[index]
    if isinstance(style, FusedColwise):
        blocks = style.block_sizes(extent)
        units = style.block_heads or blocks
        names = style.block_names or tuple(f"block {i}" for i in range(len(blocks)))
        for block_name, unit_count in zip(names, units):
            if unit_count % size:
                raise ValueError(
                    f"tensor_parallel_size({size}) does not divide the {unit_count} {block_name} of {name}'s fused"
                    f" {what} ({extent} = {' + '.join(map(str, blocks))}). Choose a tensor_parallel_size that passes"
                    f" every check of this model and layout: {sizes}."
                )
        return
    if extent % size:
        raise ValueError(
            f"tensor_parallel_size({size}) does not divide {name}.{what}({extent}) ({kind}, split by"
            f" {type(style).__name__}). Choose a tensor_parallel_size that passes every check of this model and layout"
            f" ({sizes}), or leave {name} out of the plan."
        )


def _check_even_splits(model: nn.Module, size: int) -> None:
    """Every parameter split by tensor parallelism (whatever the plan) splits evenly: DCP writes wrong data for a
    tensor whose split dim does not divide by the mesh size (seen with torch 2.13), so such a plan is refused."""
    from torch.distributed.tensor import DTensor, Shard

    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        for placement in param.placements:
            if isinstance(placement, Shard) and param.shape[placement.dim] % size:
                raise ValueError(
                    f"tensor parallelism split {name} {list(param.shape)} along dim {placement.dim} into {size}"
                    f" parts, but {param.shape[placement.dim]} does not divide by {size}: its checkpoints would be"
                    f" written wrongly. Leave the module out of the plan, or choose a tensor_parallel_size that"
                    f" divides {param.shape[placement.dim]}."
                )


def _regroup_rows(module: nn.Linear, fused: FusedRows) -> None:
    """Reorder the rows of ``module``'s weight (and bias) by tensor-parallel rank, and mark the module."""
    order = fused.module_order()
    with torch.no_grad():
        for param_name, param in list(module.named_parameters(recurse=False)):
            regrouped = nn.Parameter(param.index_select(0, order.to(param.device)), requires_grad=param.requires_grad)
            module.register_parameter(param_name, regrouped)
    setattr(module, ATTRIBUTE, fused)


def _summary(assignments: list[tuple[str, nn.Module, Any]]) -> str:
    counts: dict[str, int] = {}
    for _, _, style in assignments:
        label = type(style).__name__
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{count} {label}" for label, count in counts.items())
