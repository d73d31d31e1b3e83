"""Scenarios for checkpoint I/O at scale: the I/O watchdog, staged background saves, raw replica-split reads."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tests.helpers.training import layer_class, make_fabric, setup_training


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


def staged_chunks(num_nodes: int, devices: int, out: str, tensor_parallel_size: int = 1) -> dict:
    """Stage model + AdamW state twice with :class:`Stager`; write the second with DCP; report sizes and reuse."""
    import torch.distributed.checkpoint as dcp

    from fabric_hsdp.checkpoint.core.dcp_planners import SavePlanner
    from fabric_hsdp.checkpoint.core.stored_rows import held_row_order
    from fabric_hsdp.checkpoint.training.staging import Stager
    from fabric_hsdp.checkpoint.training.state import CheckpointState
    from fabric_hsdp.checkpoint.writers.direct_writer import DirectWriter
    from tests.helpers.training import expected_state, train_steps

    fabric = make_fabric(
        num_nodes, devices, sharded_modules={layer_class("llama")}, tensor_parallel_size=tensor_parallel_size
    )
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    group = torch.distributed.new_group(backend="gloo")
    stager = Stager()

    def state() -> dict:
        checkpoint = CheckpointState({"model": model.module, "optimizer": optimizer.optimizer})
        with held_row_order():
            return checkpoint.stored(checkpoint.tensors())[0]

    first = stager.stage(state(), group)
    pointers = sorted(buffer.data_ptr() for buffer in stager._buffers.values())
    second = stager.stage(state(), group)
    reused = pointers == sorted(buffer.data_ptr() for buffer in stager._buffers.values())
    expected = expected_state(model, optimizer, scheduler)
    train_steps(fabric, model, optimizer, scheduler, steps=1)  # after staging: must not reach the checkpoint
    path = Path(out) / f"staged-tp{tensor_parallel_size}"
    second.ready()
    dcp.save(second.state, storage_writer=DirectWriter(path), planner=SavePlanner(), process_group=group)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / f"expected-tp{tensor_parallel_size}.pt")
    local = sum(
        (t.to_local() if hasattr(t, "to_local") else t).nbytes
        for t in [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values())]
        if isinstance(t, torch.Tensor)
    )
    return {"staged": [first.nbytes, second.nbytes], "local": local, "reused": reused}


def raw_load_counting_reads(num_nodes: int, devices: int, out: str, split_replica_reads: bool) -> dict:
    """Raw-load a ``.pth`` and a ``.safetensors`` of a known model; bytes this rank read and exactness of each."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from tests.helpers.counters import ReadCounter
    from tests.helpers.training import build, full_state

    expected = build("llama", seed=3).state_dict()
    files = {"pth": Path(out) / "raw.pth", "safetensors": Path(out) / "raw.safetensors"}
    if int(os.environ.get("RANK", "0")) == 0 and not files["pth"].exists():
        torch.save(expected, files["pth"])
        save_file({k: v.contiguous() for k, v in expected.items()}, files["safetensors"])
    fabric = make_fabric(
        num_nodes, devices, sharded_modules={layer_class("llama")}, split_replica_reads=split_replica_reads
    )
    fabric.barrier()
    facts: dict[str, Any] = {"file_bytes": sum(t.nbytes for t in expected.values())}
    counter = ReadCounter()
    for kind, file in files.items():
        with fabric.init_module(empty_init=True):
            model = build("llama", seed=11)
        model = fabric.setup_module(model)
        before = counter.bytes
        fabric.load_raw(file, model)
        actual = full_state(model.module)
        facts[kind] = {
            "bytes_read": counter.bytes - before,
            "exact": all(torch.equal(actual[k], v) for k, v in expected.items()),
        }
    dist.barrier()
    return facts
