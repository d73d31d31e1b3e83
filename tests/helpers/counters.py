"""Counters of what a process does: checkpoint bytes it reads, aten ops it runs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ReadCounter:
    """Counts the tensor bytes this process reads from checkpoint files (every such read ends in fileio.readinto)."""

    def __init__(self) -> None:
        from fabric_hsdp.checkpoint.core import fileio

        self.bytes = 0
        readinto = fileio.readinto

        def counting_readinto(fd: int, target: torch.Tensor, offset: int, **kw: Any) -> None:
            self.bytes += target.nbytes
            readinto(fd, target, offset, **kw)

        fileio.readinto = counting_readinto


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while it is active (by overload packet name, e.g. ``mm``, ``silu``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
