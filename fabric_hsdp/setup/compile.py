"""``torch.compile`` per FSDP unit, a step of the setup pipeline."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.models.experts import recorded_routers
from fabric_hsdp.models.transformers import disable_kv_cache

_logger = logging.getLogger(__name__)

CompileSpec = bool | dict[str, Any]


def apply_compile(
    module: nn.Module, units: list[tuple[str, nn.Module]], spec: CompileSpec, *, tensor_parallel: bool = False
) -> list[str]:
    """``torch.compile`` each FSDP unit (transformer block) of ``module`` on its own, in place (``Module.compile``),
    with ``spec``'s options (``True``: torch's defaults); return the units' names.

    Compiling per block keeps graphs small and lets identical blocks share one compiled graph (dynamo inlines the
    module and treats its parameters as inputs); compiling in place keeps the module tree, so no ``_orig_mod.``
    enters parameter names or checkpoints. A transformers MoE block's routers are called eagerly inside it
    (:func:`eager_call_class`), the rest of the block compiled. Turns transformers' KV cache off
    (:func:`disable_kv_cache`).
    """
    options = {} if spec is True else dict(spec)
    if tensor_parallel:
        # static shapes under TP unless asked otherwise: DTensor failed on the symbolic shapes that automatic dynamic
        # brings after a shape change ("unhashable type: non-nested SymInt" in a transformers Llama's norm with
        # sequence_parallel, while the first-layer split was traced); not reproduced since (the levers test trains at
        # a second length with it off), kept as the cautious default: a new shape recompiles (up to recompile_limit)
        options.setdefault("dynamic", False)
    for _, child in units:
        for router in recorded_routers(module, within=child):
            router.__class__ = eager_call_class(type(router))
        child.compile(**options)
    info_on_rank_zero(_logger, "torch.compile: %d modules compiled one by one (%s)", len(units), options or "defaults")
    disable_kv_cache(module, "torch.compile")
    return [name for name, _ in units]


@functools.cache
def eager_call_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``cls`` whose calls (forward and hooks) dynamo leaves eager: a graph break in a compiled block.

    For the routers whose logits transformers 5.3 records for the load-balancing loss (``output_router_logits=True``):
    its forward hook reads the collector with ``CompileableContextVar.get`` (``utils/output_capturing.py:108``),
    which under dynamo returns the global (:76-79) that ``set`` fills only when it runs compiled itself (:82-86,
    the whole model compiled). The model's forward sets the collector eagerly (:249), around our compiled blocks, so
    the traced hook saw ``None`` and recorded nothing: ``out.router_logits == ()`` and ``load_balancing_loss_func``
    raised ``IndexError`` at ``gate_logits[0]`` (``models/qwen3_moe/modeling_qwen3_moe.py:571``); the same with
    ``Module.compile`` of each layer of a plain transformers model. Dynamo calls ``type(module).__call__``
    (``torch/_dynamo/variables/nn_module.py``, ``UnspecializedNNModuleVariable.call_function``), so this class's
    disabled ``__call__`` runs the router and its hook eagerly, where the hook reads the context variable.
    """
    return type(f"EagerCall{cls.__name__}", (cls,), {"__call__": torch.compiler.disable(cls.__call__)})
