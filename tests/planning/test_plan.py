"""The planner against hand computation from the formulas in docs/concepts.md, and against the topology's rules."""

import contextlib
from pathlib import Path

import pytest

from fabric_hsdp.planning import (
    Cluster,
    NoLayoutFitsError,
    Training,
    Workload,
    activation_bytes,
    candidate_layouts,
    choose_layout,
    load_model_shape,
    make_plan,
    memory_per_device,
    model_shape,
    traffic_per_step,
)
from fabric_hsdp.planning.plan import recommended_layout
from fabric_hsdp.planning.step import with_headroom
from fabric_hsdp.topology import Topology

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plan"
GB = 10**9


def llama_counts(hidden: int, layers: int, inner: int, vocab: int) -> tuple[int, int, int]:
    """(root unit, one layer, all) parameter counts of an untied Llama with as many key/value heads as heads."""
    root = 2 * vocab * hidden + hidden  # embeddings, output head, final norm
    layer = 4 * hidden * hidden + 3 * hidden * inner + 2 * hidden  # q, k, v, o; gate, up, down; two norms
    return root, layer, root + layers * layer


def expected_total(hidden, layers, inner, vocab, shard, tokens, tensors):
    """Peak bytes per device for bf16-mixed AdamW without activation checkpointing, from the docs' formulas."""
    root, layer, total = llama_counts(hidden, layers, inner, vocab)
    parameters = gradients = 4 * total / shard  # fp32 master shards and fp32 gradients
    optimizer = 8 * total / shard + 4 * tensors  # two fp32 moments, a 4-byte step per tensor
    head = vocab * hidden + hidden  # the final norm and output head: one unit (the embedding is its own, freed)
    per_layer_token = 2 * (2 * hidden + 5 * hidden + 2 * hidden + 4 * inner) + 2 * hidden * 4
    kept = layers * tokens * per_layer_token
    loss, logits = tokens * vocab * (2 + 8), tokens * vocab * 2
    # the loss and head backward: the head gathered, its bf16 gradient, the last layer prefetched
    loss_backward = kept + loss + 2 * (head + layer) + 2 * head
    # the head's reduce-scatter: its weights freed, its bf16 gradient and fp32 copy, the bf16 logits still alive
    head_reduce = kept + logits + 2 * layer + (2 + 4) * head
    # the last block's backward: it and the prefetched layer gathered, its bf16 gradients, the head's fp32
    # reduce-scatter input (the measured peak of the 70B answer, docs/dryrun.md)
    last_block = kept + logits + 2 * 2 * layer + 2 * layer + 4 * max(head, layer)
    end_of_backward = gradients + root * (2 + 2 + 4)
    optimizer_step = gradients + parameters
    return parameters + optimizer + max(loss_backward, head_reduce, last_block, end_of_backward, optimizer_step)


def test_worked_example_65b_on_two_8x80gb_nodes_fits_nowhere():
    """The seed report: LLaMA 65B, two 8 x 80 GB nodes, bf16-mixed, AdamW, 4096-token sequences."""
    model = load_model_shape(EXAMPLES / "llama-65b.json")
    hidden, layers, inner, vocab = 8192, 80, 22016, 32000
    root, layer, total = llama_counts(hidden, layers, inner, vocab)
    assert model.num_parameters == total == 65_285_660_672
    tensors = 3 + 9 * layers
    training = Training("bf16-mixed", Workload(micro_batch_size=1, seq_len=4096, optimizer="adamw"))
    # as the report ran it: no recompute, the weights resharded (the planner weighs neither here)
    plan = make_plan(
        model, Cluster(2, 8, "80GB"), training, tensor_parallel_sizes=[1], weigh_recompute=False, weigh_gathering=False
    )
    rows = {row.layout.shard_size: row for row in plan.rows}
    assert sorted(rows) == [1, 2, 4, 8, 16]
    for shard in (8, 16):  # every dim divides by 8 and 16: no padding
        expected = expected_total(hidden, layers, inner, vocab, shard, 4096, tensors)
        assert rows[shard].memory.total == pytest.approx(expected, rel=1e-9)
    # the state alone: 16 bytes per parameter over 8 or 16 ranks
    assert rows[16].memory.parameters + rows[16].memory.gradients + rows[16].memory.optimizer == pytest.approx(
        16 * total / 16 + 4 * tensors
    )
    # one node per shard group: only the gradient all-reduce (fp32) of the two replicas crosses: 2 (R-1)/R P 4
    assert rows[8].traffic.inter_node_bytes == pytest.approx(2 * (2 - 1) / 2 * total * 4)
    # FSDP over both nodes: each node's ring edge carries 15/16 of the bf16 gathers (forward; backward for the
    # layers, the root stays gathered) and of the fp32 reduce-scatter
    fsdp = 15 / 16 * (2 * total + 2 * layers * layer + 4 * total)
    assert rows[16].traffic.inter_node_bytes == pytest.approx(fsdp)
    assert not any(row.fits for row in plan.rows) and plan.recommended is None


def test_worked_example_65b_error_lists_what_would_fit():
    model = load_model_shape(EXAMPLES / "llama-65b.json")
    training = Training("bf16-mixed", Workload(1, 4096))
    # the report's run, without recompute or gathering weighed
    unweighed = make_plan(
        model, Cluster(2, 8, "80GB"), training, tensor_parallel_sizes=[1], weigh_recompute=False, weigh_gathering=False
    )
    with pytest.raises(NoLayoutFitsError) as caught:
        recommended_layout(unweighed, 1)
    message = str(caught.value)
    assert "no layout fits 72.0 GB per device (80.0 GB less a 10% safety margin)" in message
    smallest = min(caught.value.plan.rows, key=lambda row: row.memory.total)
    assert smallest.layout.shard_size == 16
    assert f"the smallest total is {smallest.memory.total / GB:.1f} GB per device with shard_size=16" in message
    labels = [option.split(" (")[0] for option in caught.value.options]
    # Without activation checkpointing the planner's activations alone exceed the 72 GB, on every layout without TP
    # or CP: FSDP does not shard activations.
    hidden, layers, inner, vocab = 8192, 80, 22016, 32000
    per_layer = 4096 * (2 * (9 * hidden + 4 * inner) + 8 * hidden)
    activations = layers * per_layer + 4096 * vocab * (2 + 8)  # the layers', then the logits' and the loss's
    without_tp = [row for row in caught.value.plan.rows if row.layout.tensor_parallel_size == 1]
    assert without_tp and {row.memory.activations for row in without_tp} == {activations}
    assert activations > 72e9
    # Checkpointing alone on two nodes: the planner keeps the layer inputs, one layer's recompute and the loss, and
    # still no layout fits (the smallest total is above 72 GB).
    checkpointed = Training("bf16-mixed", Workload(1, 4096), activation_checkpointing=True)
    plan = make_plan(model, Cluster(2, 8, "80GB"), checkpointed, tensor_parallel_sizes=[1])
    kept = layers * 4096 * hidden * 2 + per_layer + 4096 * vocab * 10
    assert {row.memory.activations for row in plan.rows} == {kept}
    assert not any(row.fits for row in plan.rows) and min(row.memory.total for row in plan.rows) > 72e9
    # context parallelism (#42), weighed where nothing fits without it, splits the activations FSDP does not: more
    # nodes, offload or bf16-true each fit with it, without recompute
    assert labels == ["4 nodes", "CPU offload", "precision bf16-true"]
    assert all("context_parallel_size=" in option for option in caught.value.options)
    # weighed (the default), recompute is the planner's own choice, not a change to suggest: each change alone fits
    # with full recompute
    with pytest.raises(NoLayoutFitsError) as weighed:
        choose_layout(model, Cluster(2, 8, "80GB"), training)
    labels = [option.split(" (")[0] for option in weighed.value.options]
    assert labels == ["3 nodes", "CPU offload", "precision bf16-true"]
    assert "mesh (1, 24), micro-batch 1 x 1 accumulation step, activation checkpointing on: 54.5 GB" in str(
        weighed.value
    )


def test_worked_example_7b_recommends_one_node_per_shard_group():
    model = load_model_shape(EXAMPLES / "llama-2-7b.json")
    hidden, layers, inner, vocab = 4096, 32, 11008, 32000
    _, _, total = llama_counts(hidden, layers, inner, vocab)
    training = Training("bf16-mixed", Workload(1, 4096))
    plan = make_plan(
        model, Cluster(2, 8, "80GB"), training, tensor_parallel_sizes=[1], weigh_recompute=False, weigh_gathering=False
    )
    chosen = plan.recommended
    assert chosen.layout.shard_size == 8 and chosen.layout.mesh_shape == (2, 8)
    assert chosen.memory.total == pytest.approx(expected_total(hidden, layers, inner, vocab, 8, 4096, 3 + 9 * layers))
    assert chosen.traffic.inter_node_bytes == pytest.approx(4 * total)  # 2 (R-1)/R P b_g with R = 2, b_g = 4
    assert "only the gradient all-reduce of each shard" in plan.reason
    fits = {row.layout.shard_size for row in plan.rows if row.fits}
    tensors = 3 + 9 * layers
    headroom = 0.25 * activation_bytes(model, training)  # what must fit counts the estimated activations 25 % over
    assert fits == {
        s for s in (1, 2, 4, 8, 16) if expected_total(hidden, layers, inner, vocab, s, 4096, tensors) + headroom <= 72e9
    }


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (2, 8), (3, 8), (4, 6), (1, 8), (5, 1)])
def test_layouts_are_exactly_what_the_topology_accepts(nodes, per_node):
    world = nodes * per_node
    accepted = set()
    for size in range(1, world + 1):
        with contextlib.suppress(ValueError):  # the sizes it rejects
            accepted.add(Topology.resolve(size, nodes, per_node, world).shard_size)
    layouts = candidate_layouts(nodes, per_node, [1])
    assert {layout.shard_size for layout in layouts} == accepted
    for layout in candidate_layouts(nodes, per_node):
        tensor = layout.tensor_parallel_size
        assert per_node % tensor == 0 and layout.shard_size % tensor == 0


def test_tensor_parallel_ranks_are_consecutive_and_inside_a_node():
    layout = Topology(num_nodes=2, ranks_per_node=8, shard_size=16, tensor_parallel_size=4)
    assert layout.mesh_shape == (1, 4, 4) and layout.mesh_dim_names == ("replicate", "shard", "tensor")
    assert layout.rank_groups("tensor") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.rank_groups("shard")[1] == [1, 5, 9, 13]
    # the topology's own coordinates agree with the groups: rank 9 is (r=0, s=2, t=1)
    assert layout.coordinates(9) == (0, 2, 1)
    assert Topology(2, 8, 8, 1).mesh_shape == (2, 8)
    assert Topology(2, 8, 8, 1).rank_groups("replicate")[3] == [3, 11]


def tiny(vocab=256, hidden=64, inner=96, layers=2, heads=4, kv_heads=2):
    head_dim = hidden // heads
    named = [
        ("embed.tok_embeddings.weight", (vocab, hidden)),
        ("norm.weight", (hidden,)),
        ("output.weight", (vocab, hidden)),
    ]
    for index in range(layers):
        prefix = f"layers.{index}"
        named += [
            (f"{prefix}.attention.wq.weight", (hidden, hidden)),
            (f"{prefix}.attention.wk.weight", (kv_heads * head_dim, hidden)),
            (f"{prefix}.attention.wv.weight", (kv_heads * head_dim, hidden)),
            (f"{prefix}.attention.wo.weight", (hidden, hidden)),
            (f"{prefix}.feed_forward.w1.weight", (inner, hidden)),
            (f"{prefix}.feed_forward.w2.weight", (hidden, inner)),
            (f"{prefix}.feed_forward.w3.weight", (inner, hidden)),
            (f"{prefix}.attention_norm.weight", (hidden,)),
        ]
    config = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    return model_shape(named, "tiny", config)


def test_tensor_parallel_splits_the_plan_and_replicates_norms():
    model = tiny()
    training = Training("32-true", Workload(optimizer="none"))
    plain = memory_per_device(model, training, fsdp_size=2, tensor_parallel_size=1)
    split = memory_per_device(model, training, fsdp_size=1, tensor_parallel_size=2)
    norms = 64 * 3  # final norm + one per layer: replicated over TP, so not halved
    # both hold 1/2 of the model, except that TP keeps whole norms: 4 bytes x half of each norm more
    assert split.parameters - plain.parameters == 4 * norms // 2
    assert model.dims.num_layers == 2 and model.dims.kv_size == 32 and model.dims.intermediate_size == 96


def test_tensor_parallel_sizes_the_model_cannot_take_are_skipped_with_the_reason():
    plan = make_plan(tiny(kv_heads=2), Cluster(1, 4, "80GB"), Training("32-true"))
    reasons = {(layout.shard_size, layout.tensor_parallel_size): why for layout, why in plan.skipped}
    assert reasons == {(4, 4): "tensor_parallel_size(4) does not divide num_key_value_heads(2)"}
    assert {(row.layout.shard_size, row.layout.tensor_parallel_size) for row in plan.rows} == {
        (1, 1),
        (2, 1),
        (2, 2),
        (4, 1),
        (4, 2),
    }


def test_padding_follows_fsdp2_chunks():
    model = model_shape([("layers.0.w", (10, 3)), ("head.weight", (7, 3))], "odd", None)
    memory = memory_per_device(
        model, Training("32-true", Workload(optimizer="none")), fsdp_size=4, tensor_parallel_size=1
    )
    assert memory.parameters == 4 * (3 * 3 + 2 * 3)  # ceil(10/4) = 3 rows, ceil(7/4) = 2 rows


def test_one_node_recommends_the_smallest_shard_group_that_fits():
    model = tiny()
    plan = make_plan(model, Cluster(1, 4, "80GB"), Training("32-true"))
    assert plan.recommended.layout.shard_size == 1 and plan.recommended.traffic.inter_node_bytes == 0
    # shard 2 fits (with the activation estimate's headroom), shard 1 does not
    budget = with_headroom(memory_per_device(model, Training("32-true"), 2, 1)).total / 0.9 + 1
    chosen = choose_layout(model, Cluster(1, 4, int(budget)), Training("32-true"))
    assert chosen.layout.shard_size == 2


def test_multi_node_prefers_a_whole_node_over_a_smaller_group_that_fits():
    """A group smaller than a node fits too, but its all-reduce over more replicas sends more between nodes."""
    plan = make_plan(tiny(), Cluster(2, 4, "80GB"), Training("32-true"), tensor_parallel_sizes=[1])
    by_size = {row.layout.shard_size: row.traffic.inter_node_bytes for row in plan.rows}
    assert by_size[4] < by_size[2] < by_size[1] and by_size[4] < by_size[8]
    assert plan.recommended.layout.shard_size == 4


def test_gloo_reduce_scatter_costs_an_all_reduce():
    model, training, layout = tiny(), Training("32-true"), Topology(2, 2, 4)
    nccl = traffic_per_step(model, training, layout, "nccl")
    gloo = traffic_per_step(model, training, layout, "gloo")
    assert gloo.inter_node_bytes > nccl.inter_node_bytes
    assert traffic_per_step(model, training, Topology(2, 2, 2), "gloo").by_dim["shard"] == 0


def test_planner_matches_the_comm_volume_benchmarks_closed_form():
    """benchmarks/comm_volume.py derives its theory per collective (and measured it within 0.6 %)."""
    import torch

    from benchmarks.comm_volume import model_config, planner_bytes, theory_bytes
    from examples.tiny_llama import Llama

    config = model_config(quick=True, millions=None)
    with torch.device("meta"):
        Llama(config)
    for reshard in (None, True):
        for mode in ("hsdp", "fsdp"):
            theory = sum(theory_bytes(mode, config, reshard_root=reshard is True).values())
            assert planner_bytes(mode, config, reshard, 1, 32) == pytest.approx(theory, rel=1e-12)
