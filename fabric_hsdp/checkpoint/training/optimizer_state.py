"""A fresh optimizer's state allocated from a DCP checkpoint's metadata, so a load need not run a step first.

``get_optimizer_state_dict`` on an optimizer without state initialises it by running one ``step()`` with zero
gradients (``lr`` set to 0): that writes zeros over every state tensor, then does the whole update arithmetic on them
(``sqrt``, ``addcdiv`` over every parameter, and a zero gradient per parameter), only for the load to overwrite the
state. On the 125M benchmark it was 40 % of a cold load. The checkpoint already says which state each parameter has:
here each entry is allocated empty, shaped and sharded like its parameter (as ``torch.zeros_like(param)`` in the
optimizer's own initialisation) or as a scalar (``step``), and the load fills it. ``Optimizer.load_state_dict`` then
puts each entry on the device and in the dtype its optimizer wants, as after the zero step.

An optimizer whose saved state holds anything else (non-tensor entries, tensors of another shape than their
parameter's) keeps DCP's own initialisation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from fabric_hsdp.versions import get_fqns


def allocate_from_metadata(model: nn.Module, optimizer: Optimizer, key: str, metadata: Any) -> bool:
    """Give each parameter of ``optimizer`` the empty state tensors its entries under ``key`` in the DCP
    ``metadata`` need; return whether it did (``False``: the optimizer has state already, or the checkpoint holds an
    entry this cannot allocate; nothing was changed)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if optimizer.state:
        return False
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    saved: dict[str, dict[str, Any]] = {}  # parameter FQN -> state key -> its storage metadata
    for fqn, entry in metadata.state_dict_metadata.items():
        path = paths.get(fqn)
        if path is None or len(path) < 2 or path[0] != key or path[1] != "state":
            continue
        if len(path) != 4 or not isinstance(entry, TensorStorageMetadata):
            return False  # a nested or non-tensor state entry: DCP's own initialisation knows how to read it
        saved.setdefault(str(path[2]), {})[str(path[3])] = entry
    if not saved:
        return False
    names = {id(param): name for name, param in model.named_parameters()}
    allocated: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param))
            fqns = get_fqns(model, name) if name is not None else set()
            if len(fqns) != 1:
                return False
            entries = saved.get(next(iter(fqns)))
            if entries is None:
                continue  # no state saved for it (e.g. frozen at save time): it gets its state at its first step
            state: dict[str, torch.Tensor] = {}
            for state_key, entry in entries.items():
                if tuple(entry.size) == tuple(param.shape):
                    state[state_key] = torch.empty_like(param, requires_grad=False)
                elif len(entry.size) == 0:
                    state[state_key] = torch.zeros((), dtype=entry.properties.dtype)
                else:
                    return False
            allocated[param] = state
    if not allocated:
        return False
    for param, state in allocated.items():
        optimizer.state[param] = state
    return True
