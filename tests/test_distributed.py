"""The process group's backend: which one serves the tensors a run's collectives see."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from fabric_hsdp.processes import distributed

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(
    ("device", "backend", "cpu_offload", "expected"),
    [
        (CUDA, None, False, "nccl"),
        (CUDA, None, True, "cpu:gloo,cuda:nccl"),  # offloaded shards and gradients live in CPU memory
        (CUDA, None, CPUOffloadPolicy(pin_memory=False), "cpu:gloo,cuda:nccl"),
        (CUDA, None, OffloadPolicy(), "nccl"),  # FSDP2's "no offload" policy
        (CPU, None, False, "gloo"),
        (CPU, None, True, "gloo"),
        (CUDA, "nccl", True, "nccl"),  # the user's choice stands
    ],
)
def test_cpu_offload_on_cuda_gets_a_cpu_backend_beside_nccl(device, backend, cpu_offload, expected):
    assert distributed.choose_backend(device, backend, cpu_offload) == expected


class _Stop(Exception):
    pass


def test_the_strategy_initialises_the_offload_backend_on_cuda(monkeypatch):
    """``HybridFSDPStrategy(cpu_offload=True)`` on CUDA asks for ``cpu:gloo,cuda:nccl`` (seen without a GPU)."""
    from unittest import mock

    from fabric_hsdp import HybridFSDPStrategy

    chosen = {}

    def connect(environment, backend, timeout, device_id):
        chosen.update(backend=backend, device_id=device_id)
        raise _Stop

    monkeypatch.setattr(distributed, "_init_dist_connection", connect)
    monkeypatch.setattr(distributed, "reset_seed", lambda: None)
    strategy = HybridFSDPStrategy(cpu_offload=True, cluster_environment=LightningEnvironment())
    strategy.accelerator = mock.Mock()  # selects the device; there is none here
    strategy.parallel_devices = [CUDA]
    with pytest.raises(_Stop):
        strategy.setup_environment()
    assert chosen == {"backend": "cpu:gloo,cuda:nccl", "device_id": CUDA}


def wait_for_a_missing_node(num_nodes: int, devices: int, timeout: float) -> None:
    """One node of a 2-node job starts; the other never does: the ranks wait in init_process_group until `timeout`."""
    from datetime import timedelta

    from tests.helpers.training import make_fabric

    distributed.RENDEZVOUS_NOTICE = 2.0
    make_fabric(num_nodes + 1, devices, timeout=timedelta(seconds=timeout))


@pytest.mark.timeout(200)
def test_ranks_waiting_for_a_node_that_never_started_say_so_once_per_node():
    """#34: a node that never started left the others silent in the rendezvous for its whole timeout (30 minutes)."""
    import re

    from tests.helpers.launch import launch

    result = launch(wait_for_a_missing_node, {"timeout": 12}, num_nodes=1, timeout=100)
    assert result.returncodes == [1, 1], result.returncodes
    said = [line for rank in result.ranks for line in rank.stderr.splitlines() if "waiting since" in line]
    assert len(said) == 1 and said[0] in result.ranks[0].stderr, said  # node 0's local rank 0, once
    assert re.fullmatch(
        r"fabric_hsdp: waiting since \d\d:\d\d:\d\d UTC for all 4 ranks of the job \(2 node\(s\) x 2\) to join at"
        r" 127\.0\.0\.1:\d+ \(the main address and port\); a node or rank that did not start keeps the others waiting"
        r" here until \d\d:\d\d:\d\d UTC \(timeout 0:00:12\)\. Check that every node's launch started and can reach"
        r" 127\.0\.0\.1:\d+\.",
        said[0],
    ), said[0]
