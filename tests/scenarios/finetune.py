"""examples/finetune.py's ``main`` on launched ranks (the launcher's environment stands in for ``fabric run``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PATH_ARGUMENTS = ("checkpoint_dir", "out_dir", "data")


def finetune(num_nodes: int, devices: int, args: dict[str, Any]) -> None:
    from examples.finetune import main

    arguments = {key: Path(value) if key in PATH_ARGUMENTS else value for key, value in args.items()}
    main(**arguments, accelerator="cpu", devices=devices, num_nodes=num_nodes)
