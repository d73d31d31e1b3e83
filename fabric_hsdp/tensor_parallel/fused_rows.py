"""Fused projections under tensor parallelism: the rows of one weight that hold several blocks, split block by block.

litgpt's attention computes ``q``, ``k`` and ``v`` with one ``qkv`` linear layer whose rows are ``[all Q heads; all K
groups; all V groups]`` (sizes differ under grouped-query attention). A contiguous row split would give the first
tensor-parallel rank all of Q and the last all of V. Each rank needs its own Q heads, K groups and V groups, so the
rows are regrouped *in the module* (and in the DTensor's global view) by rank: ``[Q_0; K_0; V_0; Q_1; K_1; V_1; ...]``,
and an ordinary ``Shard(0)`` gives each rank its heads; attention then runs on the local head counts.

The parameter keeps its name and global shape; only the order of its rows differs from the stored one. Checkpoints
always hold the model's own order (litgpt's ``[Q; K; V]``): every reader and writer maps rows through
:class:`FusedRows`, and :func:`fused_rows_of` finds the parameters that need it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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
