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
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path

RUN_SCRIPT = Path(__file__).with_name("_run_script.py")


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

    try:
        fabric_cli.main(args=Namespace(**params, script=str(RUN_SCRIPT)), script_args=[script, *script_args])
    except ChildFailedError as error:
        print(f"fabric-hsdp run: {error}", file=sys.stderr)
        return 1
    return 0
