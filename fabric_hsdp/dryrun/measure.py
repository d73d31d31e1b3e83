"""What one rank uses, by phase: host memory (``/proc/self/status``), device memory (CUDA's allocator), file reads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def _status_bytes(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_resident() -> int:
    """Resident memory of this process now (``VmRSS``), bytes; 0 where ``/proc`` has none."""
    return _status_bytes("VmRSS") or 0


def host_peak() -> int:
    """Peak resident memory since the last :func:`reset_host_peak` (``VmHWM``), bytes."""
    return _status_bytes("VmHWM") or host_resident()


def reset_host_peak() -> bool:
    """Start a new ``VmHWM`` window (Linux: ``5`` into ``/proc/self/clear_refs``); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def tensors_from_mmap(threshold: int = 128 * 1024) -> bool:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own ``mmap``, unmapped on free.

    By default glibc raises its mmap threshold up to 32 MiB as blocks are freed, so the shards of a large model
    (a few MiB each at 1/128) come from the heap, and freed ones stay resident: ``VmRSS`` then tells the allocator's
    history, not the tensors alive. With a fixed threshold the host figures follow the live tensors, as a device
    allocator's allocated-bytes counter does. False where the C library has no ``mallopt`` (not glibc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, threshold)) and bool(mallopt(m_trim_threshold, threshold))


def bytes_read() -> int:
    """Bytes this process has read through read system calls so far (``rchar`` of ``/proc/self/io``)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        return 0
    return 0


@dataclass
class Phase:
    """One phase's figures: peak host and device memory above the run's start, and what it read."""

    name: str
    host_peak: int = 0
    device_peak: int | None = None
    bytes_read: int = 0
    seconds: float = 0.0
    counted_peak: int | None = None  # --no_compute: resident at the step's start plus the step's counted allocations
    counted_allocations: int | None = None  # --no_compute: the peak of the tensors the steps allocated, bytes


@dataclass
class Meter:
    """Measures phases one after another: each phase's peak is over its own window (``VmHWM`` reset at its start)."""

    device: torch.device
    baseline_host: int = field(default_factory=host_resident)
    phases: dict[str, Phase] = field(default_factory=dict)
    _started: float = field(default_factory=time.perf_counter)
    _read_at_start: int = field(default_factory=bytes_read)

    def __post_init__(self) -> None:
        self.mmap_threshold_set = tensors_from_mmap()
        self.resets = reset_host_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_device = torch.cuda.memory_allocated(self.device)

    def rebase(self) -> None:
        """Measure from here: the resident memory now is the baseline of every later phase."""
        self.baseline_host = host_resident()
        if self.device.type == "cuda":
            self.baseline_device = torch.cuda.memory_allocated(self.device)
        self.start()

    def start(self) -> None:
        """Open a new window (call at the end of the previous phase)."""
        self.resets = reset_host_peak() and self.resets
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._started = time.perf_counter()
        self._read_at_start = bytes_read()

    def end(self, name: str) -> Phase:
        """Close the window as phase ``name`` (a repeated phase keeps the largest figures) and open the next."""
        phase = Phase(
            name,
            host_peak=max(0, host_peak() - self.baseline_host),
            device_peak=(
                torch.cuda.max_memory_allocated(self.device) - self.baseline_device
                if self.device.type == "cuda"
                else None
            ),
            bytes_read=bytes_read() - self._read_at_start,
            seconds=time.perf_counter() - self._started,
        )
        previous = self.phases.get(name)
        if previous is not None:
            phase = Phase(
                name,
                max(phase.host_peak, previous.host_peak),
                None if phase.device_peak is None else max(phase.device_peak, previous.device_peak or 0),
                phase.bytes_read + previous.bytes_read,
                phase.seconds + previous.seconds,
            )
        self.phases[name] = phase
        self.start()
        return phase
