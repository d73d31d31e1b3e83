"""fabric-hsdp: hybrid sharded data parallel (FSDP2 over a named DeviceMesh) for Lightning Fabric.

Importing the package registers ``strategy="hsdp"`` in Lightning's strategy registry.
"""

import logging

from lightning.fabric.strategies import STRATEGY_REGISTRY

from fabric_hsdp.strategy import HybridFSDPStrategy

__all__ = ["HybridFSDPStrategy"]
__version__ = "0.1.0"

# Like Lightning's own logger: INFO to stderr unless the application configured logging itself.
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler())

if "hsdp" not in STRATEGY_REGISTRY:
    STRATEGY_REGISTRY.register(
        "hsdp", HybridFSDPStrategy, description="FSDP2 hybrid sharding: shard within a node, replicate across nodes"
    )
