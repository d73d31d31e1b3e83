"""Tied weights under tensor parallelism: one parameter held by several modules (an embedding and the output head).

``parallelize_module`` replaces a module's parameters with DTensors one module at a time, so two modules that shared a
weight end up with two different DTensors: the optimizer then sees one parameter more and the copies drift apart
after the first step. Sharing is found by identity before the plan runs (``named_parameters(remove_duplicate=False)``
lists every name of a shared parameter); afterwards the names must again hold one parameter. Where the plan split
every holder the same way (an embedding split by vocabulary rows, ``embedding_rowwise``, and a head split by output
rows, ``colwise``: both ``Shard(0)`` of the ``[vocab, dim]`` weight), the first DTensor is assigned to all of them.
Anything else (one holder split, the other whole; different dims) is refused, naming the weights and the fix.

FSDP2 keeps a shared parameter shared by itself (checked: ``fully_shard`` and ``to_empty`` preserve the identity).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fabric_hsdp.models.tied import TiedGroup


def _layout(param: Any) -> str:
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return "whole"
    return "(" + ", ".join(str(placement) for placement in param.placements) + ")"


def retie(model: nn.Module, groups: list[TiedGroup]) -> None:
    """Make every group's names hold one parameter again after the plan split them; raises where it cannot.

    Raises:
        ValueError: the holders of one tied parameter were split differently (the message names them, their layouts
            and the fix).
    """
    for group in groups:
        params = [model.get_parameter(name) for name in group]
        if all(param is params[0] for param in params):
            continue
        layouts = [_layout(param) for param in params]
        meshes = {id(getattr(param, "device_mesh", None)) for param in params}
        if len(set(layouts)) == 1 and len(meshes) == 1:
            for name in group[1:]:
                module_name, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(module_name), attribute, params[0])
            continue
        held = ", ".join(f"{name} {layout}" for name, layout in zip(group, layouts))
        raise ValueError(
            f"{' and '.join(group)} are one tied parameter, but tensor_parallel_plan splits its holders differently"
            f" ({held}), which would untie them and train two copies. Split every holder along the same dim (an"
            " embedding with 'embedding_rowwise' / RowwiseParallel() and an output head with 'colwise' /"
            " ColwiseParallel(): both split the vocabulary rows), leave all of them out of the plan, or untie the"
            " weights before setup (e.g. tie_word_embeddings=False)."
        )
