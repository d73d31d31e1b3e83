"""The checkpoint I/O watchdog: a rank stalled in a read or a write fails every rank with where it stopped."""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import launch
from tests.helpers.training import layer_class, make_fabric, setup_training

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("stall", "stalled_rank", "what", "file"),
    [
        ("load-fifo", 2, "reading", ".distcp'"),
        ("save-stop", 1, "writing", ".distcp'"),
        ("full-save-fifo", 0, "writing", "/full.pth'"),  # one file from rank 0, the others in its gathers
    ],
)
def test_stalled_rank_fails_every_rank_with_its_file_and_progress(tmp_path, stall, stalled_rank, what, file):
    io_timeout = 2.0
    result = launch(
        stalled_io,
        {"out": str(tmp_path), "stalled_rank": stalled_rank, "stall": stall, "io_timeout": io_timeout},
        timeout=150,
        fail_grace=5,
        env={"FABRIC_HSDP_DEBUG": "1"},  # each rank's own error line, not rank 0's one line for the job
    )
    assert not result.timed_out, [rank.stderr[-2000:] for rank in result.ranks]
    waiting = [rank for rank in result.ranks if rank.global_rank != stalled_rank]
    # a stopped rank is killed by the launcher; a blocked one ends itself
    assert all(rank.returncode == 1 for rank in waiting), result.returncodes
    assert all(rank.value is None for rank in result.ranks)  # nobody finished the stalled operation
    for rank in waiting if stall == "save-stop" else result.ranks:
        line = next((line for line in rank.stderr.splitlines() if "checkpoint I/O stalled" in line), None)
        assert line is not None, rank.stderr[-3000:]
        assert f"rank {stalled_rank} (host " in line and f"for {io_timeout:g} s {what} '" in line, line
        assert file in line and " bytes done in this operation" in line, line
        done = int(re.search(r"\(([\d,]+) bytes done", line).group(1).replace(",", ""))
        assert done > 0, line
    # how far it got: the read or write before the stall counted
    # failed a few io_timeouts after the stall (and the launcher's 5 s grace for a stopped rank), not after the
    # collectives' 5-minute timeout
    assert time.time() - float((tmp_path / "stalled_at").read_text()) < 60


def test_a_stopped_store_host_fails_the_other_ranks_naming_the_store(tmp_path):
    """Rank 0 serves the job's store: stopped mid-save, nobody can post or read a stall there, and a store call to
    a stopped server outwaits its own timeout; the other ranks' watchdogs time their store calls and end."""
    io_timeout = 2.0
    result = launch(
        stalled_io,
        {"out": str(tmp_path), "stalled_rank": 0, "stall": "save-stop", "io_timeout": io_timeout},
        timeout=150,
        fail_grace=5,
        env={"FABRIC_HSDP_DEBUG": "1"},  # each rank's own error line, not rank 0's one line for the job
    )
    assert not result.timed_out, [rank.stderr[-2000:] for rank in result.ranks]
    waiting = [rank for rank in result.ranks if rank.global_rank != 0]
    assert [rank.returncode for rank in waiting] == [1, 1, 1], result.returncodes
    for rank in waiting:
        line = next((line for line in rank.stderr.splitlines() if "the job's store (" in line), None)
        assert line is not None, rank.stderr[-3000:]
        assert f"has not answered rank {rank.global_rank} (host " in line and f"for {io_timeout:g} s" in line, line
    assert time.time() - float((tmp_path / "stalled_at").read_text()) < 60


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# The I/O watchdog: a rank whose checkpoint I/O stalls.


def stalled_io(num_nodes: int, devices: int, out: str, stalled_rank: int, stall: str, io_timeout: float) -> dict:
    """Save a sharded checkpoint, then stall one rank's I/O; the watchdog must end every rank with its message.

    ``stall="load-fifo"``: during the load, ``stalled_rank``'s second read blocks reading a FIFO nobody writes to
    (its watchdog thread runs on). ``stall="save-stop"``: during the next save, ``stalled_rank`` writes one piece,
    then stops its whole process (``SIGSTOP``: no thread of it runs; its ring neighbour must notice).
    ``stall="full-save-fifo"``: a full (one-file) save to ``full.pth``, whose writer thread on ``stalled_rank``
    (rank 0, the one that writes) blocks on a FIFO at its first write to the disk, as on a dead mount; the others
    wait in its gathers.
    """
    from fabric_hsdp.checkpoint.core import fileio
    from fabric_hsdp.checkpoint.writers import direct_writer

    # the collectives' own timeout is far away: only the watchdog can end this job in time
    fabric = make_fabric(
        num_nodes,
        devices,
        sharded_modules={layer_class("llama")},
        io_timeout=io_timeout,
        timeout=timedelta(minutes=5),
        state_dict_type="full" if stall == "full-save-fifo" else "sharded",
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
    if stall == "full-save-fifo" and stalled:
        fifo = Path(out) / f"fifo{stalled_rank}"
        os.mkfifo(fifo)

        def blocking_write_all(self: Any, view: memoryview) -> None:
            (Path(out) / "stalled_at").write_text(str(time.time()))
            os.read(os.open(fifo, os.O_RDWR), 1)

        fileio.DirectFileWriter._write_all = blocking_write_all
    started = time.monotonic()
    if stall == "load-fifo":
        fabric.load(path, {"model": model, "optimizer": optimizer})
    elif stall == "full-save-fifo":
        fabric.save(Path(out) / "full.pth", {"model": model, "optimizer": optimizer})
    else:
        fabric.save(path, {"model": model, "optimizer": optimizer})
    return {"finished_after": time.monotonic() - started}  # the watchdog must not let any rank get here
