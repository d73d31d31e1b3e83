"""A sharded save to a path each node resolves to its own directory (node-local disk) fails on every rank."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.launch import launch
from tests.helpers.training import build, layer_class, make_fabric


def test_a_checkpoint_path_not_shared_across_nodes_fails_the_save_on_every_rank(tmp_path):
    # each rank's own error (without FABRIC_HSDP_DEBUG rank 0 says it in one line: tests/test_errors.py)
    debug = {"FABRIC_HSDP_DEBUG": "1"}
    result = launch(
        save_to_node_local_path,
        {"root": str(tmp_path)},
        timeout=240,
        env=debug,
    )
    assert result.returncodes == [1, 1, 1, 1], result.returncodes
    for rank in result.ranks:
        assert "checkpoint '/proc/self/cwd/checkpoint' is not on a directory shared by every node" in rank.stderr, (
            rank.stderr[-3000:]
        )
    # nothing committed, and rank 0 removed its pending directory
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == []


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# A checkpoint path that is not shared across nodes: each simulated node sees its own directory.


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
