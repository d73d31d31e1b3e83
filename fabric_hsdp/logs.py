"""Logging: every module logs to its own logger under ``fabric_hsdp``; messages for all ranks are said by rank 0.

Importing the package gives the ``fabric_hsdp`` logger a handler that prints INFO and above to stderr with a
``fabric_hsdp:`` prefix, unless the application configured logging itself (as Lightning does for its own logger).
Misuse that deserves the user's attention is a ``rank_zero_warn`` (a Python warning), as in Lightning.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

PACKAGE_LOGGER = "fabric_hsdp"


def configure_package_logger() -> None:
    """INFO to stderr, prefixed ``fabric_hsdp:``, unless the root logger has handlers already."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"{PACKAGE_LOGGER}: %(message)s"))
        logger.addHandler(handler)


@rank_zero_only
def info_on_rank_zero(logger: logging.Logger, message: str, *args: Any) -> None:
    """``logger.info`` on global rank 0 only (the strategy sets the rank once the process group exists)."""
    logger.info(message, *args)


def warning_on_rank_zero(logger: logging.Logger, message: str, *args: Any) -> None:
    """``logger.warning`` on global rank 0 only: for what every rank finds the same during a load (one line, not N).

    Also callable without Lightning's rank set (the offline tools: one process, rank 0).
    """
    if global_rank() == 0:
        logger.warning(message, *args)


def global_rank() -> int:
    """This process's global rank: Lightning's once the strategy set it, else the process group's, else 0."""
    rank = getattr(rank_zero_only, "rank", None)
    if rank is not None:
        return rank
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
