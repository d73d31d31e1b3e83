"""A sharded save to a path each node resolves to its own directory (node-local disk) fails on every rank."""

from __future__ import annotations

from tests.helpers.launch import launch


def test_a_checkpoint_path_not_shared_across_nodes_fails_the_save_on_every_rank(tmp_path):
    # each rank's own error (without FABRIC_HSDP_DEBUG rank 0 says it in one line: tests/test_errors.py)
    debug = {"FABRIC_HSDP_DEBUG": "1"}
    result = launch(
        "tests.scenarios.node_local:save_to_node_local_path", {"root": str(tmp_path)}, timeout=240, env=debug
    )
    assert result.returncodes == [1, 1, 1, 1], result.returncodes
    for rank in result.ranks:
        assert "checkpoint '/proc/self/cwd/checkpoint' is not on a directory shared by every node" in rank.stderr, (
            rank.stderr[-3000:]
        )
    # nothing committed, and rank 0 removed its pending directory
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == []
