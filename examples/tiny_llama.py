"""A small LLaMA-style decoder (RMSNorm, rotary attention, SwiGLU MLP), enough to exercise HSDP end to end.

Every module with parameters defines ``reset_parameters()``, so it builds on the meta device and initialises its
shards after ``fabric.setup_module``. The rotary cache is a non-persistent buffer computed in ``__init__``, like
litgpt's ``cos``/``sin`` and Hugging Face's ``inv_freq``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 172
    max_seq_len: int = 64
    rope_base: float = 10000.0
    dropout: float = 0.0  # on the embeddings, each attention output and each residual branch
    tie_embeddings: bool = False  # the output head shares the embedding's weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cache(head_dim: int, max_seq_len: int, base: float) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # (seq, head_dim / 2, 2)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = cache[: x.shape[1], None, :, 0], cache[: x.shape[1], None, :, 1]
    rotated = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 0] * sin + pairs[..., 1] * cos], -1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # heads from the projection's width (-1), not the config: under tensor parallelism a rank holds some heads
        shape = (batch, seq, -1, self.head_dim)
        q = apply_rope(self.wq(x).view(shape), rope).transpose(1, 2)
        k = apply_rope(self.wk(x).view(shape), rope).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = F.dropout(out.transpose(1, 2).reshape(batch, seq, -1), self.dropout, self.training)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim)
        self.feed_forward = FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), rope))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    # How tensor parallelism splits it, in transformers' form (HybridFSDPStrategy's tensor_parallel_plan="auto"):
    # attention and MLP Megatron-style, the embedding by vocabulary rows, the output head with gathered logits.
    _tp_plan = {
        "tok_embeddings": "embedding_rowwise",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise_gather_output",
    }

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope", rope_cache(config.dim // config.n_heads, config.max_seq_len, config.rope_base), persistent=False
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.tok_embeddings(idx))
        for layer in self.layers:
            x = layer(x, self.rope)
        return self.output(self.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def config_for_parameters(millions: float, vocab_size: int = 32000) -> LlamaConfig:
    """A LLaMA-shaped config with roughly ``millions`` parameters (for benchmarks)."""
    for dim in (256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096):
        hidden = int(8 * dim / 3 / 64 + 1) * 64
        per_layer = 4 * dim * dim + 3 * dim * hidden
        n_layers = max(1, round((millions * 1e6 - 2 * vocab_size * dim) / per_layer))
        if n_layers <= 2 * math.sqrt(dim):
            return LlamaConfig(vocab_size, dim, n_layers, max(1, dim // 64), hidden, max_seq_len=256)
    raise ValueError(f"no config found for {millions}M parameters")
