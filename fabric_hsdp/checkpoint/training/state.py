"""A checkpoint state (``{"model": model, "optimizer": optimizer, "step": 3}``) and the tensors a checkpoint stores.

Every way of saving or loading the strategy's state (sharded, full, the dry run's) works on one
:class:`CheckpointState`: it sorts the state by kind, finds the rows tensor parallelism regrouped once, assembles the
model's and optimizers' state dicts, applies Fabric's ``filter=`` and restores what a load read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from fabric_hsdp.checkpoint.core import boxes
from fabric_hsdp.models.fused_rows import FusedRows, fused_rows_of

Filter = dict[str, Callable[[str, Any], bool]]


class CheckpointState:
    """``state`` sorted by kind: the one sharded model, the optimizers and the plain values.

    Attributes:
        model_key: The key of the model in ``state``.
        model: The model set up by the strategy (holding DTensors).
        optimizers: The optimizers, by key.
        plain: Everything else (``step``, schedulers, ...), by key.
        fused_rows: The model's parameters whose rows tensor parallelism regrouped, by name (empty without them).
    """

    def __init__(self, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        models = {
            key: value
            for key, value in state.items()
            if isinstance(value, nn.Module) and any(isinstance(p, DTensor) for p in value.parameters())
        }
        if len(models) != 1:
            found = (
                "no model set up by the strategy" if not models else f"{len(models)} sharded models ({list(models)})"
            )
            raise ValueError(
                f"The checkpoint state must hold exactly one model set up with fabric.setup_module; found {found}. Pass"
                " it as state={'model': model, 'optimizer': optimizer, ...}; save other models under other paths."
            )
        (self.model_key, self.model), *_ = models.items()
        self.optimizers: dict[str, Optimizer] = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        self.plain = {k: v for k, v in state.items() if k not in models and k not in self.optimizers}
        self.fused_rows: dict[str, FusedRows] = fused_rows_of(self.model)

    def tensors(self, filter: Filter | None = None) -> dict[str, Any]:
        """The model's and each optimizer's state dict (torch's ``get_*_state_dict``, sharded as the model is), by
        key; with ``filter``, only the entries its function for that key keeps (Fabric's ``save(filter=)``).

        Call it within :func:`~fabric_hsdp.models.fused_rows.held_row_order`: regrouped rows stay as they
        are, and :meth:`stored` maps them.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        tensors: dict[str, Any] = {self.model_key: get_model_state_dict(self.model)}
        for key, optimizer in self.optimizers.items():
            tensors[key] = get_optimizer_state_dict(self.model, optimizer)
        kept = apply_filter(tensors, filter)
        if self.model_key not in kept:
            names = list(tensors[self.model_key])
            raise ValueError(
                f"fabric.save(filter={{{self.model_key!r}: ...}}) keeps none of the model's {len(names)} tensors"
                f" (named like {names[0]!r}), so the checkpoint would hold no model. Check the filter's condition: it"
                " is called with each such name and its tensor, and keeps those it returns True for."
            )
        return kept

    def stored(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], list[boxes.Replaced]]:
        """``tensors`` (from :meth:`tensors`) with regrouped rows presented in the model's own order, as
        :class:`~fabric_hsdp.checkpoint.core.boxes.StoredBoxes` sharing memory with them; and what was replaced."""
        if not self.fused_rows:
            return tensors, []
        return boxes.dcp_view(tensors, lambda param, tensor: boxes.regrouped_boxes(param, tensor, self.fused_rows))

    def restore(self, tensors: dict[str, Any], strict: bool) -> None:
        """Put ``tensors`` (the model's and optimizers' state dicts, as :meth:`tensors` gives them, filled from a
        checkpoint) into the model and optimizers (torch's ``set_*_state_dict``)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(self.model, tensors[self.model_key], options=StateDictOptions(strict=strict))
        for key, optimizer in self.optimizers.items():
            set_optimizer_state_dict(self.model, optimizer, tensors[key])

    def plain_values(self, filter: Filter | None = None) -> dict[str, Any]:
        """The plain entries as stored: ``state_dict()`` of stateful objects (schedulers), the rest as they are."""
        values = {
            key: value.state_dict() if isinstance(value, _Stateful) else value for key, value in self.plain.items()
        }
        return apply_filter(values, filter)


def apply_filter(entries: dict[str, Any], filter: Filter | None) -> dict[str, Any]:
    """``entries`` as Lightning's strategies apply ``fabric.save(filter=)`` (its own ``_apply_filter``): each dict entry
    that ``filter`` has a function for cut down to the items it keeps, dropped if none is kept."""
    from lightning.fabric.strategies.strategy import _apply_filter

    kept: dict[str, Any] = {}
    for key, value in entries.items():
        _apply_filter(key, filter or {}, value, kept)
    return kept
