"""The planner's peak against the counted dry run of its 70B answer (issue #45): ``fabric-hsdp dryrun
--no_compute`` counts every allocation of the real training step on tensors without data (within 1.2 % of torch's
CPU allocator on a small Llama, tests/test_dryrun.py), so the planner's peak model is judged by it here without
running it (the 70B count takes ~16 min)."""

from fabric_hsdp.planning import Training, Workload, load_model_shape, memory_per_device

# docs/dryrun.md, the `70b-plan` row (`python benchmarks/dryrun_scale.py 70b-plan`): litgpt Llama-3-70B, rank 0 of
# 16 x 8, shard_size=128, selective AC, bf16-mixed, AdamW, 1 x 2048 tokens, two steps, counted step peak in bytes
# (resident 2.24 GB + allocations 47.39 GB), in the last block's MLP backward
COUNTED_70B_PEAK = 49_632_932_624


def test_the_70b_answers_planned_peak_is_within_10_percent_of_its_counted_step():
    """The planner summed everything it counts at the start of backward (57.83 GB, 0.86x); the peak is the largest
    of the moments, the last block's backward here, as the count found it."""
    training = Training("bf16-mixed", Workload(1, 2048), True, activation_checkpointing_mode="selective")
    memory = memory_per_device(load_model_shape("Llama-3-70B"), training, 128, 1)
    assert 0.9 <= COUNTED_70B_PEAK / memory.total <= 1.0, memory.total  # within 10 %, and not under the count
    # the moment: every layer's kept activations, one recomputed, the bf16 logits, the block and the prefetched
    # layer, the block's gradients and the head's fp32 reduce-scatter input
    kept = memory.activations - memory.loss_activations - memory.recompute
    last_block = kept + memory.recompute + memory.logits + memory.gathered
    assert memory.total == memory.parameters + memory.optimizer + last_block
    layer, head = 855_654_400, 1_050_673_152 + 8192  # elements unsharded: one block; the final norm and head
    assert memory.gathered == 3 * 2 * layer + 4 * head
    assert memory.logits == 2048 * 128_256 * 2
