"""The layouts an expert picks for Llama-3 8B and 70B on 2 and 4 nodes of 8 x 80 GB, from both config sources.

The expected answers are written as an expert gives them, not computed by the test: an 8B trains best with one copy
per node (HSDP, no TP: only the gradient all-reduce crosses nodes); a 70B does not fit one node's 8 x 80 GB with
bf16-mixed AdamW, so it is sharded over all ranks (plain FSDP, still no TP at this scale). Tensor parallelism only
cuts the tokens per step (each TP group works on one micro-batch), so at equal traffic per step it sends T times more
per token: the old per-step ranking picked TP 8 for the 8B (issue #20).
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

# (model, nodes, precision, activation checkpointing) -> (shard_size, tensor_parallel_size, mesh), None: nothing fits
EXPERT = {
    ("8B", 2, "bf16-mixed", False): (8, 1, (2, 8)),
    ("8B", 4, "bf16-mixed", False): (8, 1, (4, 8)),
    ("70B", 4, "bf16-mixed", True): (32, 1, (1, 32)),
    ("70B", 2, "bf16-true", True): (16, 1, (1, 16)),
    ("70B", 2, "bf16-mixed", True): None,  # 16 bytes per parameter over 16 GPUs is 70.6 GB before anything else
}


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


@pytest.mark.parametrize("timed", [False, True], ids=["bytes per token", "step time per token"])
@pytest.mark.parametrize("source", ["transformers", "litgpt"])
@pytest.mark.parametrize(("size", "nodes", "precision", "checkpointing"), list(EXPERT))
def test_the_recommendation_is_the_experts(shapes, source, size, nodes, precision, checkpointing, timed):
    model = shapes[(size, source)]
    assert model.num_parameters == {"8B": 8_030_261_248, "70B": 70_553_706_496}[size]
    cluster = Cluster(nodes, 8, "80GB", **(BANDWIDTHS if timed else {}))
    training = Training(precision, Workload(1, 2048), activation_checkpointing=checkpointing)
    plan = make_plan(model, cluster, training)
    chosen = plan.recommended
    got = None if chosen is None else (chosen.layout.shard_size, chosen.layout.tensor_parallel_size)
    expected = EXPERT[(size, nodes, precision, checkpointing)]
    assert (got, None if chosen is None else chosen.layout.mesh_shape) == (
        (None, None) if expected is None else (expected[:2], expected[2])
    )


def test_tensor_parallelism_sends_less_per_step_but_more_per_token(shapes):
    """The trap of the per-step ranking: 8B on 2 x 8, TP 8 over all ranks sends a little less per step than HSDP."""
    plan = make_plan(shapes[("8B", "litgpt")], Cluster(2, 8, "80GB"), Training("bf16-mixed", Workload(1, 2048)))
    rows = {(row.layout.shard_size, row.layout.tensor_parallel_size): row for row in plan.rows}
    hsdp, tensor_parallel = rows[(8, 1)], rows[(16, 8)]
    assert tensor_parallel.fits and tensor_parallel.traffic.inter_node_bytes < hsdp.traffic.inter_node_bytes
    assert (hsdp.data_parallel_size, tensor_parallel.data_parallel_size) == (16, 2)
    assert (hsdp.throughput.tokens_per_step, tensor_parallel.throughput.tokens_per_step) == (32768, 4096)
    assert tensor_parallel.throughput.inter_node_bytes_per_token > 7 * hsdp.throughput.inter_node_bytes_per_token
    assert hsdp.recommended and not tensor_parallel.recommended


def test_table_and_json_show_data_parallel_size_tokens_and_rates(shapes):
    model = shapes[("8B", "transformers")]
    plan = make_plan(model, Cluster(2, 8, "80GB", **BANDWIDTHS), Training("bf16-mixed", Workload(1, 2048)))
    document = json.loads(json.dumps(plan_dict(plan)))
    by_layout = {(entry["shard_size"], entry["tensor_parallel_size"]): entry for entry in document["layouts"]}
    assert (by_layout[(8, 1)]["data_parallel_size"], by_layout[(8, 1)]["tokens_per_step"]) == (16, 32768)
    assert (by_layout[(16, 8)]["data_parallel_size"], by_layout[(16, 8)]["tokens_per_step"]) == (2, 4096)
    assert document["ranked_by"] == "seconds per token" and document["cluster"]["device_flops"] == 989e12
    chosen = document["recommended"]
    assert 0 < chosen["mfu_estimate"] < document["cluster"]["compute_efficiency"]
    assert chosen["tokens_per_second_estimate"] == pytest.approx(32768 / chosen["step_seconds_estimate"])
    table = plan_table(plan)
    header = next(line for line in table.splitlines() if line.lstrip().startswith("shard"))
    for column in ("DP", "tokens/step", "inter-node/token", "step time", "tokens/s", "MFU"):
        assert column in header
    marked = next(line for line in table.splitlines() if line.startswith("->")).split()
    assert marked[1:6] == ["8", "1", "2x8", "16", "32,768"]
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
