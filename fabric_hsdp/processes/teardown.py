"""A clean end for every rank: release the sharded modules, then destroy the process group.

Ranks that ran an FSDP2 forward can abort at interpreter exit ("terminate called without an active exception") when
the process group dies before the FSDP states that reference it (reported with torch's CPU builds on gloo). The
strategy therefore registers ``release_and_destroy`` with ``atexit``: it drops the FSDP2 state (and with it the
references to the process groups) from every module it sharded, then destroys the process group while the interpreter
is still whole. It also runs from ``HybridFSDPStrategy.teardown()``.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import weakref

import torch.distributed as dist
from torch import nn

from fabric_hsdp.versions import composable_state_keys, module_hook_dicts


class ShardedModuleRegistry:
    """Weak references to the modules the strategy sharded, released together at the end."""

    def __init__(self) -> None:
        self._modules: list[weakref.ReferenceType[nn.Module]] = []

    def add(self, module: nn.Module) -> None:
        self._modules.append(weakref.ref(module))

    def modules(self) -> list[nn.Module]:
        """The sharded modules still alive."""
        return [module for module in (ref() for ref in self._modules) if module is not None]

    def release_and_destroy(self) -> None:
        """Detach FSDP2 state from every registered module, then destroy the default process group."""
        for ref in self._modules:
            module = ref()
            if module is not None:
                _release(module)
        self._modules.clear()
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _release(module: nn.Module) -> None:
    state_key, registry_key = composable_state_keys()
    for submodule in module.modules():
        submodule.__dict__.pop(state_key, None)
        submodule.__dict__.pop(registry_key, None)
        # FSDP2's hooks are bound methods of its state objects: drop them too, or they keep the state alive.
        for hooks in module_hook_dicts(submodule):
            hooks.clear()


def exit_now(status: int) -> None:
    """End the process with ``status`` from an ``atexit`` handler, where ``sys.exit`` cannot set it.

    ``os._exit`` skips the ``atexit`` handlers registered before the caller, so flush what they would have flushed.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
