import pytest
import torch

from fabric_hsdp.fsdp import offload_policy


def test_cpu_offload_on_a_cpu_device_is_refused_with_the_fix():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    with pytest.raises(ValueError, match=r"cpu_offload=True\) moves the shards .* Drop cpu_offload, or run on GPUs"):
        offload_policy(True, torch.device("cpu"))
    assert isinstance(offload_policy(True, torch.device("cuda", 0)), CPUOffloadPolicy)
    assert type(offload_policy(False, torch.device("cpu"))) is OffloadPolicy


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"])
def test_fsdp_policy_and_planner_read_one_precision_table(precision):
    """What FSDP2 gathers and reduces in is what the planner counts bytes for (one table behind both)."""
    from fabric_hsdp.fsdp import mixed_precision_policy
    from fabric_hsdp.planning.memory import Training

    policy, training = mixed_precision_policy(precision), Training(precision)
    model_dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
    state = model_dtype.get(precision, torch.float32)  # "true" precisions build the model in their dtype
    compute, reduce = policy.param_dtype or state, policy.reduce_dtype or state
    assert (training.state_bytes, training.compute_bytes, training.reduce_bytes) == (
        state.itemsize,
        compute.itemsize,
        reduce.itemsize,
    )
    if precision.endswith("-mixed"):
        assert compute == {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
        assert reduce == torch.float32


def test_an_unknown_precision_is_refused_naming_the_ones_that_work():
    from fabric_hsdp.fsdp import mixed_precision_policy

    with pytest.raises(ValueError, match=r"precision='8-true'\)\. Choose one of: 32-true, bf16-mixed, 16-mixed"):
        mixed_precision_policy("8-true")
