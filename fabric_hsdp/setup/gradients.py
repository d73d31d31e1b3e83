"""Gradients: their synchronisation during accumulation, and clipping over DTensor shards on different meshes.

``fabric.no_backward_sync`` (:class:`ReplicaSyncControl`): between micro-batches only the all-reduce across replicas
waits; the reduce-scatter inside the shard group runs every micro-batch, so each rank accumulates sharded gradients.
Lightning's control for FSDP2 (``set_requires_gradient_sync(False)``) skips both, and each rank then holds unsharded
gradients of the whole model in ``reduce_dtype`` between micro-batches (4 bytes per parameter: 32 GB at 8B).
With ``keep_gathered_while_accumulating`` the units are also not resharded after those backwards, so the next
micro-batch's forward finds its parameters gathered (FSDP2's ``set_reshard_after_backward(False)``): the last
micro-batch's backward, outside the context, reshards them.

Clipping:
Under tensor parallelism the parameters a plan splits are DTensors on the whole mesh ``(replicate, shard, tensor)``
and the others (norms) on its ``(replicate, shard)`` sub-mesh. DTensor refuses operations that mix meshes, so
``torch.nn.utils.clip_grad_norm_`` cannot take them together: here each mesh's gradients give one norm (DTensor
reduces it over that mesh), the norms combine into the total, and each group is scaled by the same coefficient.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn


class ReplicaSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: skip the gradient all-reduce across replicas (the inter-node
    traffic under HSDP) while ``enabled``; the reduce-scatter into each rank's shard runs every micro-batch.
    ``keep_gathered``: the units also stay gathered after those backwards (one all-gather per optimizer step)."""

    def __init__(self, keep_gathered: bool = False) -> None:
        self.keep_gathered = keep_gathered

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return _replicas_not_reduced(module, self.keep_gathered) if enabled else nullcontext()


@contextmanager
def _replicas_not_reduced(module: nn.Module, keep_gathered: bool) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    units = [sub for sub in module.modules() if isinstance(sub, FSDPModule)]
    for unit in units:
        unit.set_requires_all_reduce(False, recurse=False)
        if keep_gathered:
            unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_all_reduce(True, recurse=False)
            if keep_gathered:
                unit.set_reshard_after_backward(True, recurse=False)


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
        # the non-finite check once, on the total: per group it would wait for the device once more per mesh
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
