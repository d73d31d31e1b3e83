"""The planner's context dim (#42): the keys and values context parallelism gathers, written out by hand for
Llama-3(.1)-8B, the activations of a rank's ``s / C`` tokens, and where the plan and shard_size="auto" choose it
(docs/concepts.md shows the 128k plan)."""

import pytest
import torch

from examples.tiny_llama import Llama, LlamaConfig
from fabric_hsdp.planning import (
    Cluster,
    NoLayoutFitsError,
    Training,
    Workload,
    activation_bytes,
    load_model_shape,
    make_plan,
)
from fabric_hsdp.planning.auto import auto_topology
from fabric_hsdp.planning.context import key_value_bytes
from fabric_hsdp.planning.memory import memory_per_device
from fabric_hsdp.planning.step import with_headroom
from fabric_hsdp.planning.traffic import traffic_per_step
from fabric_hsdp.topology import CONTEXT_DIM, Topology

LONG = 131072  # 128k tokens


@pytest.fixture(scope="module")
def llama3_8b():
    return load_model_shape("Llama-3-8B")  # Llama-3.1-8B's shapes: 32 layers, 8 key/value heads of 128


def test_llama31_8b_gathers_403_mb_of_keys_and_values_per_layer_forward_at_128k_over_4_ranks(llama3_8b):
    """Llama-3.1-8B, s = 131072, C = 4, bf16 (b_a = 2): n_kv d_h = 8 x 128 = 1024, so one layer's K is
    s n_kv d_h b_a = 131072 x 1024 x 2 = 268,435,456 bytes, K and V 536,870,912. A ring all-gather over C ranks
    sends (C - 1) / C of it per rank: 3/4 x 536,870,912 = 402,653,184 bytes = 403 MB per layer forward (the brief's
    figure); the backward reduce-scatter of their gradients the same. Without recompute, per micro-batch:
    32 layers x 2 x 402,653,184 = 25.77 GB in the context group (inside a node); full recompute gathers again: x 3/2.
    """
    training = Training("bf16-mixed", Workload(1, LONG))
    assert key_value_bytes(llama3_8b, training) * 3 / 4 == 402_653_184
    layout = Topology.resolve(8, 2, 8, 16, context_parallel_size=4)
    traffic = traffic_per_step(llama3_8b, training, layout)
    assert traffic.intra_by_dim[CONTEXT_DIM] == 32 * 2 * 402_653_184
    assert traffic.by_dim[CONTEXT_DIM] == 0  # the context group is consecutive ranks of one node
    recomputed = Training("bf16-mixed", Workload(1, LONG), activation_checkpointing=True)
    assert traffic_per_step(llama3_8b, recomputed, layout).intra_by_dim[CONTEXT_DIM] == 32 * 3 * 402_653_184
    gloo = traffic_per_step(llama3_8b, training, layout, "gloo")  # the reduce-scatter as an all-reduce
    assert gloo.intra_by_dim[CONTEXT_DIM] == 32 * 3 * 402_653_184


@pytest.mark.parametrize(
    ("mode", "kept_layers", "whole_layers"), [("none", 32, 32), ("selective", 32, 1), ("full", 1, 1)]
)
def test_activations_are_those_of_seq_len_over_c_tokens_plus_the_gathered_keys_and_values(
    llama3_8b, mode, kept_layers, whole_layers
):
    """A rank of a context group of 8 keeps the activations of 131072 / 8 = 16384 tokens, plus one layer's gathered
    K and V (2 s n_kv d_h b_a = 536,870,912 bytes) per layer that keeps it: all 32 without recompute (the attention
    saves them) and under selective recompute (the all-gather outputs are saved), the recomputed one under full.
    A layer that keeps everything (all 32 without recompute, the recomputed one otherwise) keeps a second copy of
    the attention output instead of its local K and V: 16384 x (4096 - 2 x 1024) x 2 = 67,108,864 bytes."""
    training = Training("bf16-mixed", Workload(1, LONG), mode != "none", activation_checkpointing_mode=mode)
    short = Training("bf16-mixed", Workload(1, LONG // 8), mode != "none", activation_checkpointing_mode=mode)
    split = activation_bytes(llama3_8b, training, 1, 8)
    assert split == activation_bytes(llama3_8b, short) + kept_layers * 536_870_912 + whole_layers * 67_108_864
    assert split < activation_bytes(llama3_8b, training) / 4
    # the sharded state is the shard group's as without context parallelism
    with_cp, without = memory_per_device(llama3_8b, training, 8, 1, 1, 8), memory_per_device(llama3_8b, training, 8, 1)
    assert (with_cp.parameters, with_cp.optimizer, with_cp.gathered) == (
        without.parameters, without.optimizer, without.gathered
    )  # fmt: skip


def test_the_128k_plan_proposes_context_parallelism_where_nothing_fits_without_it(llama3_8b):
    """Llama-3-8B on 2 x 8 x 80 GB at 128k tokens: without context parallelism the smallest total is 218 GB
    (TP 8, full recompute); with it the plan recommends CP 8 in one node, full recompute, under 72 GB usable."""
    training = Training("bf16-mixed", Workload(1, LONG))
    without = make_plan(llama3_8b, Cluster(2, 8, "80GB"), training, context_parallel_sizes=[1])
    assert without.recommended is None
    assert min(row.memory.total for row in without.rows) > 200e9
    plan = make_plan(llama3_8b, Cluster(2, 8, "80GB"), training)
    chosen = plan.recommended
    assert chosen is not None and chosen.layout.context_parallel_size == 8 and chosen.layout.shard_size == 8
    assert chosen.data_parallel_size == 2 and chosen.step.accumulation_steps == 8  # 16 sequences over 2 groups
    assert chosen.total_with_headroom <= 72e9 and chosen.training.checkpointing == "full"
    # a rank computes 1/8 of its group's micro-batch: the same FLOPs per step as one sequence per rank
    assert chosen.throughput.compute_seconds == pytest.approx(without.rows[0].throughput.compute_seconds, rel=1e-9)
    # at 2k tokens something fits without it: not weighed
    short = make_plan(llama3_8b, Cluster(2, 8, "80GB"), Training("bf16-mixed", Workload(1, 2048)))
    assert {row.layout.context_parallel_size for row in short.rows} == {1}


def test_a_sequence_length_not_divisible_by_2c_is_skipped_with_the_reason(llama3_8b):
    """131080 tokens divide by 8 (2 x 4) but not by 16 (2 x 8): CP 4 is planned, CP 8 skipped."""
    training = Training("bf16-mixed", Workload(1, 131080))
    plan = make_plan(llama3_8b, Cluster(2, 8, "80GB"), training, context_parallel_sizes=[4, 8])
    assert {row.layout.context_parallel_size for row in plan.rows} == {4}
    reasons = {why for layout, why in plan.skipped if layout.context_parallel_size == 8}
    assert reasons == {
        "context_parallel_size(8) needs the sequence length (131080) divisible by 2 x 8 = 16 (each rank takes a head"
        " and a tail chunk of every sequence); pad the sequences"
    }


def test_auto_returns_context_parallelism_where_nothing_fits_without_it():
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=16))
    kwargs = dict(num_nodes=2, ranks_per_node=2, tensor_parallel_size=1, tensor_parallel_plan="auto", backend="gloo")
    training = Training("32-true", Workload(2, 8))
    topology, plan = auto_topology(model, 10**9, training=training, **kwargs)
    assert topology.context_parallel_size == 1  # it fits without
    shape = plan.model
    world = with_headroom(memory_per_device(shape, training, 4, 1)).total
    split = with_headroom(memory_per_device(shape, training, 4, 1, 1, 2)).total
    assert split < world
    budget = int(world / 0.9) - 1  # nothing fits without context parallelism; shard 4 with CP 2 does
    topology, plan = auto_topology(model, budget, training=training, **kwargs)
    assert (topology.shard_size, topology.context_parallel_size, topology.mesh_shape) == (4, 2, (1, 2, 2))
    assert topology.data_parallel_size == 2
    with pytest.raises(NoLayoutFitsError, match="no layout fits"):
        auto_topology(model, budget, training=training, context_parallel_size=1, **kwargs)
