"""The process group's backend: which one serves the tensors a run's collectives see."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from fabric_hsdp import distributed

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
