"""Progress of long reads, writes and conversions: a tqdm bar on a terminal, periodic log lines anywhere else.

In a batch log (SLURM's output file, ``nohup``) a tqdm bar prints nothing useful until the end, so when stderr is not
a terminal a :class:`Progress` logs a line every :data:`LOG_INTERVAL` seconds instead: bytes done of the total, the
rate and the time left.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from fabric_hsdp.units import format_binary_bytes

_logger = logging.getLogger(__name__)

LOG_INTERVAL = 15.0  # seconds between progress lines in a non-interactive log


class Progress:
    """Counts bytes of one long operation; usable as a context manager.

    Args:
        total: bytes the operation will process.
        what: what is being done, e.g. ``"loading lit_model.pth"``.
        enabled: ``False`` to stay silent (e.g. on ranks other than 0).
    """

    def __init__(self, total: int, what: str, *, enabled: bool = True) -> None:
        self.total = total
        self.what = what
        self.done = 0
        self._started = time.monotonic()
        self._last_line = self._started
        self._bar: Any = None
        self._enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what)

    def update(self, count: int) -> None:
        """``count`` more bytes are done."""
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
            return
        now = time.monotonic()
        if self._enabled and now - self._last_line >= LOG_INTERVAL:
            self._last_line = now
            _logger.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """``"<what>: 1.2 GiB of 4.0 GiB (30%), 410.3 MiB/s, 7 s left"``."""
        elapsed = max((now or time.monotonic()) - self._started, 1e-9)
        rate = self.done / elapsed
        left = f", {(self.total - self.done) / rate:.0f} s left" if rate > 0 else ""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        done, total, speed = (format_binary_bytes(value) for value in (self.done, self.total, rate))
        return f"{self.what}: {done} of {total}{share}, {speed}/s{left}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def log_throughput(verb: str, path: Path, seconds: float) -> None:
    """Rank 0's line for a finished save or load of a directory: size on disk, seconds, MB/s."""
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    _logger.info("%s '%s': %.1f MB in %.2f s (%.0f MB/s)", verb, path, size / 1e6, seconds, size / 1e6 / seconds)
