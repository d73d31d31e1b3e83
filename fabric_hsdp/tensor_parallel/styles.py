"""What a plan entry may say: a torch ``ParallelStyle``, one of transformers' style names, or a fused projection.

transformers' own tensor-parallel classes hook ``forward`` themselves and cannot be passed to ``parallelize_module``,
so their names are translated into torch's styles here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class FusedColwise:
    """Column-wise parallel for a linear layer whose rows stack several projections (litgpt's ``qkv``, ``gate_up``).

    Each block of rows is split across the tensor-parallel ranks on its own (see
    :mod:`fabric_hsdp.tensor_parallel.fused_rows`), so every rank computes its part of every projection.

    Attributes:
        blocks: Sizes of the stacked blocks along the output dim, e.g. ``(n_head * head_size, n_kv * head_size,
            n_kv * head_size)``; ``None``: ``parts`` equal blocks.
        parts: How many equal blocks when ``blocks`` is ``None``.
        block_names: What the blocks hold, for error messages (e.g. ``("query heads", "key groups", ...)``).
        block_heads: Each block's size in whole units that must not be split (heads), for error messages.
    """

    blocks: tuple[int, ...] | None = None
    parts: int = 2
    block_names: tuple[str, ...] | None = None
    block_heads: tuple[int, ...] | None = None

    def block_sizes(self, rows: int) -> tuple[int, ...]:
        if self.blocks is not None:
            return self.blocks
        return (rows // self.parts,) * self.parts


class SequenceParallelNorm(SequenceParallel):
    """``SequenceParallel`` on a norm in front of column-wise layers: computes on its sequence shard, then
    all-gathers the normalised sequence once (a replicated DTensor, so the backward is one reduce-scatter of the
    layers' partial gradients), where torchtitan's plan has ``PrepareModuleInput(Shard(1) -> Replicate())`` on the
    attention and MLP modules. Also takes the module's positional and keyword arguments as they come."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_module_fn,
            partial(self._prepare_input_fn, self.sequence_sharding),
            _gather_sequence,
        )


def _gather_sequence(module: nn.Module, output: DTensor, device_mesh: DeviceMesh) -> DTensor:
    return output.redistribute(placements=[Replicate()])


class SplitSequence(ParallelStyle):
    """Gives a module its rank's part of the sequence (dim 1) of its first argument, a full sequence on every rank.

    For models whose code between the embedding and the first layer reads the sequence length from the embedding's
    output (transformers' positions and masks): the embedding's output stays whole and the first layer splits it;
    the backward all-gathers the gradient.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parts: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

        def split(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if parts.get(id(args[0])) is args[0]:  # activation checkpointing recomputes from the split input
                return None
            whole = DTensor.from_local(args[0], device_mesh, [Replicate()], run_check=False)
            part = whole.redistribute(placements=[Shard(1)]).to_local().clone(memory_format=torch.contiguous_format)
            parts[id(part)] = part
            return (part, *args[1:]), kwargs

        # run eagerly under compile=True (the first layer's hooks are inside its compiled call): traced, the weak
        # dictionary broke that layer's graph and recompiled it per model on its keys; the contiguous copy keeps the
        # layer's input strides those of the other layers' inputs (a stride recompile otherwise)
        module.register_forward_pre_hook(torch.compiler.disable(split), with_kwargs=True)
        return module


def _colwise_gathered() -> ParallelStyle:
    return ColwiseParallel(output_layouts=Replicate())


def _rowwise_replicated_input() -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate())


# transformers' names (``config.base_model_tp_plan``, ``model._tp_plan``) -> torch's styles
STYLE_NAMES: dict[str, Callable[[], Any]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": _colwise_gathered,
    "colwise_gather_output": _colwise_gathered,
    "rowwise_rep": _rowwise_replicated_input,
    "rowwise_split_input": _rowwise_replicated_input,
    "embedding_rowwise": _rowwise_replicated_input,
    "sequence_parallel": SequenceParallel,
    "packed_colwise": FusedColwise,
}


def to_style(value: Any, key: str) -> ParallelStyle | FusedColwise:
    """The style a plan entry names; raises naming the entry and the accepted values otherwise."""
    if isinstance(value, ParallelStyle | FusedColwise):
        return value
    if isinstance(value, str) and value in STYLE_NAMES:
        return STYLE_NAMES[value]()
    raise ValueError(
        f"tensor_parallel_plan[{key!r}] = {value!r} is not a tensor-parallel style. Use a torch ParallelStyle (e.g."
        f" ColwiseParallel()), fabric_hsdp.tensor_parallel.FusedColwise(...), or one of {sorted(STYLE_NAMES)}; for"
        " anything else pass a callable (model, tensor_mesh) -> None as tensor_parallel_plan."
    )


def split_dim(style: ParallelStyle | FusedColwise, module_type: str) -> tuple[int, str] | None:
    """Which dim of the module's weight the style splits, and what that dim is, for divisibility checks."""
    if isinstance(style, SequenceParallel):
        return None
    rowwise = isinstance(style, RowwiseParallel)
    if module_type == "Embedding":  # weight [num_embeddings, embedding_dim]
        return (0, "num_embeddings") if rowwise else (1, "embedding_dim")
    return (1, "in_features") if rowwise else (0, "out_features")  # Linear weight [out_features, in_features]
