"""Save and come back when SLURM preempts a job or its time runs out: what Lightning's Trainer does, for Fabric loops.

SLURM warns a job before it kills it when asked to (``sbatch --signal=USR1@90``: SIGUSR1 90 s before the time limit;
``scancel --signal=USR1 JOB`` by hand), and sends SIGTERM when it cancels or preempts it (then SIGKILL after
``KillWait``). :class:`Preemption` turns both into a flag; at the next step boundary every rank asks
:meth:`Preemption.stop_requested`, one all-reduce of that flag, so all ranks agree to stop at the same step even when
the signal reached them at different steps (or reached only some of them). The loop then saves a checkpoint (every
rank, as any save) and calls :meth:`Preemption.requeue`: with ``requeue=True`` inside a SLURM batch job, global rank
0 runs ``scontrol requeue $SLURM_JOB_ID`` and SLURM starts the job again, which resumes from that checkpoint::

    from fabric_hsdp.processes.preemption import Preemption

    preemption = Preemption(requeue=True)           # handlers for SIGUSR1 and SIGTERM, from now on
    for step in range(start, max_steps + 1):
        train_step(...)
        if preemption.stop_requested(fabric):       # a collective: call it on every rank, every step
            fabric.save(f"{out_dir}/step-{step:06d}", state)
            preemption.requeue(fabric)              # rank 0: scontrol requeue (when asked and under sbatch)
            break

The handlers only set the flag (nothing runs inside a signal handler). ``examples/finetune.py`` uses it
(``--requeue``); the job script needs ``#SBATCH --signal=USR1@90`` (and ``--open-mode=append`` to keep the first
run's log) and, for the restarted job to resume, the same output directory.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Iterable
from types import FrameType
from typing import Any

_logger = logging.getLogger("fabric_hsdp")

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preemption:
    """Signal handlers that request a stop, a step-boundary agreement on it, and SLURM's requeue.

    Args:
        signals: The signals that request a stop (default SIGUSR1, SLURM's ``--signal=USR1@T``, and SIGTERM).
        requeue: Whether :meth:`requeue` asks SLURM to start the job again (only inside a batch job:
            ``SLURM_JOB_ID`` set, not an interactive ``salloc`` shell).
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, requeue: bool = False) -> None:
        self.signals = tuple(signals)
        self.requeue_job = requeue
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def stop_requested(self, fabric: Any) -> bool:
        """Whether any rank received a signal: one all-reduce (max) of the flag, so every rank gets the same answer.

        Call it on every rank at the same point of every step (it is a collective). Without a process group it is
        this process's flag.
        """
        import torch
        import torch.distributed as dist

        # on the CPU, over gloo: a flag on the GPU would make every step wait for the GPU's queued work (.item())
        flag = torch.tensor(0 if self.received is None else int(self.received))
        if fabric.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())
        signum = int(flag.item())
        if signum and fabric.global_rank == 0:
            _logger.info(
                "received %s on at least one rank: stopping at this step on every rank", signal.Signals(signum).name
            )
        return bool(signum)

    def _cpu_group(self) -> Any:
        """The default group where it serves CPU tensors (gloo), else a gloo group made once (on every rank: the first
        ``stop_requested`` is at the same point on each)."""
        import torch.distributed as dist

        if "gloo" in str(dist.get_backend()):
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def requeue(self, fabric: Any) -> bool:
        """On global rank 0 of a SLURM batch job, with ``requeue=True``: ``scontrol requeue $SLURM_JOB_ID``.

        Returns:
            Whether this rank requeued the job (the other ranks return False).
        """
        job = os.environ.get("SLURM_JOB_ID")
        if not self.requeue_job or fabric.global_rank != 0:
            return False
        if job is None or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
            _logger.info("not requeued: not a SLURM batch job (requeue=True needs sbatch)")
            return False
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            _logger.warning(
                "scontrol requeue %s failed (exit %d): %s; resubmit the job to resume",
                job,
                result.returncode,
                (result.stderr or result.stdout).strip(),
            )
            return False
        _logger.info("requeued SLURM job %s: it resumes from the checkpoint just saved", job)
        return True

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()
