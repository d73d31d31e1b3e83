"""Fused projections under tensor parallelism: the rows of one weight that hold several blocks, split block by block.

A contiguous row split of litgpt's ``qkv`` (rows ``[all Q heads; all K groups; all V groups]``) would give the first
tensor-parallel rank all of Q and the last all of V. Each rank needs its own Q heads, K groups and V groups, so the
rows are regrouped *in the module* (and in the DTensor's global view) by rank: ``[Q_0; K_0; V_0; Q_1; K_1; V_1; ...]``,
and an ordinary ``Shard(0)`` gives each rank its heads; attention then runs on the local head counts.

Checkpoints always hold the model's own order (litgpt's ``[Q; K; V]``): the checkpoint code maps rows through
:class:`~fabric_hsdp.models.fused_rows.FusedRows` shard by shard. Every other state-dict path sees the
model's own order too: state-dict hooks on the fused module (:func:`add_state_dict_hooks`) turn the parameter into a
replicated DTensor in stored order for ``model.state_dict()``, ``get_model_state_dict(...)`` and torch's DCP, and
regroup what ``load_state_dict``/``set_model_state_dict`` get. That costs one all-gather of the fused weight per
state-dict call (which a full export does anyway). Only ``param.full_tensor()`` taken directly from the parameter,
and optimizer state from ``get_optimizer_state_dict``, show the regrouped rows: map them with
``fused_rows_of(model)[name].to_stored_order(tensor)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fabric_hsdp.models.fused_rows import FusedRows, in_held_row_order
from fabric_hsdp.versions import module_parameters, register_load_state_dict_pre_hook, register_state_dict_hook


def add_state_dict_hooks(module: nn.Module, fused: FusedRows) -> None:
    """Make ``module``'s state dict hold its fused parameters in the stored order, and its loads take that order."""

    def keys(prefix: str, state_dict: dict[str, Any]) -> Iterator[str]:
        for name in module_parameters(module):
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == fused.rows:
                yield key

    def to_stored(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        if in_held_row_order():
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

        if in_held_row_order():
            return
        for key in list(keys(prefix, state_dict)):
            value, param = state_dict[key], module_parameters(module)[key[len(prefix) :]]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            regrouped = fused.to_module_order(full.to(param.device))
            if isinstance(param, DTensor):
                regrouped = distribute_tensor(regrouped, param.device_mesh, param.placements, src_data_rank=None)
            state_dict[key] = regrouped

    register_state_dict_hook(module, to_stored)
    register_load_state_dict_pre_hook(module, to_module)
