"""fabric-hsdp: hybrid sharded data parallel (FSDP2 over a named DeviceMesh) for Lightning Fabric.

Importing the package registers ``strategy="hsdp"`` in Lightning's strategy registry.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from fabric_hsdp.strategy import HybridFSDPStrategy

__all__ = ["HybridFSDPStrategy"]
__version__ = "0.1.0"

if "hsdp" not in STRATEGY_REGISTRY:
    STRATEGY_REGISTRY.register(
        "hsdp", HybridFSDPStrategy, description="FSDP2 hybrid sharding: shard within a node, replicate across nodes"
    )
