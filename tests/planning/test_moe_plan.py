"""The planner on mixture-of-experts models (#32): all experts' shards in memory and in the all-gathers, activations
of the routed tokens, FLOPs of the active parameters. Expected values are computed here by hand from the shapes the
configs give (each parameter written out), not by the planner's own functions."""

import math

import pytest
import torch

from fabric_hsdp.planning import Training, Workload, memory_per_device, traffic_per_step
from fabric_hsdp.planning.memory import layer_activation_bytes_per_token
from fabric_hsdp.planning.model import TransformerDims, model_shape_of_module
from fabric_hsdp.planning.throughput import flops_per_token
from fabric_hsdp.topology import SHARD_DIM, Topology
from tests.helpers import moe
from tests.planning.test_activations import saved_bytes

# the published configs (transformers' field names), checked against their published totals below
QWEN3_30B = dict(
    hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
MIXTRAL_8X7B = dict(
    hidden_size=4096, num_hidden_layers=32, num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
)  # fmt: skip


def meta_model(kind: str, **fields):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    config = (Qwen3MoeConfig if kind == "qwen3_moe" else MixtralConfig)(**fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def qwen3_30b_layer() -> int:
    """Parameters of one Qwen3-30B-A3B decoder layer, all 128 experts."""
    h, q, kv, experts, width = 2048, 32 * 128, 4 * 128, 128, 768
    attention = h * q + 2 * h * kv + q * h + 2 * 128  # q, k, v, o; q_norm and k_norm over head_dim
    expert = 3 * h * width  # gate, up, down
    return attention + experts * expert + experts * h + 2 * h  # experts, router, two norms


def test_dims_of_published_configs():
    qwen = model_shape_of_module(meta_model("qwen3_moe", **QWEN3_30B)).dims
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_intermediate_size, qwen.expert_layers) == (
        128, 8, 768, 48,
    )  # fmt: skip
    mixtral = model_shape_of_module(meta_model("mixtral", **MIXTRAL_8X7B)).dims
    # Mixtral's config has no moe_intermediate_size: its intermediate_size is each expert's width
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 14336)
    # Qwen3-MoE's mlp_only_layers keep a dense MLP: layer 1 of 2 has no experts
    tiny = dict(moe.config("qwen3_moe").to_dict(), mlp_only_layers=[1])
    tiny = {
        key: value for key, value in tiny.items() if key not in ("model_type", "architectures", "transformers_version")
    }
    assert model_shape_of_module(meta_model("qwen3_moe", **tiny)).dims.expert_layers == 1


def test_memory_and_all_gathers_hold_every_expert():
    """Qwen3-30B-A3B on 2 x 8, shard_size 16 (every dim 0 divides by 16: no padding), bf16-true AdamW."""
    model = model_shape_of_module(meta_model("qwen3_moe", **QWEN3_30B))
    root = 2 * 151936 * 2048 + 2048  # embeddings, output head, final norm
    total = root + 48 * qwen3_30b_layer()
    assert total / 1e9 == pytest.approx(30.5, abs=0.05)  # the published total
    assert model.num_parameters == total
    training = Training("bf16-true", Workload(1, 16, "adamw"))
    memory = memory_per_device(model, training, 16, 1)
    assert memory.parameters == memory.gradients == 2 * total // 16
    tensors = 3 + 48 * 11
    assert memory.optimizer == 2 * (2 * total // 16) + 4 * tensors
    # the all-gathers of one node x 16 ranks: forward, backward again for the layers, reduce-scatter, all bf16
    traffic = traffic_per_step(model, training, Topology(1, 16, 16, 1))
    gathered = 2 * total + 2 * (total - root) + 2 * total
    assert traffic.intra_by_dim[SHARD_DIM] == pytest.approx(15 / 16 * gathered, rel=1e-12)


def test_activations_follow_the_routed_tokens():
    """Mixtral-8x7B, bf16, 1 x 4096 tokens, no checkpointing: each token through 2 experts of width 14336."""
    model = model_shape_of_module(meta_model("mixtral", **MIXTRAL_8X7B))
    h, kv, width, experts, vocab, tokens = 4096, 8 * 128, 14336, 8, 32000, 4096
    attention = 2 * (2 * h + 5 * h + 2 * kv) + 2 * h * 4
    mlp = 2 * 2 * (3 * h + 4 * width) + 2 * experts + 4 * experts  # two experts; router logits + fp32 softmax
    head = vocab * (2 + 8)
    expected = tokens * (32 * (attention + mlp) + head)
    training = Training("bf16-true", Workload(1, tokens, "adamw"))
    assert memory_per_device(model, training, 16, 1).activations == expected


@pytest.mark.parametrize("kind", moe.KINDS)
def test_model_flops_count_the_active_parameters(kind):
    with torch.device("meta"):
        model = moe.build(kind)
    named = {name: p.shape for name, p in model.named_parameters()}
    embedding = next(name for name in named if "embed_tokens" in name or ".wte." in name)
    # the matrices but the embedding (a lookup); the experts, fused 3-D or one 2-D module each, apart
    dense = sum(
        math.prod(s) for name, s in named.items() if len(s) == 2 and ".experts." not in name and name != embedding
    )
    experts = sum(math.prod(s) for name, s in named.items() if ".experts." in name)
    seq = 16
    active = dense + experts * 2 // 4  # top-2 of 4 experts
    model_flops, _ = flops_per_token(model_shape_of_module(model), Training(workload=Workload(1, seq)))
    assert model_flops == 6 * active + 12 * 2 * 64 * seq  # 2 layers, attention width 4 x 16


H, HEADS, KV_HEADS, WIDTH, BATCH, SEQ = 256, 4, 2, 96, 2, 64


def moe_block(kind, dtype, x, experts, top_k):
    if kind == "litgpt_moe":
        from litgpt import Config
        from litgpt.model import Block, build_rope_cache

        config = Config(
            block_size=SEQ, n_layer=1, n_head=HEADS, n_query_groups=KV_HEADS, n_embd=H, rotary_percentage=1.0,
            parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMoE",
            intermediate_size=512, moe_intermediate_size=WIDTH, n_expert=experts, n_expert_per_token=top_k,
        )  # fmt: skip
        block = Block(config, 0).to(dtype)
        cos, sin = (part[None].to(dtype) for part in build_rope_cache(SEQ, config.rope_n_elem))
        return block, lambda: block(x, cos, sin)
    common = dict(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
        num_experts_per_tok=top_k,
    )  # fmt: skip
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer as Layer
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding as Rotary

        config = Qwen3MoeConfig(
            **common, head_dim=H // HEADS, intermediate_size=512, moe_intermediate_size=WIDTH, num_experts=experts,
            decoder_sparse_step=1, mlp_only_layers=[],
        )  # fmt: skip
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer as Layer
        from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding as Rotary

        config = MixtralConfig(**common, intermediate_size=WIDTH, num_local_experts=experts)
    config._attn_implementation = "sdpa"
    block = Layer(config, 0).to(dtype)
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    rope = tuple(part.to(dtype) for part in Rotary(config)(x, positions))
    return block, lambda: block(x, position_embeddings=rope, attention_mask=None, position_ids=positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "experts", "top_k"), [("qwen3_moe", 32, 8), ("mixtral", 8, 2), ("litgpt_moe", 8, 2)])
def test_moe_layer_estimate_within_15_percent_of_saved_tensors(kind, experts, top_k, dtype):
    """Qwen3-MoE's own top-8 and Mixtral's top-2; Qwen3's q/k norms are not in the estimate (its top-2 is -17 %)."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, H, dtype=dtype, requires_grad=True)
    block, run = moe_block(kind, dtype, x, experts, top_k)
    measured = saved_bytes(block, run) / (BATCH * SEQ)
    head_dim = H // HEADS
    dims = TransformerDims(H, 1, 512, 64, HEADS, KV_HEADS, head_dim, experts, top_k, WIDTH, 1)
    estimate = layer_activation_bytes_per_token(dims, dtype.itemsize, routed=True)
    assert estimate == pytest.approx(measured, rel=0.15), (kind, dtype, measured, estimate)


def test_tensor_parallel_layouts_of_a_moe_model_are_refused_as_the_strategy_refuses_them():
    from fabric_hsdp.planning import Cluster, make_plan

    model = model_shape_of_module(meta_model("mixtral", **MIXTRAL_8X7B))
    plan = make_plan(model, Cluster(2, 8, "80GB"), Training("bf16-true", Workload(1, 4096)))
    layouts = {(row.layout.fsdp_size, row.layout.tensor_parallel_size) for row in plan.rows}
    assert layouts and all(tensor == 1 for _, tensor in layouts)
    problem = model.tensor_parallel_problem(2)
    assert problem.startswith("tensor_parallel_size(2): tensor_parallel_plan='auto' has no plan for mixture-of-experts")
