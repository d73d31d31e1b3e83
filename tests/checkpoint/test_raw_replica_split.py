"""Raw loads with split replica reads: each replica reads 1/R of its shard from the file and gathers the rest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import launch
from tests.helpers.training import layer_class, make_fabric

pytestmark = pytest.mark.slow


def test_raw_load_reads_each_byte_once_per_replica_group(tmp_path):
    reads = {}
    for split in (False, True):
        result = launch(
            raw_load_counting_reads,
            {"out": str(tmp_path), "split_replica_reads": split},
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


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# Raw loads whose replicas split the reads.


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
