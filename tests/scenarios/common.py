"""Building blocks shared by the scenarios that launched ranks run."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn

from examples.tiny_llama import Block, Llama, LlamaConfig
from fabric_hsdp import HybridFSDPStrategy

VOCAB = 256
SEQ = 16


def make_fabric(num_nodes: int, devices: int, precision: str = "32-true", **strategy_kwargs: Any) -> L.Fabric:
    strategy = HybridFSDPStrategy(**strategy_kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def tiny_llama(seed: int = 0, **options: Any) -> Llama:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=SEQ, **options)
    return Llama(config)


def litgpt_config() -> Any:
    from litgpt import Config

    return Config(
        name="tiny-llama-test",
        block_size=SEQ,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=64,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=96,
    )


def tiny_litgpt(seed: int = 0) -> nn.Module:
    from litgpt.model import GPT

    torch.manual_seed(seed)
    return GPT(litgpt_config())


def hf_config() -> Any:
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


def tiny_hf_llama(seed: int = 0, tie_word_embeddings: bool = False) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = hf_config()
    config.tie_word_embeddings = tie_word_embeddings
    model = LlamaForCausalLM(config)
    if tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def layer_class(kind: str) -> type[nn.Module]:
    kind = kind.split("-")[0]
    if kind == "llama":
        return Block
    if kind == "litgpt":
        from litgpt.model import Block as LitBlock

        return LitBlock
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def build(kind: str, seed: int = 0) -> nn.Module:
    """``llama`` (the example), ``litgpt``, ``hf``; ``hf-tied``/``llama-tied``: the output head shares the
    embedding's weight; ``llama-dropout``: the example with dropout 0.5 everywhere it has dropout."""
    variants = {
        "hf-tied": lambda seed: tiny_hf_llama(seed, tie_word_embeddings=True),
        "llama-tied": lambda seed: tiny_llama(seed, tie_embeddings=True),
        "llama-dropout": lambda seed: tiny_llama(seed, dropout=0.5),
    }
    return {"llama": tiny_llama, "litgpt": tiny_litgpt, "hf": tiny_hf_llama, **variants}[kind](seed)


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def batch(global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full plain tensor (gathers DTensor shards), on CPU, in the model's own layout.

    As a user would take it: ``state_dict()`` and ``full_tensor()``. Tensor parallelism keeps the rows of fused
    projections (litgpt's qkv) grouped by rank in memory; the state dict shows them in the model's order.
    """
    from torch.distributed.tensor import DTensor

    model = getattr(model, "module", model)
    state = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().cpu().clone()
    return state


def copy_full_into(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a sharded model: each rank keeps the slice its DTensor shard covers."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from fabric_hsdp.tensor_parallel import fused_rows_of, held_row_order

    fused = fused_rows_of(getattr(model, "module", model))
    with torch.no_grad(), held_row_order():  # the parameters themselves, regrouped rows and all
        for name, tensor in model.state_dict().items():
            full = fused[name].to_module_order(state[name]) if name in fused else state[name]
            if isinstance(tensor, DTensor):
                local = distribute_tensor(full.to(tensor.dtype), tensor.device_mesh, tensor.placements)
                tensor.to_local().copy_(local.to_local())
            else:
                tensor.copy_(full)


class ReadCounter:
    """Counts the tensor bytes this process reads from checkpoint files (every such read ends in fileio.readinto)."""

    def __init__(self) -> None:
        from fabric_hsdp.checkpoint.core import fileio

        self.bytes = 0
        readinto = fileio.readinto

        def counting_readinto(fd: int, target: torch.Tensor, offset: int, **kw: Any) -> None:
            self.bytes += target.nbytes
            readinto(fd, target, offset, **kw)

        fileio.readinto = counting_readinto
