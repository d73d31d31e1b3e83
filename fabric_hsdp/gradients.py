"""Gradient clipping over DTensor shards that live on different meshes.

Under tensor parallelism the parameters a plan splits are DTensors on the whole mesh ``(replicate, shard, tensor)``
and the others (norms) on its ``(replicate, shard)`` sub-mesh. DTensor refuses operations that mix meshes, so
``torch.nn.utils.clip_grad_norm_`` cannot take them together: here each mesh's gradients give one norm (DTensor
reduces it over that mesh), the norms combine into the total, and each group is scaled by the same coefficient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def clip_grad_norm(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
) -> Tensor:
    """Scale the gradients of ``parameters`` so that their total ``norm_type``-norm is at most ``max_norm``.

    Returns:
        The total norm before clipping, as a plain tensor (the same value on every rank).
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
