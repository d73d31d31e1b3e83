"""Scenario for a checkpoint path that is not shared across nodes: each simulated node sees its own directory."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.training import build, layer_class, make_fabric


def save_to_node_local_path(num_nodes: int, devices: int, root: str) -> dict:
    """``/proc/self/cwd/checkpoint`` is one path on every rank, but each node's ranks run in their own directory."""
    node_dir = Path(root) / f"node{os.environ['NODE_RANK']}"
    node_dir.mkdir(exist_ok=True)
    os.chdir(node_dir)
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    with fabric.init_module(empty_init=True):
        model = build("llama")
    model = fabric.setup_module(model)
    fabric.save("/proc/self/cwd/checkpoint", {"model": model})
    return {"saved": True}
