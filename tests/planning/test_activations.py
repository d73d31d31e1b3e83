"""The per-layer activation estimate against what autograd saves for backward, for three Llama implementations."""

import pytest
import torch

from fabric_hsdp.planning.memory import layer_activation_bytes_per_token
from fabric_hsdp.planning.model import TransformerDims

HIDDEN, HEADS, KV_HEADS, INNER, BATCH, SEQ = 256, 4, 2, 688, 2, 64


def saved_bytes(module, run):
    """Bytes of the distinct storages autograd saves while ``run()`` goes forward, parameters excluded."""
    parameters = {parameter.untyped_storage().data_ptr() for parameter in module.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def tiny_block(dtype, x):
    from examples.tiny_llama import Block, LlamaConfig, rope_cache

    config = LlamaConfig(vocab_size=64, dim=HIDDEN, n_layers=1, n_heads=HEADS, hidden_dim=INNER, max_seq_len=SEQ)
    block = Block(config).to(dtype)
    rope = rope_cache(HIDDEN // HEADS, SEQ, 10000.0)
    return block, lambda: block(x, rope), HIDDEN


def transformers_block(dtype, x):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INNER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(config, 0).to(dtype)
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    rope = tuple(part.to(dtype) for part in LlamaRotaryEmbedding(config)(x, positions))
    return block, lambda: block(x, position_embeddings=rope, attention_mask=None, position_ids=positions), 128


def litgpt_block(dtype, x):
    from litgpt import Config
    from litgpt.model import Block, build_rope_cache

    config = Config(
        block_size=SEQ, n_layer=1, n_head=HEADS, n_query_groups=KV_HEADS, n_embd=HIDDEN, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
        intermediate_size=INNER,
    )  # fmt: skip
    block = Block(config, 0).to(dtype)
    cos, sin = (part[None].to(dtype) for part in build_rope_cache(SEQ, config.rope_n_elem))
    return block, lambda: block(x, cos, sin), 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", [tiny_block, transformers_block, litgpt_block])
def test_layer_estimate_within_15_percent_of_saved_tensors(build, dtype):
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype, requires_grad=True)
    block, run, kv_size = build(dtype, x)
    measured = saved_bytes(block, run) / (BATCH * SEQ)
    dims = TransformerDims(HIDDEN, 1, INNER, 64, HEADS, kv_size // (HIDDEN // HEADS), HIDDEN // HEADS)
    estimate = layer_activation_bytes_per_token(dims, dtype.itemsize)
    assert estimate == pytest.approx(measured, rel=0.15), (build.__name__, dtype, measured, estimate)
