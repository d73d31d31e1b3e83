"""Tied weights: one tensor held under several names (an embedding and the output head), found by identity.

Two views of the same fact, for two readers. :func:`tied_names` walks the state dict (parameters and persistent
buffers, as a checkpoint names them) and gives every key its first name, so a checkpoint that stores a tied tensor once
fills all of them. :func:`tied_groups` walks the parameters only (``named_parameters(remove_duplicate=False)`` lists
every name of a shared one) and gives the groups of two or more names, which tensor parallelism must keep one
parameter.
"""

from __future__ import annotations

from torch import nn

TiedGroup = tuple[str, ...]  # parameter names (as in named_parameters) that hold one parameter, first one first


def tied_names(module: nn.Module) -> dict[str, str]:
    """Each state-dict key -> the first key naming the same tensor (tied weights, e.g. an embedding and the output).

    ``state_dict()`` lists a shared tensor under every name; checkpoints (``save_pretrained``, safetensors) store it
    under one.
    """
    first: dict[int, str] = {}
    return {name: first.setdefault(id(tensor), name) for name, tensor in module.state_dict(keep_vars=True).items()}


def tied_groups(model: nn.Module) -> list[TiedGroup]:
    """The groups of parameter names that hold one parameter, by identity (groups of one left out)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]
