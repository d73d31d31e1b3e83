"""The row order checkpoints store for weights whose rows tensor parallelism regrouped.

litgpt's attention computes ``q``, ``k`` and ``v`` with one ``qkv`` linear layer whose rows are ``[all Q heads; all K
groups; all V groups]``. Under tensor parallelism the rows are regrouped in the module by rank, ``[Q_0; K_0; V_0; Q_1;
...]`` (:mod:`fabric_hsdp.tensor_parallel.fused_rows`), so an ordinary ``Shard(0)`` gives each rank its heads. The
parameter keeps its name and global shape; only the order of its rows differs from the stored one. Checkpoints always
hold the model's own order: :class:`FusedRows` maps rows between the two, :func:`fused_rows_of` finds the parameters
that need it, and inside :func:`held_row_order` state dicts hold the regrouped rows as they are, for the checkpoint
code to map shard by shard.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
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


_hooks_pass_through = [False]


@contextmanager
def held_row_order() -> Iterator[None]:
    """Within this context state dicts hold the regrouped rows as they are (this package's own checkpoint code maps
    them shard by shard, without the hooks' all-gather)."""
    previous = _hooks_pass_through[0]
    _hooks_pass_through[0] = True
    try:
        yield
    finally:
        _hooks_pass_through[0] = previous


def in_held_row_order() -> bool:
    """Whether :func:`held_row_order` is active (state-dict hooks then leave the rows as they are)."""
    return _hooks_pass_through[0]
