"""``fabric-hsdp run``: Lightning's ``fabric run`` (the successor of ``lightning run model``), with ``--strategy hsdp``.

``fabric run --strategy hsdp`` fails twice over: Lightning's CLI checks ``--strategy`` against its registry when it is
imported, before anything imports ``fabric_hsdp``; and each launched process would also need ``fabric_hsdp`` imported
before ``Fabric()`` reads ``LT_STRATEGY=hsdp``. This command imports the package first (registering ``"hsdp"``), lets
Lightning's own parser read the arguments, and hands them to Lightning's ``fabric run`` with the script started
through ``fabric_hsdp/_run_script.py``, which imports the package in each process and then runs the script as
``__main__`` with its own arguments.
"""

from __future__ import annotations

import importlib
import sys
import threading
from argparse import Namespace
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

RUN_SCRIPT = Path(__file__).with_name("_run_script.py")
TORCHRUN_RENDEZVOUS_TIMEOUT = timedelta(seconds=600)  # torchrun's static rendezvous (torch's _default_timeout_seconds)


def main(argv: Sequence[str]) -> int:
    """Parse ``fabric run``'s arguments (``argv`` after ``run``) and launch; returns the exit code."""
    import click

    importlib.import_module("fabric_hsdp")  # registers "hsdp" before Lightning's CLI builds its --strategy choices
    from lightning.fabric import cli as fabric_cli

    try:
        with fabric_cli._run.make_context("fabric-hsdp run", list(argv)) as context:
            params = dict(context.params)
    except click.exceptions.Exit as done:  # --help
        return done.exit_code
    except click.ClickException as error:
        error.show()
        return error.exit_code
    script, script_args = params.pop("script"), list(params.pop("script_args", ()))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    notice = _say_if_waiting(params)
    try:
        fabric_cli.main(args=Namespace(**params, script=str(RUN_SCRIPT)), script_args=[script, *script_args])
    except ChildFailedError as error:
        print(failure_line(error), file=sys.stderr)
        return 1
    finally:
        if notice is not None:
            notice.cancel()
    return 0


def failure_line(error: Any) -> str:
    """The one line that ends a node's log when its processes failed (torchrun's ``ChildFailedError``): the reason
    its first failed rank gave (the package's one-line error, which every rank writes to torchrun's error file), or
    how it ended and where its traceback is."""
    rank, failure = error.get_first_failure()
    where = f"rank {rank} (local rank {failure.local_rank})"
    message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
    # torch's error file nests {"message": ..., "extraInfo": ...}; without one its error_file reads "<N/A>"
    if failure.error_file != "<N/A>" and message:
        return f"fabric-hsdp run: {where} failed: {' '.join(str(message).split())}"
    if failure.exitcode < 0:
        return f"fabric-hsdp run: {where} was killed by {failure.signal_name()} (out of memory is a common cause)"
    return f"fabric-hsdp run: {where} exited with code {failure.exitcode}; its traceback is in this node's log above"


def _say_if_waiting(params: dict[str, Any]) -> threading.Timer | None:
    """On a multi-node launch: if torchrun has started no process after ``RENDEZVOUS_NOTICE`` seconds (it waits for
    every node's launch to join), say so once. torchrun itself is silent for its whole rendezvous timeout."""
    from fabric_hsdp.processes import distributed

    if int(params.get("num_nodes") or 1) < 2:
        return None
    started = datetime.now(timezone.utc)
    until, address = started + TORCHRUN_RENDEZVOUS_TIMEOUT, f"{params.get('main_address')}:{params.get('main_port')}"

    def say() -> None:
        if _started_processes() is not False:
            return  # the nodes have met (or this system does not say)
        print(
            f"fabric-hsdp run: node {params.get('node_rank')} has waited since {started:%H:%M:%S} UTC for all"
            f" {params.get('num_nodes')} nodes of the job to join torchrun's rendezvous at {address} (--main-address"
            f" and --main-port); a node whose launch did not start keeps the others waiting until"
            f" {until:%H:%M:%S} UTC (torchrun's timeout, {TORCHRUN_RENDEZVOUS_TIMEOUT})."
            f" Start `fabric-hsdp run` on every node with the same --num-nodes, --main-address and --main-port.",
            file=sys.stderr,
            flush=True,
        )

    timer = threading.Timer(distributed.RENDEZVOUS_NOTICE, say)
    timer.daemon = True
    timer.start()
    return timer


def _started_processes() -> bool | None:
    """Whether this process has child processes (torchrun's workers), from ``/proc``; ``None`` where it cannot tell."""
    try:
        return any((task / "children").read_text().split() for task in Path("/proc/self/task").iterdir())
    except OSError:
        return None
