"""Raw loads with split replica reads: each replica reads 1/R of its shard from the file and gathers the rest."""

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.slow


def test_raw_load_reads_each_byte_once_per_replica_group(tmp_path):
    reads = {}
    for split in (False, True):
        result = launch(
            "tests.scenarios.io:raw_load_counting_reads", {"out": str(tmp_path), "split_replica_reads": split}
        )
        values = result.check().values
        total = values[0]["file_bytes"]
        for kind in ("pth", "safetensors"):
            assert all(facts[kind]["exact"] for facts in values), (split, kind)
            reads[split, kind] = [facts[kind]["bytes_read"] for facts in values]
    for kind in ("pth", "safetensors"):
        # 2 nodes x 2 ranks, shard within a node: each rank holds half of every tensor, replicated on the other node
        assert all(0.45 * total < count < 0.55 * total for count in reads[False, kind]), (reads, total)
        assert 1.9 * total < sum(reads[False, kind]) < 2.1 * total  # the file read once per replica
        assert all(0.2 * total < count < 0.3 * total for count in reads[True, kind]), (reads, total)
        assert sum(reads[True, kind]) < 1.1 * total  # once in all (norm weights' odd rows are read whole)
