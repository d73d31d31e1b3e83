"""Per token: what a layout sends, and (with bandwidths) how long a step takes, tokens/s and MFU.

Each tensor-parallel group works on one micro-batch, so a layout with TP degree ``T`` on ``W`` ranks has ``W / T``
data-parallel ranks, and a step of ``a`` micro-batches (gradient accumulation) processes
``W / T x micro-batch x a x seq_len`` tokens; context-parallel peers (degree ``C``) share one too: ``W / (T C)``
data-parallel ranks, each computing ``1 / C`` of its group's micro-batch. The plan compares every layout at one
global batch (so the same tokens per step): TP's and CP's layouts run more sequences per data-parallel rank, as a
larger micro-batch or more accumulation steps (see :mod:`~fabric_hsdp.planning.step`).

Compute, per token (torchtitan's and PaLM's count): ``6 N + 12 L d s`` model FLOPs, ``N`` the parameters that do
matmuls (every 2-D weight except the token embedding, whose forward is a lookup; the output head counts even when
tied; of a mixture-of-experts layer's experts, fused 3-D or one module each, the ``k`` of ``E`` a token is routed
to: ``k / E`` of their parameters, the active ones), ``L`` layers, ``d`` the attention width (heads x head dim), ``s``
the sequence length. A frozen weight (a LoRA model's base) needs no weight gradient: ``4`` FLOPs per parameter per
token instead of ``6``. The hardware also runs the forward again for every checkpointed layer (full AC; selective AC
recomputes only element-wise ops, counted as none: they are memory-bound, not FLOPs, and not measured here; among
near-ties the ranking prefers less recompute). A device's compute per step is its TP group's tokens' FLOPs over
``T C`` (the queries of ``s / C`` tokens against all ``s`` keys is ``1 / C`` of the attention too), at
``device_flops x efficiency``.

Step time (an estimate, stated in the table): FSDP's gathers and reduce-scatters and the replicas' all-reduce overlap
with compute, tensor-parallel collectives, expert parallelism's token all-to-alls (the experts wait for their
tokens) and context parallelism's key/value all-gathers and reduce-scatters (the attention waits for them) sit on
every layer's critical path, so ``step = max(compute, inter-node bytes / inter-node bandwidth, FSDP and replica
intra-node bytes / intra-node bandwidth) + (TP + all-to-all + K/V bytes) / intra-node bandwidth``; a bandwidth
not given is not counted. MFU is the model FLOPs
(recompute excluded) per second over the devices' peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fabric_hsdp.planning.memory import Training
from fabric_hsdp.planning.model import ModelShape, ParameterShape, is_token_embedding
from fabric_hsdp.planning.traffic import Traffic
from fabric_hsdp.topology import CONTEXT_DIM, EXPERT_DIM, TENSOR_DIM, Topology

# H100 SXM's dense bf16 tensor-core peak: the default when bandwidths are given without --device_flops
DEFAULT_DEVICE_FLOPS = 989e12
DEFAULT_COMPUTE_EFFICIENCY = 0.4
_FLOP_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_flops(rate: float | int | str, what: str = "device_flops") -> float:
    """FLOP/s in ``rate``: a number, or ``"989TFLOPS"``, ``"989 TFLOP/s"``, ``"1.2PFLOP/s"``.

    Raises:
        ValueError: Not a positive rate in those units.
    """
    if isinstance(rate, bool):
        raise ValueError(f"{what}={rate!r} is not a FLOP rate; write e.g. '989TFLOPS'")
    if isinstance(rate, int | float):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([kKMGTP]?)(?:FLOPS|FLOP/s|flops|flop/s)?\s*", rate)
        if not match:
            raise ValueError(f"{what}={rate!r} is not a FLOP rate; write e.g. '989TFLOPS' or '989TFLOP/s'")
        value = float(match.group(1)) * _FLOP_UNITS[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"{what}={rate!r} must be positive")
    return value


@dataclass(frozen=True)
class Throughput:
    """Per token and per second figures of one layout. Times are None without bandwidths (a plan's cluster always
    has them: given or assumed)."""

    data_parallel_size: int
    tokens_per_step: int
    inter_node_bytes_per_token: float
    intra_node_bytes_per_token: float
    compute_seconds: float | None = None
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None

    @property
    def seconds_per_token(self) -> float | None:
        return None if self.step_seconds is None else self.step_seconds / self.tokens_per_step


def flops_per_token(model: ModelShape, training: Training) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs incl. recompute) per token of a training step (see the module docstring)."""
    dims = model.dims
    dense = [p for p in model.parameters if len(p.shape) == 2 and not _is_token_embedding(p.name) and not _expert(p)]
    experts = [p for p in model.parameters if _expert(p) and len(p.shape) >= 2]
    # forward, input gradients and weight gradients: 2 FLOPs each per parameter and token; a frozen weight has no
    # weight gradient
    matmul, matmul_flops = sum(p.numel for p in dense), sum(_flops(p) * p.numel for p in dense)
    routed, routed_flops = sum(p.numel for p in experts), sum(_flops(p) * p.numel for p in experts)
    if dims.num_experts and dims.experts_per_token:  # a token passes through top-k of each layer's experts
        routed = routed * dims.experts_per_token // dims.num_experts
        routed_flops = routed_flops * dims.experts_per_token // dims.num_experts
    matmul, matmul_flops = matmul + routed, matmul_flops + routed_flops  # without a top-k: every expert, a bound
    if not any(p for p in model.parameters if p.unit == "" and _is_output_head(p.name)):
        # a tied head still multiplies by the embedding
        embedding = next((p for p in model.parameters if _is_token_embedding(p.name)), None)
        matmul += dims.vocab_size * dims.hidden_size
        matmul_flops += (6 if embedding is None else _flops(embedding)) * dims.vocab_size * dims.hidden_size
    width = (dims.num_heads or 0) * (dims.head_dim or 0) or dims.hidden_size
    attention = 12 * dims.num_layers * width * training.workload.seq_len
    model_flops = matmul_flops + attention
    recomputed = 0.0 if training.checkpointing == "selective" else training.checkpointed_layers(dims.num_layers)
    layer_share = recomputed / dims.num_layers if dims.num_layers else 0.0
    head = dims.vocab_size * dims.hidden_size
    forward_of_layers = 2 * max(matmul - head, 0) + attention / 3
    return model_flops, model_flops + layer_share * forward_of_layers


def _flops(parameter: ParameterShape) -> int:
    """FLOPs per token of one weight element: forward, input gradient, and weight gradient unless frozen."""
    return 6 if parameter.trainable else 4


def throughput(
    model: ModelShape,
    training: Training,
    layout: Topology,
    traffic: Traffic,
    inter_node_bandwidth: float | None,
    intra_node_bandwidth: float | None,
    device_flops: float | None,
    efficiency: float,
    accumulation_steps: int = 1,
) -> Throughput:
    """Tokens per step, bytes per token and, with a bandwidth, the step time, tokens/s and MFU of ``layout``, for
    ``accumulation_steps`` micro-batches per step (``traffic`` is that step's)."""
    data_parallel = layout.data_parallel_size
    tokens_per_data_parallel_rank = accumulation_steps * training.workload.tokens
    tokens = data_parallel * tokens_per_data_parallel_rank
    inter, intra = traffic.inter_node_bytes / tokens, traffic.intra_node_bytes / tokens
    if inter_node_bandwidth is None and intra_node_bandwidth is None:
        return Throughput(data_parallel, tokens, inter, intra)
    peak = device_flops if device_flops is not None else DEFAULT_DEVICE_FLOPS
    model_flops, hardware_flops = flops_per_token(model, training)
    # tensor- and context-parallel peers split their micro-batch's FLOPs
    sharing = layout.tensor_parallel_size * layout.context_parallel_size
    compute = tokens_per_data_parallel_rank * hardware_flops / sharing / (peak * efficiency)
    intra_by_dim = traffic.intra_by_dim or {}
    # on the critical path; the expert and context groups are inside a node (the topology refuses otherwise)
    critical_bytes = sum(intra_by_dim.get(dim, 0.0) for dim in (TENSOR_DIM, EXPERT_DIM, CONTEXT_DIM))
    overlapped = [compute]
    if inter_node_bandwidth is not None:
        overlapped.append(traffic.inter_node_bytes / inter_node_bandwidth)
    exposed = 0.0
    if intra_node_bandwidth is not None:
        overlapped.append((traffic.intra_node_bytes - critical_bytes) / intra_node_bandwidth)
        exposed = critical_bytes / intra_node_bandwidth
    step = max(overlapped) + exposed
    per_second = tokens / step
    mfu = per_second * model_flops / (layout.world_size * peak)
    return Throughput(data_parallel, tokens, inter, intra, compute, step, per_second, mfu)


def _expert(parameter: ParameterShape) -> bool:
    return ".experts." in parameter.name


def _is_token_embedding(name: str) -> bool:
    return is_token_embedding(name)


def _is_output_head(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("lm_head", "output", "head")
