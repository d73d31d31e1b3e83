"""Tiny mixture-of-experts models made locally (hidden 64, 2 layers, 4 experts, top-2) and their hub-layout files.

``qwen3_moe`` and ``mixtral``: transformers 5 models, whose experts are fused parameters (``mlp.experts.gate_up_proj``
``[4, 2 * 32, 64]``) while ``save_pretrained`` writes one tensor per expert, as the hub holds them
(``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``). ``litgpt_moe``: litgpt's
``LLaMAMoE`` (one module per expert), saved as ``lit_model.pth``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 256
SEQ = 16
KINDS = ("qwen3_moe", "mixtral", "litgpt_moe")
FUSED_KINDS = ("qwen3_moe", "mixtral", "olmoe")  # experts as fused parameters: what expert parallelism splits
TOKENS = torch.arange(2 * SEQ).remainder(VOCAB).view(2, SEQ)


def config(kind: str) -> Any:
    common = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    common.update(num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.01,
        )
    if kind == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            **common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01
        )
    if kind == "olmoe":
        from transformers import OlmoeConfig

        return OlmoeConfig(
            **common, intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01
        )
    from dataclasses import replace

    from tests.helpers.training import litgpt_config

    # the dense tiny Llama's config with LLaMAMoE blocks (replace re-runs litgpt's __post_init__)
    return replace(
        litgpt_config(),
        name="tiny-moe-test",
        mlp_class_name="LLaMAMoE",
        moe_intermediate_size=32,
        n_expert=4,
        n_expert_per_token=2,
    )


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "litgpt_moe":
        from litgpt.model import GPT

        return GPT(config(kind))
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(kind))


def layer_class(kind: str) -> type[nn.Module]:
    if kind == "litgpt_moe":
        from litgpt.model import Block

        return Block
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

        return Qwen3MoeDecoderLayer
    if kind == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeDecoderLayer

        return OlmoeDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    return MixtralDecoderLayer


def save_hub(kind: str, directory: Path, seed: int = 0) -> Path:
    """The model of ``seed`` saved by its library's own saver, in the hub's layout; returns what to load."""
    model = build(kind, seed)
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "litgpt_moe":
        torch.save(model.state_dict(), directory / "lit_model.pth")
        return directory / "lit_model.pth"
    model.save_pretrained(directory)
    return directory


def load_reference(kind: str, path: str | Path) -> nn.Module:
    """The model as its library loads the hub-layout file (transformers: ``from_pretrained``, converting)."""
    if kind == "litgpt_moe":
        model = build(kind, seed=123)
        model.load_state_dict(torch.load(path, weights_only=True))
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus, for transformers models, the router's load-balancing loss as their own loss adds it."""
    if hasattr(getattr(model, "config", None), "router_aux_loss_coef"):
        out = model(inputs, output_router_logits=True)
        loss = nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        return loss + model.config.router_aux_loss_coef * out.aux_loss
    return nn.functional.cross_entropy(logits_of(model, inputs).flatten(0, 1), targets.flatten())


def train_one_process(
    kind: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batches: list[list[int]],
    steps: int,
    learning_rate: float,
    max_norm: float | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """One process accumulating ``micro_batches`` (lists of rows) each step, AdamW, clipping to ``max_norm`` if
    given: the mean of per-batch losses, as the ranks compute it when each routes its own batch (the load-balancing
    loss of a batch is not a sum over its rows). The trained model (a ``tests.helpers.parity.Trained``) and its first
    step's gradients."""
    from tests.helpers.parity import Trained

    model = build(kind, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    losses, norms, gradients = [], [], {}
    for step in range(steps):
        step_loss = 0.0
        for rows in micro_batches:
            loss = loss_of(model, inputs[rows], targets[rows]) / len(micro_batches)
            loss.backward()
            step_loss += loss.item()
        if step == 0:
            gradients = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return Trained(losses, norms, {name: t.detach().clone() for name, t in model.state_dict().items()}), gradients
