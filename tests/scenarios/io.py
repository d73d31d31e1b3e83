"""Scenarios for checkpoint I/O at scale: the I/O watchdog, staged background saves, raw replica-split reads."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tests.scenarios.checkpoints import setup_training
from tests.scenarios.common import layer_class, make_fabric


def stalled_io(num_nodes: int, devices: int, out: str, stalled_rank: int, stall: str, io_timeout: float) -> dict:
    """Save a sharded checkpoint, then stall one rank's I/O; the watchdog must end every rank with its message.

    ``stall="load-fifo"``: during the load, ``stalled_rank``'s second read blocks reading a FIFO nobody writes to
    (its watchdog thread runs on). ``stall="save-stop"``: during the next save, ``stalled_rank`` writes one piece,
    then stops its whole process (``SIGSTOP``: no thread of it runs; its ring neighbour must notice).
    """
    from fabric_hsdp.checkpoint.core import fileio
    from fabric_hsdp.checkpoint.writers import direct_writer

    # the collectives' own timeout is far away: only the watchdog can end this job in time
    fabric = make_fabric(
        num_nodes, devices, sharded_modules={layer_class("llama")}, io_timeout=io_timeout, timeout=timedelta(minutes=5)
    )
    model, optimizer, _ = setup_training(fabric, empty_init=False)
    path = Path(out) / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    stalled = fabric.global_rank == stalled_rank
    if stall == "load-fifo" and stalled:
        fifo = Path(out) / f"fifo{stalled_rank}"
        os.mkfifo(fifo)
        readinto, calls = fileio.readinto, []

        def blocking_readinto(fd: int, target: torch.Tensor, offset: int, **kw: Any) -> None:
            calls.append(offset)
            if len(calls) == 2:  # one read done: the next never returns
                (Path(out) / "stalled_at").write_text(str(time.time()))
                os.read(os.open(fifo, os.O_RDWR), 1)
            readinto(fd, target, offset, **kw)

        fileio.readinto = blocking_readinto
    if stall == "save-stop" and stalled:
        write = direct_writer._WatchedDirectFile.write

        def stopping_write(self: Any, data: Any) -> int:
            written = write(self, data)  # counted
            time.sleep(io_timeout / 2)  # long enough for the watchdog to post "writing" to the store, then stop
            (Path(out) / "stalled_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
            return written

        direct_writer._WatchedDirectFile.write = stopping_write
    started = time.monotonic()
    if stall == "load-fifo":
        fabric.load(path, {"model": model, "optimizer": optimizer})
    else:
        fabric.save(path, {"model": model, "optimizer": optimizer})
    return {"finished_after": time.monotonic() - started}  # the watchdog must not let any rank get here
