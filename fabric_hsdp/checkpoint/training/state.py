"""A checkpoint state (``{"model": model, "optimizer": optimizer, "step": 3}``) sorted by kind.

Every way of saving or loading the strategy's state (sharded, full, raw plus extras) starts here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer


class StateParts(NamedTuple):
    """A checkpoint state sorted by kind: the one sharded model, the optimizers, and the plain values."""

    model_key: str
    model: nn.Module
    optimizers: dict[str, Optimizer]
    plain: dict[str, Any]


def state_parts(state: dict[str, Any]) -> StateParts:
    """Sort ``state`` into its parts; exactly one model set up by the strategy (holding DTensors) is required."""
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
    return StateParts(model_key, model, optimizers, plain)


def plain_values(plain: dict[str, Any]) -> dict[str, Any]:
    """The values to store for the plain entries of a state: ``state_dict()`` of stateful objects (schedulers)."""
    return {key: value.state_dict() if isinstance(value, _Stateful) else value for key, value in plain.items()}
