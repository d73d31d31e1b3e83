"""fabric-hsdp: hybrid sharded data parallel (FSDP2 over a named DeviceMesh) for Lightning Fabric.

``from fabric_hsdp import HybridFSDPStrategy`` is the strategy. Importing the package registers ``strategy="hsdp"``
in Lightning's strategy registry, but imports neither Lightning nor the strategy: the registration happens when
Lightning's registry is imported (now, if it already is), and the strategy class is imported on first use. So the
``fabric-hsdp`` command and :mod:`fabric_hsdp.checkpoint` start without Lightning's import time.

The map: :mod:`~fabric_hsdp.strategy` is Fabric's hooks, each passing on to one wing:

* ``setup_environment`` -> :mod:`fabric_hsdp.processes` (launchers, the process group, rank placement);
* ``setup_module`` -> :mod:`fabric_hsdp.setup` (the pipeline: float8, :mod:`~fabric_hsdp.tensor_parallel`,
  :mod:`~fabric_hsdp.expert_parallel`, :mod:`~fabric_hsdp.context_parallel`, activation checkpointing, compile,
  FSDP) and :mod:`fabric_hsdp.adapters` (LoRA);
* ``save``/``load``/``load_raw`` -> :mod:`fabric_hsdp.checkpoint` (formats, writers, the training path);
* below them all, :mod:`fabric_hsdp.models`: what the package knows of model libraries (LoRA wrappers, fused rows,
  experts, tied weights, transformers); beside them, what every wing uses: :mod:`~fabric_hsdp.topology` (the degrees,
  the named mesh and its sub-meshes by name), :mod:`~fabric_hsdp.agreement` (every rank passes or every rank fails),
  :mod:`~fabric_hsdp.versions`, :mod:`~fabric_hsdp.errors`, :mod:`~fabric_hsdp.logs`, :mod:`~fabric_hsdp.units`.

Tools on top: :mod:`fabric_hsdp.planning` (``fabric-hsdp plan``), :mod:`fabric_hsdp.dryrun` (``fabric-hsdp dryrun``),
:mod:`~fabric_hsdp.cli` and :mod:`~fabric_hsdp.run` (``fabric-hsdp run``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

from fabric_hsdp.errors import CheckpointError, FabricHSDPError, PeerRankError, SaveError
from fabric_hsdp.logs import configure_package_logger

__all__ = ["CheckpointError", "FabricHSDPError", "HybridFSDPStrategy", "PeerRankError", "SaveError"]
__version__ = "0.1.0"

_REGISTRY_MODULE = "lightning.fabric.strategies"


def __getattr__(name: str) -> Any:
    if name == "HybridFSDPStrategy":
        from fabric_hsdp.strategy import HybridFSDPStrategy

        return HybridFSDPStrategy
    raise AttributeError(f"module 'fabric_hsdp' has no attribute {name!r}")


def _hsdp_strategy(**kwargs: Any) -> Any:
    from fabric_hsdp.strategy import HybridFSDPStrategy

    return HybridFSDPStrategy(**kwargs)


def _register(registry: Any) -> None:
    if "hsdp" not in registry:
        description = "FSDP2 hybrid sharding (fabric-hsdp): shard within a node, replicate across nodes"
        registry.register("hsdp", _hsdp_strategy, description=description)


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Adds ``"hsdp"`` to Lightning's strategy registry right after Lightning creates it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                execute(module)
                _register(module.STRATEGY_REGISTRY)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


configure_package_logger()
if _REGISTRY_MODULE in sys.modules:
    _register(sys.modules[_REGISTRY_MODULE].STRATEGY_REGISTRY)
elif not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
