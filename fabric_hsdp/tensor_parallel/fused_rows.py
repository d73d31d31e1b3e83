"""Fused projections under tensor parallelism: the rows of one weight that hold several blocks, split block by block.

litgpt's attention computes ``q``, ``k`` and ``v`` with one ``qkv`` linear layer whose rows are ``[all Q heads; all K
groups; all V groups]`` (sizes differ under grouped-query attention). A contiguous row split would give the first
tensor-parallel rank all of Q and the last all of V. Each rank needs its own Q heads, K groups and V groups, so the
rows are regrouped *in the module* (and in the DTensor's global view) by rank: ``[Q_0; K_0; V_0; Q_1; K_1; V_1; ...]``,
and an ordinary ``Shard(0)`` gives each rank its heads; attention then runs on the local head counts.

The parameter keeps its name and global shape; only the order of its rows differs from the stored one. Checkpoints
always hold the model's own order (litgpt's ``[Q; K; V]``): this package's readers and writers map rows through
:class:`FusedRows` shard by shard (:func:`fused_rows_of` finds the parameters that need it, inside
:func:`module_layout`). Every other state-dict path sees the model's own order too: state-dict hooks on the fused
module (:func:`add_state_dict_hooks`) turn the parameter into a replicated DTensor in stored order for
``model.state_dict()``, ``get_model_state_dict(...)`` (sharded or ``full_state_dict=True``) and torch's DCP, and
regroup what ``load_state_dict``/``set_model_state_dict`` get. That costs one all-gather of the fused weight per
state-dict call (which a full export does anyway). Only ``param.full_tensor()`` taken directly from the parameter,
and optimizer state from ``get_optimizer_state_dict``, show the regrouped rows: map them with
``fused_rows_of(model)[name].to_stored_order(tensor)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The attribute the tensor-parallel style sets on a module whose parameters it regrouped.
ATTRIBUTE = "tensor_parallel_fused_rows"


@dataclass(frozen=True)
class FusedRows:
    """How a fused weight's rows are regrouped for ``parts`` tensor-parallel ranks.

    Attributes:
        blocks: Sizes of the stored blocks along dim 0, e.g. ``(n_head * head_size, n_query_groups * head_size,
            n_query_groups * head_size)`` for litgpt's ``qkv``. Each must divide by ``parts``.
        parts: The tensor-parallel size.
    """

    blocks: tuple[int, ...]
    parts: int

    def __post_init__(self) -> None:
        bad = [size for size in self.blocks if size % self.parts]
        if bad:
            raise ValueError(f"fused blocks {list(self.blocks)} do not all divide into {self.parts} parts: {bad}")

    @property
    def rows(self) -> int:
        return sum(self.blocks)

    def runs(self) -> list[tuple[int, int, int]]:
        """``(module row, stored row, length)`` of every contiguous piece, in the module's row order."""
        starts = list(itertools.accumulate(self.blocks, initial=0))
        runs, module_row = [], 0
        for part in range(self.parts):
            for start, size in zip(starts, self.blocks):
                piece = size // self.parts
                runs.append((module_row, start + part * piece, piece))
                module_row += piece
        return runs

    def module_order(self) -> torch.Tensor:
        """Row index ``i`` such that ``module_tensor = stored_tensor[i]``."""
        return torch.cat([torch.arange(stored, stored + length) for _, stored, length in self.runs()])

    def to_module_order(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.index_select(0, self.module_order().to(stored.device))

    def to_stored_order(self, module_tensor: torch.Tensor) -> torch.Tensor:
        return module_tensor.index_select(0, torch.argsort(self.module_order()).to(module_tensor.device))

    def stored_pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The module's rows ``[start, stop)`` as ``(offset from start, stored row, length)`` pieces, in order."""
        pieces = []
        for module_row, stored_row, length in self.runs():
            low, high = max(start, module_row), min(stop, module_row + length)
            if low < high:
                pieces.append((low - start, stored_row + low - module_row, high - low))
        return pieces


def fused_rows_of(model: nn.Module) -> dict[str, FusedRows]:
    """Every parameter of ``model`` whose rows tensor parallelism regrouped, by name (as in ``state_dict``)."""
    found = {}
    for module_name, module in model.named_modules():
        fused = getattr(module, ATTRIBUTE, None)
        if fused is None:
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.shape[0] == fused.rows:
                found[f"{module_name}.{param_name}" if module_name else param_name] = fused
    return found


_hooks_pass_through = [False]


@contextmanager
def module_layout() -> Iterator[None]:
    """Within this context state dicts hold the regrouped rows as they are (this package's own checkpoint code maps
    them shard by shard, without the hooks' all-gather)."""
    previous = _hooks_pass_through[0]
    _hooks_pass_through[0] = True
    try:
        yield
    finally:
        _hooks_pass_through[0] = previous


def add_state_dict_hooks(module: nn.Module, fused: FusedRows) -> None:
    """Make ``module``'s state dict hold its fused parameters in the stored order, and its loads take that order."""

    def keys(prefix: str, state_dict: dict[str, Any]) -> Iterator[str]:
        for name in module._parameters:
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == fused.rows:
                yield key

    def to_stored(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        if _hooks_pass_through[0]:
            return
        for key in list(keys(prefix, state_dict)):
            value = state_dict[key].detach()
            if isinstance(value, DTensor):
                stored = fused.to_stored_order(value.full_tensor())
                replicated = [Replicate()] * value.device_mesh.ndim
                state_dict[key] = DTensor.from_local(stored, value.device_mesh, replicated, run_check=False)
            else:
                state_dict[key] = fused.to_stored_order(value)

    def to_module(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if _hooks_pass_through[0]:
            return
        for key in list(keys(prefix, state_dict)):
            value, param = state_dict[key], module._parameters[key[len(prefix) :]]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            regrouped = fused.to_module_order(full.to(param.device))
            if isinstance(param, DTensor):
                regrouped = distribute_tensor(regrouped, param.device_mesh, param.placements, src_data_rank=None)
            state_dict[key] = regrouped

    module._register_state_dict_hook(to_stored)
    module._register_load_state_dict_pre_hook(to_module)
