"""Dry runs: a user's Fabric script as any rank of any cluster, in one process, on torch's fake process group.

``fabric-hsdp dryrun --num_nodes 16 --devices_per_node 8 --rank 77 train.py ARGS`` (see docs/dryrun.md) calls
:func:`~fabric_hsdp.dryrun.runner.dry_run`; ``fabric_hsdp.dryrun.active()`` tells a
script whether it runs as a dry run. Imports are lazy, so the command checks its arguments before torch loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "active": "fabric_hsdp.dryrun.fake",
    "DryRunReport": "fabric_hsdp.dryrun.report",
    "NOT_MEANINGFUL": "fabric_hsdp.dryrun.report",
    "ScriptFailedError": "fabric_hsdp.dryrun.runner",
    "dry_run": "fabric_hsdp.dryrun.runner",
    "ALL_KINDS": "fabric_hsdp.dryrun.world",
    "DryRunWorld": "fabric_hsdp.dryrun.world",
    "parse_rank": "fabric_hsdp.dryrun.world",
    "rank_kinds": "fabric_hsdp.dryrun.world",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fabric_hsdp.dryrun' has no attribute {name!r}")
