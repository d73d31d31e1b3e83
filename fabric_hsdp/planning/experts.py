"""Expert parallelism in the plan: which layouts may split a model's experts, and the tokens they exchange.

With ``expert_parallel_size=N`` each MoE layer's fused experts (transformers 5's ``gate_up_proj`` ``[E, 2I, H]`` and
``down_proj`` ``[E, H, I]``) are split ``N`` ways over the ``expert`` dim (``E / N`` experts per rank) and are their
own FSDP unit, sharded over the ``expert_shard`` group of ``e = S / N`` ranks (:mod:`fabric_hsdp.topology`).
So, per MoE layer and micro-batch, per rank (``P_e`` the layer's expert parameters, ``T`` tokens per rank, ``k`` the
top-k, ``h`` the hidden size, ``b_a`` the compute dtype's bytes):

* sharded state: ``E / N`` experts over ``e`` ranks is ``E / S`` experts per rank, the same bytes as FSDP alone;
* gathers and reduce-scatters: of ``P_e / N`` over the ``expert_shard`` group (``(e - 1) / e`` of it per rank, none
  at ``e = 1``) instead of ``P_e`` over the shard group; the gathered experts of a layer are ``P_e / N``;
* tokens: each rank sends the rows of its ``T k`` (token, expert) pairs whose expert another rank holds,
  ``T k h b_a (N - 1) / N`` on average, in each of ``n`` all-to-alls: 2 forward (dispatch, combine), 2 backward,
  2 more when full activation checkpointing recomputes the forward (selective checkpointing saves the all-to-all
  outputs: 4);
* memory: the received rows of one layer, ``T k`` on average and up to ``T k N`` when one rank's experts take every
  token: counted :data:`RECEIVED_TOKENS_HEADROOM` times the average.

The ``expert`` group is consecutive ranks of one node (the topology refuses otherwise), so the all-to-alls stay on
the node's links; the ``expert_shard`` group crosses nodes when the shard group does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_hsdp.planning.model import ModelShape, ParameterShape

if TYPE_CHECKING:
    from fabric_hsdp.planning.memory import Training

# The router's load-balancing loss aims every rank's experts at the average T k rows, but a layer's routing is
# uneven, the more so early in training and on narrow data; the bound (every token to one rank's experts, N times
# the average) would price expert parallelism out of every plan. Twice the average is a margin, not a bound.
RECEIVED_TOKENS_HEADROOM = 2.0
# all-to-alls per MoE layer and micro-batch: dispatch and combine, forward and backward
EXCHANGES = 4


def is_fused_expert(parameter: ParameterShape) -> bool:
    """A layer's experts as one tensor (``...experts.gate_up_proj``, its leading dim the experts), which expert
    parallelism splits; not one module per expert (``...experts.0.fc_1.weight``, litgpt's ``LLaMAMoE``)."""
    parts = parameter.name.split(".")
    if "experts" not in parts[:-1] or not parameter.unit:
        return False
    return not parts[parts.index("experts") + 1].isdigit()


def expert_parallel_problem(model: ModelShape, size: int) -> str | None:
    """Why ``model``'s experts cannot be split ``size`` ways (None if they can, or ``size`` is 1)."""
    if size == 1:
        return None
    label = f"expert_parallel_size({size})"
    experts = model.dims.num_experts
    if not experts:
        return f"{label}: {model.description} has no routed experts (a dense model: nothing to split)"
    routed = [p for p in model.parameters if ".experts." in p.name]
    if not all(is_fused_expert(p) for p in routed):
        return (
            f"{label}: the experts are one module each (e.g. '{routed[0].name}'); expert parallelism splits fused"
            " expert tensors (transformers 5's gate_up_proj and down_proj)"
        )
    if any("lora_" in p.name for p in routed):
        return f"{label}: LoRA adapters on the experts are not supported under expert parallelism"
    if experts % size:
        return f"{label} does not divide the {experts} experts per layer"
    return None


def expert_parallel_candidates(model: ModelShape) -> list[int]:
    """The expert-parallel sizes worth planning for ``model``: 1, and every divisor of its experts per layer the
    model allows (the topology then keeps those that divide the shard group and the ranks per node)."""
    experts = model.dims.num_experts or 1
    divisors = [size for size in range(2, experts + 1) if experts % size == 0]
    return [1] + [size for size in divisors if expert_parallel_problem(model, size) is None]


def exchanges_per_layer(training: Training, num_layers: int) -> float:
    """All-to-alls per MoE layer and micro-batch, averaged over the layers: 4, and 2 more for each layer full (or
    every-k-th) checkpointing recomputes; selective checkpointing saves their outputs."""
    if training.checkpointing == "selective" or num_layers == 0:
        return EXCHANGES
    return EXCHANGES + 2 * training.checkpointed_layers(num_layers) / num_layers


def token_exchange_bytes(model: ModelShape, training: Training, size: int) -> float:
    """Bytes each rank sends to the other ranks of its expert group in one micro-batch, all MoE layers together."""
    dims = model.dims
    if size == 1 or not dims.expert_layers:
        return 0.0
    rows = training.workload.tokens * dims.experts_per_token * dims.hidden_size * training.compute_bytes
    exchanges = exchanges_per_layer(training, dims.num_layers)
    return dims.expert_layers * exchanges * rows * (size - 1) / size


def received_tokens_bytes(model: ModelShape, training: Training, size: int) -> int:
    """The received rows of one MoE layer, counted :data:`RECEIVED_TOKENS_HEADROOM` times the average ``T k``."""
    dims = model.dims
    if size == 1 or not dims.expert_layers:
        return 0
    rows = training.workload.tokens * dims.experts_per_token * RECEIVED_TOKENS_HEADROOM
    return int(rows * dims.hidden_size * training.compute_bytes)
