import pytest
import torch

from fabric_hsdp.sharding import offload_policy


def test_cpu_offload_on_a_cpu_device_is_refused_with_the_fix():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    with pytest.raises(ValueError, match=r"cpu_offload=True\) moves the shards .* Drop cpu_offload, or run on GPUs"):
        offload_policy(True, torch.device("cpu"))
    assert isinstance(offload_policy(True, torch.device("cuda", 0)), CPUOffloadPolicy)
    assert type(offload_policy(False, torch.device("cpu"))) is OffloadPolicy
