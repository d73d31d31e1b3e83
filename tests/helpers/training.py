"""Tiny models, a Fabric on CPU ranks, and the training steps that tests and launched ranks share.

Also ``finetune``, a body that ``launch()`` runs: ``examples/finetune.py``'s ``main`` on each rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
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


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer state of every parameter as full plain tensors in the model's own layout, keyed by name.

    Rows that tensor parallelism regrouped (litgpt's qkv) are put back in the model's order.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from fabric_hsdp.tensor_parallel import fused_rows_of

    fused = fused_rows_of(model)
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    full = {}
    for fqn, entries in state["state"].items():
        full[fqn] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                value = fused[fqn].to_stored_order(value) if fqn in fused and value.ndim else value
                value = value.detach().cpu().clone()
            full[fqn][key] = value
    return full


def expected_state(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Full model and optimizer state plus the scheduler's, gathered on every rank (the gathers are collectives)."""
    return {
        "model": full_state(model.module),
        "optimizer": full_optimizer_state(model.module, optimizer.optimizer),
        "scheduler": scheduler.state_dict(),
    }


def setup_training(fabric: Any, kind: str = "llama", empty_init: bool = True, seed: int = 0) -> tuple[Any, Any, Any]:
    """A model built (on meta with ``empty_init``) and set up, its AdamW and a StepLR scheduler."""
    with fabric.init_module(empty_init=empty_init):
        model = build(kind, seed=seed)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def train_steps(fabric: Any, model: Any, optimizer: Any, scheduler: Any, steps: int) -> None:
    """``steps`` AdamW steps, each data-parallel rank on its own rows (tensor-parallel peers on the same)."""
    data = fabric.strategy.distributed_sampler_kwargs  # tensor-parallel peers share their rows
    inputs, targets = batch(2 * data["num_replicas"], seed=7)
    rows = slice(2 * data["rank"], 2 * data["rank"] + 2)
    for _ in range(steps):
        # a no-op unless loss_parallel=True split the logits; Lightning's own strategies (the interop runs) have none
        loss_context = getattr(fabric.strategy, "loss_parallel", contextlib.nullcontext)
        with loss_context():
            logits = logits_of(model, inputs[rows])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[rows].flatten())
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


PATH_ARGUMENTS = ("checkpoint_dir", "out_dir", "data")


def finetune(num_nodes: int, devices: int, args: dict[str, Any]) -> None:
    from examples.finetune import Parallelism, main

    arguments = {key: Path(value) if key in PATH_ARGUMENTS else value for key, value in args.items()}
    if "parallel" in arguments:  # JSON carries the dataclass's fields
        arguments["parallel"] = Parallelism(**arguments["parallel"])
    main(**arguments, accelerator="cpu", devices=devices, num_nodes=num_nodes)
