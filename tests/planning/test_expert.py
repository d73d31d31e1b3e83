"""The layouts an expert picks for Llama-3 8B and 70B on 2 x 8 and 16 x 8 x 80 GB, with a slow and a fast inter-node
fabric, from both config sources (issue #34), and torchtitan's published Llama 3 8B/70B/405B recipes (issue #45).

The expected answers are written as an expert gives them, not computed by the test, each with its reasoning beside
it. Every layout runs the same global batch (issue #34: the rows used to run different batches, 262,144 down to
32,768 tokens per step, and the per-token rule could never pick TP), with the micro-batch and recompute the memory
allows; each row weighs no, selective and full recompute and the weights kept gathered for the step (#45). Without
bandwidths the planner assumes an H100 node's (3200 Gbit/s between nodes, NVLink 450 GB/s). The MoE rows (Qwen3-MoE)
follow the Llama ones.
"""

import json

import pytest

from fabric_hsdp.planning import Cluster, Training, Workload, load_model_shape, make_plan
from fabric_hsdp.planning.report import plan_dict, plan_table

# the published configs (meta-llama/Meta-Llama-3-8B and -70B config.json, the keys the shapes need)
LLAMA_3 = {
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32},
    "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80},
}
LITGPT_NAMES = {"8B": "Llama-3-8B", "70B": "Llama-3-70B"}
BANDWIDTHS = {"inter_node_bandwidth": "400Gbit/s", "intra_node_bandwidth": "450GB/s"}

FABRICS = {
    # one 400 Gbit/s NIC per node: FSDP's gathers of a 70B outrun the compute several times over
    "slow": {"inter_node_bandwidth": "400Gbit/s", "intra_node_bandwidth": "450GB/s"},
    # one 400 Gbit/s NIC per GPU (DGX H100 with NDR): the gathers hide under the compute
    "fast": {"inter_node_bandwidth": "3200Gbit/s", "intra_node_bandwidth": "450GB/s"},
    "no bandwidth given": {},
}

# (model, nodes, fabric) -> (shard_size, tensor_parallel_size, mesh, micro-batch, accumulation steps, checkpointing)
# or None (nothing fits). bf16-mixed AdamW, sequences of 2048, activation checkpointing allowed, the planner's global
# batch (one sequence per GPU: 16 on 2 x 8, 128 on 16 x 8). Each answer with the reasoning an expert gives for it.
EXPERT_TABLE = {
    # An 8B's state is 16 B/param = 128 GB: one node holds a copy (16 GB per GPU), so HSDP with a copy per node
    # keeps the gathers on NVLink and only the gradient all-reduce (of 1/8 of the model per GPU) crosses the slow
    # link; no TP (the 2048-token micro-batch fits, and TP only adds collectives on every layer), no recompute.
    ("8B", 2, "slow"): (8, 1, (2, 8), 1, 1, "none"),
    ("8B", 16, "slow"): (8, 1, (16, 8), 1, 1, "none"),
    # Without bandwidths (the planner assumes an H100 node's fabric, 3200 Gbit/s): every shard group that fits is
    # compute-bound at 250 ms, and with a bandwidth assumed the near-tie goes to the fewest bytes between nodes, a
    # copy per node, as before #45 (when no bandwidth meant ranking by bytes).
    ("8B", 2, "no bandwidth given"): (8, 1, (2, 8), 1, 1, "none"),
    ("8B", 16, "no bandwidth given"): (8, 1, (16, 8), 1, 1, "none"),
    # With a fast fabric the gradient all-reduce hides under the compute whatever the shard group, so the smallest
    # group that fits (half a node: 32 GB of state per GPU) gathers over 4 GPUs instead of 8; still no TP.
    ("8B", 2, "fast"): (4, 1, (4, 4), 1, 1, "none"),
    ("8B", 16, "fast"): (4, 1, (32, 4), 1, 1, "none"),
    # A 70B's 16 B/param over 16 GPUs is 70.6 GB before any activation: nothing fits 72 GB usable, any fabric.
    ("70B", 2, "slow"): None,
    ("70B", 2, "fast"): None,
    # Slow fabric: every layout sends ~the model's bytes per node per gather (TP does not cut a node's share), so
    # the step is the fabric's (11.1 s against 2.2-3.0 s of compute): one micro-batch per step is the floor. Without
    # TP a sequence fits with selective recompute (66.9 of 72.0 GB), which recomputes no matmul: 11.12 s, the same
    # as full recompute and as TP 2-8 with full recompute (11.10-11.11 s, within 2 %); the least TP, then the least
    # recompute. FSDP over all ranks, no TP, selective (#45; #34 had full: selective was not weighed).
    ("70B", 16, "slow"): (128, 1, (1, 128), 1, 1, "selective"),
    # Without bandwidths the planner assumes an H100 node's fabric (3200 Gbit/s): the fast row's answer.
    ("70B", 16, "no bandwidth given"): (128, 1, (1, 128), 1, 1, "selective"),
    # Fast fabric: selective recompute lets one sequence fit without TP, and since the peak is modelled as the
    # counted dry run found it (the last block's backward, not everything summed at the start of backward: 50.2
    # against 57.8 GB over 128 ranks, docs/dryrun.md) also over a shard group of 64 (65.4 of 72.0 GB with the
    # headroom; it was ~74 GB). Both are compute-bound at 2.24 s (one gather per step: 587 GB between nodes in
    # 1.47 s with a copy per 8 nodes, 556 GB in 1.39 s over all 128), so the near-tie goes to the smallest shard
    # group, as for the 8B. #34's answer, TP 2 without recompute, needs two micro-batches (two gathers: 1.10 TB in
    # 2.76 s over the same compute): 2.82 s, 1.26x slower.
    ("70B", 16, "fast"): (64, 1, (2, 64), 1, 1, "selective"),
}

# torchtitan's Llama 3 70B global batch (64 sequences of 8192) at 16 x 8, TP with sequence and loss parallel. 64
# sequences cannot split over 128 data-parallel ranks: TP is needed at all.
TORCHTITAN = {
    # Fast fabric: TP 4 splits the activations 4 ways and selective recompute keeps a sequence within 72 GB: two
    # micro-batches per step, 5.34 s (compute 4.99 s, inter-node 2.71 s). #34's TP 8 without recompute runs four
    # micro-batches (four gathers) and more TP collectives. HSDP with a copy per 8 nodes.
    "fast": (64, 4, (2, 16, 4), 1, 2, "selective"),
    # Slow fabric: the gathers are the step, so the fewest micro-batches per step: TP 2 (the least TP that gives
    # each data-parallel rank a whole sequence) with recompute, one gather per step.
    "slow": (128, 2, (1, 64, 2), 1, 1, "full"),
}


# torchtitan's published Llama 3 recipes (torchtitan/models/llama3/train_configs/*.toml, read at the commit before
# #2386 moved them into Python; all at seq_len 8192, global batch = local_batch_size x data-parallel ranks, no
# accumulation, TP with torchtitan's sequence and loss parallel). Each: the planner's answer at the recipe's cluster
# and global batch, and the recipe's own layout as the planner estimates it. A100s: 312 TFLOP/s bf16, NVLink 300 GB/s
# per GPU, 8 x 200 Gbit/s HDR per node (DGX A100); H100s: the planner's typical node.
# -> (planner: shard_size, TP, mesh, micro-batch, accumulation, checkpointing; the recipe's estimated step time over
#    the planner's)
TORCHTITAN_RECIPES = {
    # llama3_8b.toml, "64 A100 GPUs": FSDP over all 64, TP 1, local batch 1, selective AC. Matched but for the shard
    # group: a sequence of 8192 fits only with recompute (selective, as the recipe), one micro-batch per step; both
    # are compute-bound at 3.80 s (FSDP-64 sends 0.31 s between nodes, HSDP 0.28 s), so the near-tie goes to the
    # smallest shard group, HSDP with a copy per node (its gathers stay on NVLink).
    "8B": (("Llama-3-8B", 8, "A100", 64, 1, 64, 1, "selective"), ((8, 1, (8, 8), 1, 1, "selective"), 1.00)),
    # llama3_70b.toml, "64 A100 GPUs": TP 8, FSDP 8, local batch 8, full AC. Explained: the recipe fits (45.9 GB)
    # but full AC recomputes every layer's forward (42.0 s of compute, 45.5 s per step); TP 4 over FSDP 16 fits a
    # sequence with selective recompute (62.4 GB) in four micro-batches: 31.6 s of compute, 32.7 s per step, 1.39x
    # faster by the estimates (torchtitan's selective "op" policy recomputes every other matmul, not counted here).
    "70B": (("Llama-3-70B", 8, "A100", 64, 8, 8, 8, "full"), ((64, 4, (1, 16, 4), 1, 4, "selective"), 1.39)),
    # llama3_405b.toml, "128 H100 GPUs": TP 8, FSDP 16, local batch 2, full AC (and float8, compile, async TP,
    # which the planner does not model). Matched: only TP 8 fits at all, and only with full recompute (71.5 of 72.0
    # GB at micro-batch 2); compute-bound, 20.5 s per step.
    "405B": (("405B", 16, "H100", 32, 8, 16, 2, "full"), ((128, 8, (1, 16, 8), 2, 1, "full"), 1.00)),
}
HARDWARE = {
    "A100": {"inter_node_bandwidth": "1600Gbit/s", "intra_node_bandwidth": "300GB/s", "device_flops": "312TFLOPS"},
    "H100": {"inter_node_bandwidth": "3200Gbit/s", "intra_node_bandwidth": "450GB/s", "device_flops": "989TFLOPS"},
}
LLAMA_3_1_405B = {"hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
                  "num_hidden_layers": 126, "max_position_embeddings": 131072}  # fmt: skip


# Qwen3-MoE (the published configs: 30B-A3B, 235B-A22B), same clusters and training, without expert parallelism
# (expert_parallel_sizes=[1]; tests/planning/test_expert_parallel_plan.py has the answers with it). The planner
# refuses TP on experts, so the choices are the shard group and recompute.
MOE_EXPERT_TABLE = {
    # 30.5 B parameters at 16 B each: 61 GB of state per GPU in one node's group leaves no room for the gathered MoE
    # layers (each all 128 experts) and activations within 72 GB usable, even with recompute; over both nodes it is
    # 30.5 GB, and a sequence fits without recompute. Any fabric: the group must span the nodes.
    ("30B-A3B", 2, "slow"): (16, 1, (1, 16), 1, 1, "none"),
    ("30B-A3B", 2, "fast"): (16, 1, (1, 16), 1, 1, "none"),
    # On 16 nodes a two-node group (mesh (8, 16)) would fit too, but a ring gather crossing nodes sends about the
    # model's bytes per node whatever the group spans, and the replicas add an all-reduce: all ranks, no recompute.
    ("30B-A3B", 16, "slow"): (128, 1, (1, 128), 1, 1, "none"),
    ("30B-A3B", 16, "fast"): (128, 1, (1, 128), 1, 1, "none"),
    # 235 B parameters: 3.8 TB of state, 235 GB per GPU over 16: nothing fits on 2 nodes.
    ("235B-A22B", 2, "slow"): None,
    ("235B-A22B", 2, "fast"): None,
    # Over 128 GPUs 29 GB of state each, but a layer is ~2.5 B parameters (all 128 experts) and a sequence's
    # activations through 94 such layers, kept for backward, take ~78 GB alone: recompute, all ranks.
    ("235B-A22B", 16, "slow"): (128, 1, (1, 128), 1, 1, "full"),
    ("235B-A22B", 16, "fast"): (128, 1, (1, 128), 1, 1, "full"),
}
QWEN3_MOE = {
    "30B-A3B": {"hidden_size": 2048, "num_hidden_layers": 48, "moe_intermediate_size": 768, "intermediate_size": 6144,
                "num_attention_heads": 32},
    "235B-A22B": {"hidden_size": 4096, "num_hidden_layers": 94, "moe_intermediate_size": 1536,
                  "intermediate_size": 12288, "num_attention_heads": 64},
}  # fmt: skip


def answer(plan):
    chosen = plan.recommended
    if chosen is None:
        return None
    layout, step = chosen.layout, chosen.step
    shape = (layout.shard_size, layout.tensor_parallel_size, layout.mesh_shape)
    return (*shape, step.micro_batch_size, step.accumulation_steps, chosen.training.checkpointing)


def transformers_config(tmp_path_factory, size):
    directory = tmp_path_factory.mktemp(f"llama-3-{size.lower()}")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 8,
              "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
              "tie_word_embeddings": False, **LLAMA_3[size]}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Both sources of each size, built once (on the meta device)."""
    return {
        (size, source): load_model_shape(
            transformers_config(tmp_path_factory, size) if source == "transformers" else LITGPT_NAMES[size]
        )
        for size in LLAMA_3
        for source in ("transformers", "litgpt")
    }


@pytest.mark.parametrize("source", ["transformers", "litgpt"])
@pytest.mark.parametrize(("size", "nodes", "fabric"), list(EXPERT_TABLE))
def test_the_recommendation_is_the_experts(shapes, source, size, nodes, fabric):
    model = shapes[(size, source)]
    assert model.num_parameters == {"8B": 8_030_261_248, "70B": 70_553_706_496}[size]
    training = Training("bf16-mixed", Workload(1, 2048), activation_checkpointing=True)
    plan = make_plan(model, Cluster(nodes, 8, "80GB", **FABRICS[fabric]), training)
    assert answer(plan) == EXPERT_TABLE[(size, nodes, fabric)]


@pytest.mark.parametrize("fabric", list(TORCHTITAN))
def test_torchtitans_70b_recipe_at_its_global_batch(shapes, fabric):
    training = Training("bf16-mixed", Workload(1, 8192), True, sequence_parallel=True, loss_parallel=True)
    plan = make_plan(
        shapes[("70B", "litgpt")], Cluster(16, 8, "80GB", **FABRICS[fabric]), training, global_batch_size=64
    )
    assert answer(plan) == TORCHTITAN[fabric]
    skipped = {layout.tensor_parallel_size for layout, _ in plan.skipped}
    assert skipped == {1} and "global batch of 64 sequences does not split over its 128" in plan.skipped[0][1]


def test_every_row_runs_the_one_stated_global_batch(shapes):
    """Issue #34: the rows ran 262,144 down to 32,768 tokens per step; now every row runs the same global batch."""
    plan = make_plan(shapes[("70B", "litgpt")], Cluster(16, 8, "80GB"), Training("bf16-mixed", Workload(1, 2048)))
    assert plan.global_batch_size == 128 and not plan.global_batch_given
    for row in plan.rows:
        assert row.step.micro_batch_size * row.step.accumulation_steps * row.data_parallel_size == 128
        assert row.throughput.tokens_per_step == 262_144
    table = plan_table(plan)
    assert (
        "batch:    128 sequences = 262,144 tokens per optimizer step, every layout (the planner's: 128 devices" in table
    )
    training = Training("bf16-mixed", Workload(1, 2048))
    given = make_plan(shapes[("70B", "litgpt")], Cluster(16, 8, "80GB"), training, global_batch_size=512)
    assert {row.throughput.tokens_per_step for row in given.rows} == {512 * 2048} and given.global_batch_given


def test_memory_freed_by_tensor_parallelism_buys_micro_batch_and_fewer_recomputes(shapes):
    training = Training("bf16-mixed", Workload(1, 2048), activation_checkpointing=True)
    plan = make_plan(shapes[("70B", "litgpt")], Cluster(16, 8, "80GB", **FABRICS["fast"]), training)
    rows = {(row.layout.shard_size, row.layout.tensor_parallel_size): row for row in plan.rows}
    # TP 1 needs recompute to fit one sequence (selective does); TP 2 fits both of its data-parallel rank's
    # sequences in one micro-batch with selective (67.3 GB with the headroom): one gather per step, 2.30 s against
    # 2.82 s for two micro-batches without recompute
    assert rows[(128, 1)].training.checkpointing == "selective" and rows[(128, 2)].training.checkpointing == "selective"
    assert (rows[(128, 2)].step.micro_batch_size, rows[(128, 2)].step.accumulation_steps) == (2, 1)
    # TP 8's 8 sequences per data-parallel rank run as micro-batches larger than 1
    assert rows[(128, 8)].step.micro_batch_size > 1


def test_headroom_for_the_estimated_activations(shapes):
    """Issue #34: micro-batch 4 x 4096 with AC picked a layout at 70.7 of 72.0 GB on an activation estimate."""
    training = Training("bf16-mixed", Workload(4, 4096), activation_checkpointing=True)
    plan = make_plan(shapes[("70B", "litgpt")], Cluster(16, 8, "80GB"), training)
    chosen = plan.recommended
    assert chosen.total_with_headroom <= plan.usable_memory
    assert chosen.total_with_headroom >= chosen.memory.total + chosen.memory.activations // 5
    # the old choice, FSDP over all ranks with the whole micro-batch of 4, was 70.7 GB summed at the start of
    # backward; at the peak the counted dry run found (the last block's backward) it is 55.0 GB, 65.6 GB with the
    # headroom: it fits, and the headroom is what the fit is judged with
    no_tp = next(row for row in plan.rows if (row.layout.shard_size, row.layout.tensor_parallel_size) == (128, 1))
    assert (no_tp.step.micro_batch_size, no_tp.step.accumulation_steps) == (4, 1)
    assert no_tp.total_with_headroom <= plan.usable_memory
    assert "the estimated activations counted 25% over" in plan.reason


def test_the_output_says_why_the_winner_won(shapes):
    training = Training("bf16-mixed", Workload(1, 2048), activation_checkpointing=True)
    plan = make_plan(shapes[("70B", "litgpt")], Cluster(16, 8, "80GB", **FABRICS["fast"]), training)
    reason = plan.reason
    assert reason.startswith(
        "shard_size=64 (8 nodes), mesh (2, 64), micro-batch 1 x 1 accumulation step, activation checkpointing"
        " selective, fits (65.4 GB of 72.0 GB usable"
    )
    assert "2.24 s per step (~116,913 tokens/s, MFU ~40%), compute-bound (compute 2.24 s, inter-node traffic" in reason
    # the lever that won, by how much, against the best without it
    assert (
        "Lever: selective activation checkpointing, 1.26x faster than the best without it (shard_size=128 (all"
        " ranks), tensor_parallel_size=2, mesh (1, 64, 2), micro-batch 1 x 2 accumulation steps, activation"
        " checkpointing off, 2.82 s per step)"
    ) in reason
    # the runner-up: the best other layout, its figure and its ratio (FSDP over all ranks, a near-tie)
    assert (
        "Runner-up: shard_size=128 (all ranks), mesh (1, 128), micro-batch 1 x 1 accumulation step, activation"
        " checkpointing selective, 2.24 s per step (~116,913 tokens/s, MFU ~40%) (1.00x)"
    ) in reason
    # TP 2's best and what costs it
    assert (
        "tensor_parallel_size=2: at best shard_size=128 (all ranks), tensor_parallel_size=2, mesh (1, 64, 2),"
        " micro-batch 2 x 1 accumulation step, activation checkpointing selective, 2.30 s per step"
    ) in reason
    # the best of every other TP size, its figure against the winner's, and what costs it
    assert "tensor_parallel_size=4: at best shard_size=128 (all ranks), tensor_parallel_size=4" in reason
    assert "tensor_parallel_size=8: at best" in reason and "weights kept gathered for the step" in reason
    assert f"recommended: {reason}" in plan_table(plan)


def test_tensor_parallelism_runs_the_same_tokens_per_step(shapes):
    """Issue #20's trap (per step, TP 8 ran 4,096 tokens against HSDP's 32,768) is gone: both run the global batch,
    TP 8's data-parallel ranks with 8 sequences each."""
    plan = make_plan(shapes[("8B", "litgpt")], Cluster(2, 8, "80GB"), Training("bf16-mixed", Workload(1, 2048)))
    rows = {(row.layout.shard_size, row.layout.tensor_parallel_size): row for row in plan.rows}
    hsdp, tensor_parallel = rows[(8, 1)], rows[(16, 8)]
    assert (hsdp.data_parallel_size, tensor_parallel.data_parallel_size) == (16, 2)
    assert (hsdp.throughput.tokens_per_step, tensor_parallel.throughput.tokens_per_step) == (32768, 32768)
    assert tensor_parallel.step.sequences_per_rank == 8
    assert hsdp.recommended and not tensor_parallel.recommended


def test_table_and_json_show_the_step_and_rates(shapes):
    model = shapes[("8B", "transformers")]
    plan = make_plan(model, Cluster(2, 8, "80GB", **BANDWIDTHS), Training("bf16-mixed", Workload(1, 2048)))
    document = json.loads(json.dumps(plan_dict(plan)))
    by_layout = {(entry["shard_size"], entry["tensor_parallel_size"]): entry for entry in document["layouts"]}
    assert (by_layout[(8, 1)]["data_parallel_size"], by_layout[(8, 1)]["tokens_per_step"]) == (16, 32768)
    assert (by_layout[(16, 8)]["data_parallel_size"], by_layout[(16, 8)]["tokens_per_step"]) == (2, 32768)
    entry = by_layout[(16, 8)]
    assert entry["micro_batch_size"] * entry["accumulation_steps"] == 8
    assert document["ranked_by"] == "seconds per step" and document["cluster"]["device_flops"] == 989e12
    assert (document["global_batch_size"], document["tokens_per_step"]) == (16, 32768)
    chosen = document["recommended"]
    assert 0 < chosen["mfu_estimate"] < document["cluster"]["compute_efficiency"]
    assert chosen["tokens_per_second_estimate"] == pytest.approx(32768 / chosen["step_seconds_estimate"])
    table = plan_table(plan)
    header = next(line for line in table.splitlines() if line.lstrip().startswith("shard"))
    for column in ("DP", "micro x acc.", "AC", "+headroom", "inter-node/token", "step time", "tokens/s", "MFU"):
        assert column in header
    marked = next(line for line in table.splitlines() if line.startswith("->")).split()
    assert marked[1:11] == ["8", "1", "1", "1", "2x8", "16", "1", "x", "1", "off"]
    assert "989 TFLOP/s per device (assumed: H100 dense bf16; pass --device_flops) at 40% efficiency" in table


def test_shard_size_auto_ranks_as_the_plan_does():
    """The strategy's "auto" goes through the same ranking: the 8B module on 2 x 8 with 80 GB gets mesh (2, 8)."""
    import torch
    from litgpt import Config
    from litgpt.model import GPT

    from fabric_hsdp.planning.auto import auto_topology

    with torch.device("meta"):
        model = GPT(Config.from_name("Llama-3-8B"))
    kwargs = dict(num_nodes=2, ranks_per_node=8, tensor_parallel_size=1, tensor_parallel_plan="auto")
    kwargs.update(training=Training("bf16-mixed", Workload(1, 2048)), backend="nccl")
    topology, plan = auto_topology(model, 80 * 10**9, **kwargs)
    assert topology.mesh_shape == (2, 8) and plan.recommended.layout.shard_size == 8


@pytest.fixture(scope="module")
def moe_shapes():
    """Qwen3-MoE's published configs, built by transformers on the meta device."""
    from fabric_hsdp.planning.model import model_shape_of_module
    from tests.planning.test_moe_plan import QWEN3_30B, meta_model

    return {
        size: model_shape_of_module(meta_model("qwen3_moe", **{**QWEN3_30B, **QWEN3_MOE[size]})) for size in QWEN3_MOE
    }


@pytest.mark.parametrize(("size", "nodes", "fabric"), list(MOE_EXPERT_TABLE))
def test_the_recommendation_for_moe_models_is_the_experts(moe_shapes, size, nodes, fabric):
    model = moe_shapes[size]
    assert round(model.num_parameters / 1e9, 2) == {"30B-A3B": 30.53, "235B-A22B": 235.09}[size]  # published totals
    training = Training("bf16-mixed", Workload(1, 2048), activation_checkpointing=True)
    plan = make_plan(model, Cluster(nodes, 8, "80GB", **FABRICS[fabric]), training, expert_parallel_sizes=[1])
    assert answer(plan) == MOE_EXPERT_TABLE[(size, nodes, fabric)]


@pytest.mark.parametrize("recipe", list(TORCHTITAN_RECIPES))
def test_torchtitans_published_recipes(tmp_path, recipe):
    (model_name, nodes, hardware, batch, tensor, fsdp, micro, mode), (expected, ratio) = TORCHTITAN_RECIPES[recipe]
    if model_name == "405B":
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 8,
                  "vocab_size": 128256, "tie_word_embeddings": False, **LLAMA_3_1_405B}  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(config))
        model_name = tmp_path
    model = load_model_shape(model_name)
    cluster = Cluster(nodes, 8, "80GB", **HARDWARE[hardware])
    parallel = {"sequence_parallel": True, "loss_parallel": True}
    plan = make_plan(model, cluster, Training("bf16-mixed", Workload(1, 8192), **parallel), global_batch_size=batch)
    assert answer(plan) == expected
    # the recipe's own layout, step and recompute, as the planner estimates them: it fits, and how it compares
    training = Training("bf16-mixed", Workload(micro, 8192), True, activation_checkpointing_mode=mode, **parallel)
    fixed = make_plan(model, cluster, training, tensor_parallel_sizes=[tensor], global_batch_size=batch, adapt=False)
    row = next(row for row in fixed.rows if (row.layout.fsdp_size, row.layout.replicate_size) == (fsdp, 1))
    assert row.fits and row.step.accumulation_steps == 1
    chosen = plan.recommended.throughput.step_seconds
    assert row.throughput.step_seconds / chosen == pytest.approx(ratio, abs=0.01)
