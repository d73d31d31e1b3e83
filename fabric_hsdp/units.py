"""Byte sizes and bandwidths as people write them (``"80GB"``, ``"400Gbit/s"``), and back to text.

Used by the planner (device memory, bandwidths), the strategy (``memory_budget``) and the checkpoint writers
(``max_shard_size``); file sizes print in binary units, device memory in decimal ones, as each is usually quoted.
"""

from __future__ import annotations

import re

# Decimal units as GPU vendors and Hugging Face write them; binary ones when asked for (GiB).
_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BYTE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_BIT_UNITS = {"BIT": 1, "KBIT": 10**3, "MBIT": 10**6, "GBIT": 10**9, "TBIT": 10**12}
_BIT_UNITS.update({"BPS": 1, "KBPS": 10**3, "MBPS": 10**6, "GBPS": 10**9, "TBPS": 10**12})


def parse_bytes(size: int | float | str, what: str = "size") -> int:
    """Bytes in ``size``: a number, or a string like ``"80GB"`` (decimal), ``"512MiB"`` (binary).

    Raises:
        ValueError: ``size`` is not a positive number with one of those units.
    """
    if isinstance(size, bool):
        raise ValueError(f"{what}={size!r} is not a size; write e.g. '80GB' or '40GiB'")
    if isinstance(size, int | float):
        value = float(size)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not match or match.group(2).upper() not in _BYTE_UNITS:
            raise ValueError(f"{what}={size!r} is not a size; write a number with a unit, e.g. '80GB' or '40GiB'")
        value = float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"{what}={size!r} must be positive")
    return int(value)


def parse_bandwidth(rate: int | float | str, what: str = "bandwidth") -> float:
    """Bytes per second in ``rate``: a number (bytes/s), or ``"400Gbit/s"``, ``"400Gbps"``, ``"50GB/s"``.

    Raises:
        ValueError: ``rate`` is not a positive rate with one of those units.
    """
    if isinstance(rate, bool):
        raise ValueError(f"{what}={rate!r} is not a rate; write e.g. '400Gbit/s' or '50GB/s'")
    if isinstance(rate, int | float):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([a-zA-Z]+)(/s)?\s*", str(rate))
        unit = match.group(2) if match else ""
        per_second = bool(match and (match.group(3) or unit.lower().endswith("ps")))
        if match and per_second and unit.upper() in _BIT_UNITS:
            value = float(match.group(1)) * _BIT_UNITS[unit.upper()] / 8
        elif match and match.group(3) and unit.upper() in _BYTE_UNITS:
            value = float(match.group(1)) * _BYTE_UNITS[unit.upper()]
        else:
            raise ValueError(f"{what}={rate!r} is not a rate; write e.g. '400Gbit/s', '400Gbps' or '50GB/s'")
    if value <= 0:
        raise ValueError(f"{what}={rate!r} must be positive")
    return value


def format_bytes(count: float) -> str:
    """``80e9`` -> ``"80.0 GB"`` (decimal units, as device memory is quoted)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.2f} TB"


def format_binary_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, as file sizes are shown)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def format_seconds(seconds: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
