"""The planner's side of the throughput levers: AC modes, sequence parallel and loss parallel in its estimates."""

import pytest

from fabric_hsdp.planning import Training, Workload, activation_bytes, load_model_shape, traffic_per_step
from fabric_hsdp.planning.memory import layer_activation_bytes_per_token
from fabric_hsdp.topology import Topology


@pytest.fixture(scope="module")
def llama_7b():
    from pathlib import Path

    return load_model_shape(Path(__file__).resolve().parents[2] / "examples" / "plan" / "llama-2-7b.json")


def training(**kwargs):
    return Training("bf16-mixed", Workload(1, 4096), **kwargs)


def test_checkpointing_modes_order_the_activations(llama_7b):
    none = activation_bytes(llama_7b, training())
    full = activation_bytes(llama_7b, training(activation_checkpointing=True))
    selective = activation_bytes(
        llama_7b, training(activation_checkpointing=True, activation_checkpointing_mode="selective")
    )
    every_2 = activation_bytes(llama_7b, training(activation_checkpointing=True, activation_checkpointing_mode=2))
    assert full < selective < none and full < every_2 < none
    # k = 1 is every block: full; "none" turns it off whatever activation_checkpointing says
    assert activation_bytes(llama_7b, training(activation_checkpointing=True, activation_checkpointing_mode=1)) == full
    assert (
        activation_bytes(llama_7b, training(activation_checkpointing=True, activation_checkpointing_mode="none"))
        == none
    )
    # every 2nd of 32 blocks checkpointed: half the layers keep everything
    layer = 4096 * layer_activation_bytes_per_token(llama_7b.dims, 2)
    assert none - every_2 == pytest.approx(16 * (layer - 4096 * 4096 * 2) - layer, rel=1e-9)


def test_sequence_parallel_splits_every_layer_activation_by_t(llama_7b):
    """With SP all of a layer's activations are sharded, T ways (the theory #25 states for the replicated region)."""
    for tensor in (2, 4, 8):
        sharded = layer_activation_bytes_per_token(llama_7b.dims, 2, tensor, outside_divisor=tensor)
        assert sharded == pytest.approx(layer_activation_bytes_per_token(llama_7b.dims, 2) / tensor, rel=1e-12)
    plain = activation_bytes(llama_7b, training(), 4)
    assert activation_bytes(llama_7b, training(sequence_parallel=True), 4) < plain
    assert activation_bytes(llama_7b, training(sequence_parallel=True), 1) == activation_bytes(llama_7b, training(), 1)


def test_loss_parallel_shards_the_logits_and_drops_their_gather(llama_7b):
    logits_and_loss = 4096 * 32000 * (2 + 8)  # bf16 logits, fp32 log-probabilities and their gradient
    plain, parallel = (activation_bytes(llama_7b, training(loss_parallel=flag), 4) for flag in (False, True))
    assert plain - parallel == pytest.approx(logits_and_loss * 3 / 4, rel=1e-9)
    layout = Topology(1, 4, 4, 4)
    gathered = traffic_per_step(llama_7b, training(), layout).intra_by_dim["tensor"]
    sharded = traffic_per_step(llama_7b, training(loss_parallel=True), layout).intra_by_dim["tensor"]
    assert gathered - sharded == pytest.approx(3 / 4 * 4096 * 32000 * 2, rel=1e-9)  # one ring all-gather of logits


def test_selective_checkpointing_recomputes_no_collective(llama_7b):
    layout = Topology(1, 4, 4, 4)
    tensor = {}
    for mode in ("none", "selective", "full"):
        chosen = training(activation_checkpointing=mode != "none", activation_checkpointing_mode=mode)
        tensor[mode] = traffic_per_step(llama_7b, chosen, layout).intra_by_dim["tensor"]
    assert tensor["none"] == tensor["selective"] < tensor["full"]


@pytest.mark.parametrize("mode", ["partial", 0, -1, True])
def test_unknown_mode_says_what_is_accepted(mode):
    with pytest.raises(ValueError, match="choose one of none, full, selective or a positive int k"):
        training(activation_checkpointing=True, activation_checkpointing_mode=mode)
