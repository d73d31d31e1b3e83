"""FSDP2's "returned a view tensor" warning, hidden for the one output known to be harmless: TP's local logits.

FSDP2 warns when a sharded module returns a view that requires grad: an in-place op on it (``x += y``) would drop the
pre-backward hook silently and skip the all-gather. Under tensor parallelism the output head's style ends with
``DTensor.to_local()``, whose result is a view of the logits, so every TP run printed the warning once per rank. For
that view it is harmless: autograd refuses any in-place op on the output of ``_ToTorchTensor`` ("Output 0 of
_ToTorchTensor is a view and is being modified inplace ..."), so the hook cannot be dropped silently.

:func:`hide_harmless_view_warning` checks the output of every FSDP module (the head is one, often grouped with the
final norm) after its forward, just before FSDP2's post-forward hook runs: when every view in it is such an output,
that hook runs with a filter for this one message; any other view (e.g. ``x.view(...)`` returned by a layer or the
model itself) leaves the warning shown. A forward hook the user registered on such a module before ``setup_module``
runs between the check and FSDP2's hook: a view it makes is not checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fabric_hsdp import versions

_MESSAGE = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def hide_harmless_view_warning(root: nn.Module) -> None:
    """Register the check on each FSDP module of ``root`` (after ``fully_shard``: around FSDP2's post-forward hook)."""
    from torch.distributed.fsdp import FSDPModule

    filtered: list[Any] = []

    def before_fsdp(module: nn.Module, args: Any, output: Any) -> None:
        views = [tensor for tensor in _tensors(output) if tensor.requires_grad and tensor._base is not None]
        if views and all(map(is_local_logits, views)):
            context = warnings.catch_warnings()
            context.__enter__()
            warnings.filterwarnings("ignore", message=_MESSAGE, category=UserWarning)
            filtered.append(context)

    def after_fsdp(module: nn.Module, args: Any, output: Any) -> None:
        if filtered:
            filtered.pop().__exit__(None, None, None)

    for module in root.modules():
        if isinstance(module, FSDPModule):
            _register_before_fsdp(module, before_fsdp)
            module.register_forward_hook(after_fsdp, always_call=True)


def _register_before_fsdp(module: nn.Module, hook: Any) -> None:
    """Register ``hook`` to run just before FSDP2's post-forward hook of ``module`` (after TP's output hook, whose
    ``to_local()`` makes the view: it was registered before ``fully_shard``); not at all if none is found."""
    hooks = versions.forward_hooks(module)
    names = {key: getattr(function, "__qualname__", "") for key, function in hooks.items()}
    fsdp = [key for key, name in names.items() if name.endswith(("._post_forward", ".wrapped_post_hook"))]
    if not fsdp:
        return
    module.register_forward_hook(hook)
    keys = list(names)
    for key in keys[keys.index(fsdp[0]) :]:  # FSDP2's and those after it: now after ours
        hooks.move_to_end(key)


def is_local_logits(tensor: torch.Tensor) -> bool:
    """``tensor`` is the output of ``DTensor.to_local()``: a view autograd forbids modifying in place."""
    return tensor.grad_fn is not None and type(tensor.grad_fn).__name__.startswith("_ToTorchTensor")


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, Mapping):  # transformers' ModelOutput is one
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, list | tuple):
        for value in output:
            yield from _tensors(value)
