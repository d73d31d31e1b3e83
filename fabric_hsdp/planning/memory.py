"""Bytes per device of one layout: the sharded training state, the gathered units, and (an estimate) activations.

Sharded state, exact up to the allocator: FSDP2 splits each parameter's dim 0 (after tensor parallelism split its
own dim ``T`` ways) into ``S`` chunks of ``ceil(rows / S)`` rows; the device holding the first chunk holds the most.
Parameters and gradients take the state dtype (fp32 under mixed precision), AdamW two moments in that dtype plus a
4-byte step counter per parameter tensor, SGD (with momentum) one buffer. Frozen parameters (a LoRA model's base,
``requires_grad=False`` when the strategy sets the model up) have no gradient and no optimizer state, and under mixed
precision are held in the compute dtype (what the strategy does); the gathered units and their gradient buffers are
still counted in full (an upper bound for a frozen unit).

Gathered units (the strategy's, ``fsdp.outer_units``): each token embedding is a unit of its own, freed after its
forward; the final norm and output head are one unit, gathered from its forward until its post-backward, which frees
its weights and copies its unsharded gradient into the reduce dtype for the reduce-scatter (an embedding tied to the
head stays in the root, gathered to the end of backward); two layers are gathered at a time (the one computing and
the one prefetched); a unit's reduce-scatter input stays allocated until the next unit's reduce-scatter starts.
With ``reshard_after_forward=False`` every unit stays gathered.

The total is the peak, not the sum of the columns: the largest of the moments in which the transient memory is
alive together (gradients are freed by ``zero_grad()``, so none exists before backward):

* the loss and head backward: every layer's kept activations, the loss's tensors, the head unit gathered with its
  gradient, the last layer prefetched; then the head's reduce-scatter (its weights freed, its gradient and the
  reduce-dtype copy, the compute-dtype logits still alive);
* a layer's backward, the largest at the last block (the first to backpropagate, with every layer's activations
  still kept): the kept activations, one layer recomputed, the logits, the previous unit's reduce-scatter input (at
  the last block the head's), the block and the prefetched layer gathered, and the block's gradients;
* the end of backward, when the gradients are complete and the activations gone: the root unit and its gradient
  buffers (the whole root, embedding and head, an upper bound kept on purpose: with the embedding's unit alone the
  first step of docs/dryrun.md's 8B HSDP row, bf16-true, 2 tokens, plans 7.15 GB where its host peak was 8.72 GB;
  the counted step of a 4-layer Llama at 2 tokens is 1.03x of that tighter model, 0.66x of this one);
* the optimizer step: the gradients and the step temporaries, one tensor per parameter shard for foreach AdamW
  (``sqrt`` of the second moment).

Measured (issue #45, ``fabric-hsdp dryrun --no_compute``, which counts every allocation of the real step, docs/
dryrun.md): the planner's 70B answer on 16 x 8 (FSDP over 128, selective AC, 1 x 2048 tokens) peaks in the last
block's MLP backward at 49.63 GB, with the head's fp32 reduce-scatter input (4.20 GB), one prefetched layer, the
block's weights and gradients so far and the bf16 logits live, but not the embedding, the head's weights, the loss's
fp32 tensors or any layer's reduce-dtype copy; the planner had summed all of those at the start of backward (57.83
GB, 0.86x).

Activations are an estimate, per token of the micro-batch, for a Llama-style block with fused (flash or
memory-efficient) attention, in bytes: ``b_a (2h + (5h + 2 kv + 4 i) / T) + 2 h max(b_a, 4)`` per layer (the last
term: the norms' fp32 copies); a mixture-of-experts layer's MLP is the ``k`` experts each token is routed to:
``k (3h + 4 i_e)`` in place of ``4i``, plus the router's ``E`` logits and their fp32 softmax (``b_a E + 4 E``), ``i_e``
an expert's width (measured against transformers' Qwen3-MoE and Mixtral layers and litgpt's ``LLaMAMoE`` block,
tests/planning/test_moe_plan.py); the output head and the loss ``V (b_a + 8)`` (logits, fp32 log-probabilities and
their gradient). Measured against autograd's saved tensors for this repository's tiny Llama, transformers'
``LlamaDecoderLayer`` and litgpt's ``Block`` (docs/concepts.md).

The levers change that estimate:

* activation checkpointing ``"full"``: each layer keeps only its input, ``h b_a``, and one layer is recomputed at a
  time (its whole activations, once). An int ``k``: every k-th block (index 0, k, 2k, ...) is checkpointed, the
  others keep everything. ``"selective"`` (torchtitan's op-level policy: save the outputs of matmuls, attention and
  collectives, recompute the rest): each layer keeps ``b_a (3h + (2h + 2 kv + 2 i) / T)`` (its input, the q/k/v,
  attention, gate and up outputs, the two row-wise outputs), plus one layer's recompute;
* sequence parallelism (with TP): the activations outside the tensor-parallel region (the ``2h`` term, the norms'
  fp32 copies, a checkpointed layer's input, the row-wise outputs) are split by ``T`` too;
* loss parallel (with TP): the logits and the loss stay vocabulary-sharded, ``V (b_a + 8) / T``;
* context parallelism of degree ``C``: all of the above for the rank's ``s / C`` tokens of each sequence, plus the
  full-length keys and values its attentions all-gathered, and in each layer keeping all its activations a second
  copy of the attention output in place of the local keys and values (:mod:`~fabric_hsdp.planning.context`).

These lever estimates follow from the formulas above; benchmarks/levers.py measures the levers themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from fabric_hsdp.planning.context import gathered_key_value_bytes, local_training, split_attention_bytes
from fabric_hsdp.planning.experts import is_fused_expert, received_tokens_bytes
from fabric_hsdp.planning.model import ModelShape, ParameterShape, TransformerDims, is_token_embedding
from fabric_hsdp.setup.precision import PRECISION_DTYPES, PrecisionDtypes, canonical_precision

Optimizer = Literal["adamw", "sgd", "none"]
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd", "none")
_OPTIMIZER_BUFFERS = {"adamw": 2, "sgd": 1, "none": 0}
_ADAM_STEP_BYTES = 4  # torch's AdamW keeps a float32 scalar `step` per parameter tensor


def validate_precision(precision: str) -> str:
    """Fabric's precision string, canonical (``"bf16"`` -> ``"bf16-mixed"``).

    Raises:
        ValueError: Not one of the precisions ``HybridFSDPStrategy`` supports.
    """
    canonical = canonical_precision(precision)
    if canonical is None:
        raise ValueError(f"precision={precision!r} is not supported; choose one of: {', '.join(PRECISION_DTYPES)}.")
    return canonical


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes on each device: the micro-batch and the optimizer.

    Attributes:
        micro_batch_size: Sequences per device (per tensor-parallel group) per forward/backward.
        seq_len: Tokens per sequence.
        optimizer: ``"adamw"`` (two moments), ``"sgd"`` (SGD with momentum: one buffer) or ``"none"`` (no state,
            e.g. SGD without momentum).
    """

    micro_batch_size: int = 1
    seq_len: int = 2048
    optimizer: Optimizer = "adamw"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is not known; choose one of: {', '.join(OPTIMIZERS)}.")
        for name in ("micro_batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len


AC_MODES: tuple[str, ...] = ("none", "full", "selective")


def parse_activation_checkpointing_mode(mode: str | int) -> str | int:
    """The planner's mode: ``"none"``, ``"full"``, ``"selective"`` or a positive int k (every k-th block), also as
    the text ``fabric-hsdp plan`` gets (``"2"``); the strategy's own check (no ``"none"``) is in ``setup.pipeline``.

    Raises:
        ValueError: Anything else.
    """
    if isinstance(mode, str) and mode.isdigit():
        mode = int(mode)
    if isinstance(mode, bool) or not (mode in AC_MODES or (isinstance(mode, int) and mode >= 1)):
        raise ValueError(
            f"activation_checkpointing_mode={mode!r} is not known; choose one of {', '.join(AC_MODES)} or a positive"
            " int k (every k-th block)."
        )
    return mode


@dataclass(frozen=True)
class Training:
    """How the model is trained: precision, workload and the strategy's memory and throughput options.

    Attributes:
        precision: Fabric's precision string.
        workload: Micro-batch, sequence length and optimizer.
        activation_checkpointing: Whether the layers are checkpointed (as ``HybridFSDPStrategy``'s argument).
        activation_checkpointing_mode: How, when they are: ``"full"`` (default), ``"selective"`` or an int k (every
            k-th block); ``"none"`` turns it off whatever ``activation_checkpointing`` says.
        cpu_offload: Sharded state in CPU memory.
        reshard_after_forward: As the strategy's (None: FSDP2's default).
        keep_gathered_while_accumulating: As the strategy's: the whole model stays gathered for the step (one
            gather per step whatever the accumulation; implies ``reshard_after_forward=False``).
        sequence_parallel: Sequence parallelism with TP (norms on sequence-sharded activations).
        loss_parallel: Vocabulary-sharded logits and loss with TP.
    """

    precision: str = "bf16-mixed"
    workload: Workload = field(default_factory=Workload)
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    reshard_after_forward: bool | None = None
    activation_checkpointing_mode: str | int = "full"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    keep_gathered_while_accumulating: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", validate_precision(self.precision))
        if self.keep_gathered_while_accumulating:
            if self.reshard_after_forward not in (None, False):
                raise ValueError(
                    f"keep_gathered_while_accumulating=True with reshard_after_forward={self.reshard_after_forward!r}:"
                    " the first keeps the units gathered for the whole step, the second frees them after forward."
                )
            object.__setattr__(self, "reshard_after_forward", False)
        mode = parse_activation_checkpointing_mode(self.activation_checkpointing_mode)
        object.__setattr__(self, "activation_checkpointing_mode", mode)
        if mode == "none":
            object.__setattr__(self, "activation_checkpointing", False)

    @property
    def checkpointing(self) -> str | int:
        """The mode in effect: ``"none"``, ``"full"``, ``"selective"`` or k."""
        return self.activation_checkpointing_mode if self.activation_checkpointing else "none"

    def checkpointed_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` blocks are checkpointed (full or selective)."""
        mode = self.checkpointing
        if mode == "none":
            return 0
        if isinstance(mode, int):
            return math.ceil(num_layers / mode)  # blocks 0, k, 2k, ...
        return num_layers

    @property
    def dtypes(self) -> PrecisionDtypes:
        """The dtypes of the state, compute and reduction (``dtypes.state_bytes`` etc. give their sizes)."""
        return PRECISION_DTYPES[self.precision]

    @property
    def state_bytes(self) -> int:
        return self.dtypes.state_bytes

    @property
    def compute_bytes(self) -> int:
        return self.dtypes.compute_bytes

    @property
    def reduce_bytes(self) -> int:
        return self.dtypes.reduce_bytes


@dataclass(frozen=True)
class Memory:
    """Bytes per device; ``total`` is the peak (see the module docstring). ``host``: kept in CPU memory instead.

    Attributes:
        parameters: Sharded parameters.
        gradients: Sharded gradients (complete at the end of backward).
        optimizer: Optimizer state of the sharded parameters.
        gathered: Unsharded parameters and gradient buffers in the last block's backward: the block and the prefetched
            layer, the block's gradients and the previous unit's reduce-scatter input (the head's).
        activations: Activations at the start of backward (an estimate): every layer's kept activations, one layer's
            recompute and the loss's tensors.
        loss_activations: Of ``activations``, the loss's: the logits, fp32 log-probabilities and their gradient.
        recompute: Of ``activations``, one checkpointed layer's forward again (alive only in a layer's backward).
        logits: Of ``loss_activations``, the logits in the compute dtype, alive through the layers' backward.
        head_backward: Unsharded parameters and gradients while the loss and head backpropagate: the head unit and its
            gradient, the last layer prefetched (and the whole model with ``reshard_after_forward=False``).
        head_reduce: The same at the head's reduce-scatter: its weights freed, its gradient and the reduce-dtype copy.
        received_tokens: Under expert parallelism, one MoE layer's rows received from the other ranks of its expert
            group, with a margin for uneven routing (:mod:`~fabric_hsdp.planning.experts`).
        end_of_backward: Unsharded root unit and its gradient buffers at the end of backward.
        step_temporaries: Temporaries of the optimizer step (foreach AdamW: one tensor per parameter shard).
        host: Parameters, gradients and optimizer state in CPU memory with ``cpu_offload``.
    """

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    end_of_backward: int = 0
    step_temporaries: int = 0
    host: int = 0
    received_tokens: int = 0
    loss_activations: int = 0
    recompute: int = 0
    logits: int = 0
    head_backward: int = 0
    head_reduce: int = 0

    @property
    def total(self) -> int:
        """The peak: parameters and optimizer state, plus the largest of the moments' transient memory (the module
        docstring; measured by the counted dry run of the 70B answer, docs/dryrun.md)."""
        kept = self.activations - self.loss_activations - self.recompute  # every layer's, until its backward
        loss = kept + self.loss_activations + self.head_backward
        head = kept + self.logits + self.head_reduce
        # the last block's backward: where the counted 70B step peaked
        layer = kept + self.recompute + self.logits + self.gathered + self.received_tokens
        end = self.gradients + self.end_of_backward
        step = self.gradients + self.step_temporaries
        return self.parameters + self.optimizer + max(loss, head, layer, end, step)


def local_numel(
    parameter: ParameterShape, fsdp_size: int, tensor_parallel_size: int, expert_parallel_size: int = 1
) -> tuple[int, int]:
    """(elements of the largest local shard, elements of the padded unsharded TP-local tensor). Under expert
    parallelism a layer's fused experts are this rank's ``E / N`` experts, sharded over ``fsdp_size / N`` ranks."""
    shape = list(parameter.shape) or [1]
    if parameter.tensor_parallel_dim is not None and tensor_parallel_size > 1:
        shape[parameter.tensor_parallel_dim] //= tensor_parallel_size
    if expert_parallel_size > 1 and is_fused_expert(parameter):
        shape[0] //= expert_parallel_size
        fsdp_size //= expert_parallel_size
    rows = math.ceil(shape[0] / fsdp_size)
    rest = math.prod(shape[1:])
    return rows * rest, rows * fsdp_size * rest


@dataclass(frozen=True)
class UnitSize:
    """Elements of one FSDP unit under a layout: its largest local shard, unsharded (padded), the largest tensor."""

    local: int
    unsharded: int
    largest_tensor: int
    tensors: int
    trainable_local: int = 0  # of ``local``, the elements of trainable parameters
    trainable_unsharded: int = 0  # of ``unsharded``, the same
    trainable_tensors: int = 0
    # of ``unsharded`` and ``trainable_unsharded``, the fused experts': under expert parallelism their own FSDP unit
    # (gathered over the expert_shard group), counted with the layer's
    expert_unsharded: int = 0
    trainable_expert_unsharded: int = 0


def unit_sizes(
    model: ModelShape, fsdp_size: int, tensor_parallel_size: int, expert_parallel_size: int = 1
) -> dict[str, UnitSize]:
    """Per FSDP unit ('' = root), the elements a device holds and gathers (computed once per distinct unit)."""
    key = ("unit_sizes", fsdp_size, tensor_parallel_size, expert_parallel_size)
    if key not in model.cache:
        by_signature: dict[tuple, UnitSize] = {}
        sizes = {}
        for unit, parameters in model.units().items():
            signature = tuple((p.shape, p.tensor_parallel_dim, p.trainable, is_fused_expert(p)) for p in parameters)
            if signature not in by_signature:
                numels = [local_numel(p, fsdp_size, tensor_parallel_size, expert_parallel_size) for p in parameters]
                by_signature[signature] = _unit_size(parameters, numels)
            sizes[unit] = by_signature[signature]
        model.cache[key] = sizes
    return model.cache[key]


def _unit_size(parameters: list[ParameterShape], numels: list[tuple[int, int]]) -> UnitSize:
    trainable = [p.trainable for p in parameters]
    experts = [is_fused_expert(p) for p in parameters]
    return UnitSize(
        local=sum(local for local, _ in numels),
        unsharded=sum(padded for _, padded in numels),
        largest_tensor=max((padded for _, padded in numels), default=0),
        tensors=len(parameters),
        trainable_local=sum(local for (local, _), keep in zip(numels, trainable) if keep),
        trainable_unsharded=sum(padded for (_, padded), keep in zip(numels, trainable) if keep),
        trainable_tensors=sum(trainable),
        expert_unsharded=sum(padded for (_, padded), keep in zip(numels, experts) if keep),
        trainable_expert_unsharded=sum(
            padded for (_, padded), expert, train in zip(numels, experts, trainable) if expert and train
        ),
    )


def memory_per_device(
    model: ModelShape,
    training: Training,
    fsdp_size: int,
    tensor_parallel_size: int,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> Memory:
    """Bytes per device for a layout with FSDP degree ``fsdp_size``, TP degree ``tensor_parallel_size``, EP
    degree ``expert_parallel_size`` and CP degree ``context_parallel_size`` (which changes only the activations:
    the parameters are sharded over the whole shard group as without it)."""
    sizes = unit_sizes(model, fsdp_size, tensor_parallel_size, expert_parallel_size)
    sharded = sum(size.local for size in sizes.values())
    trainable = sum(size.trainable_local for size in sizes.values())
    tensors = sum(size.trainable_tensors for size in sizes.values())
    unsharded = {unit: size.unsharded for unit, size in sizes.items()}
    compute, reduce = training.compute_bytes, training.reduce_bytes
    optimizer = training.workload.optimizer
    state = trainable * training.state_bytes  # what trains: its gradients and optimizer state are as large
    # frozen parameters are held in the compute dtype under mixed precision (fsdp.hold_frozen_in_compute_dtype)
    parameters = state + (sharded - trainable) * compute
    optimizer_bytes = _OPTIMIZER_BUFFERS[optimizer] * state + (
        _ADAM_STEP_BYTES * tensors if optimizer == "adamw" else 0
    )
    layers = [numel for unit, numel in unsharded.items() if unit]
    largest_layer = max(layers, default=0)
    # the final norm and head: a unit without the embedding the strategy shards on its own (fsdp.outer_units)
    head_unit = unsharded[""] - _separate_embedding_numel(model, fsdp_size, tensor_parallel_size)
    if training.reshard_after_forward is False:
        gathered = sum(unsharded.values())  # every unit, the whole step
        at_head, at_layer = gathered, gathered
        head_weights_freed = 0
    else:
        # at the head: it and the last layer (prefetched); in a layer's backward: that layer and the next
        at_head, at_layer = head_unit + min(1, len(layers)) * largest_layer, min(2, len(layers)) * largest_layer
        head_weights_freed = head_unit
    head_backward = (at_head + head_unit) * compute  # the head's gradient too
    head_reduce = (at_head - head_weights_freed + head_unit) * compute + head_unit * reduce
    # the last block's weights and gradients, the prefetched layer, and the reduce-scatter input of the unit before
    # (the head's at the last block: counted 4.20 GB in fp32 at the 70B answer's peak, docs/dryrun.md)
    gathered_bytes = (at_layer + largest_layer) * compute + max(head_unit, largest_layer) * reduce
    # the whole root unit, an upper bound (the module docstring: the embedding's unit alone under-plans a measured run)
    end_of_backward = unsharded[""] * (2 * compute + reduce)
    if training.keep_gathered_while_accumulating:  # between micro-batches every unit stays gathered
        end_of_backward = max(end_of_backward, gathered * compute + unsharded[""] * (compute + reduce))
    offloaded = training.cpu_offload
    activations, loss_activations, recompute, logits = _activation_parts(
        model, training, tensor_parallel_size, context_parallel_size
    )
    return Memory(
        parameters=0 if offloaded else parameters,
        gradients=0 if offloaded else state,
        optimizer=0 if offloaded else optimizer_bytes,
        gathered=gathered_bytes,
        activations=activations,
        end_of_backward=end_of_backward,
        step_temporaries=state if optimizer == "adamw" and not offloaded else 0,
        host=parameters + state + optimizer_bytes if offloaded else 0,
        received_tokens=received_tokens_bytes(model, training, expert_parallel_size),
        loss_activations=loss_activations,
        recompute=recompute,
        logits=logits,
        head_backward=head_backward,
        head_reduce=head_reduce,
    )


def _separate_embedding_numel(model: ModelShape, fsdp_size: int, tensor_parallel_size: int) -> int:
    """Unsharded elements of the root's token embeddings that are FSDP units of their own (``fsdp.outer_units``:
    freed after their forward); 0 when an embedding is tied to the head (the root then holds one matrix)."""
    root = model.units()[""]
    embeddings = [p for p in root if is_token_embedding(p.name)]
    if not any(len(p.shape) >= 2 and not is_token_embedding(p.name) for p in root):
        return 0  # no head of its own: tied, the embedding stays in the root
    return sum(local_numel(p, fsdp_size, tensor_parallel_size)[1] for p in embeddings)


def activation_bytes(
    model: ModelShape, training: Training, tensor_parallel_size: int = 1, context_parallel_size: int = 1
) -> int:
    """Estimated peak activation bytes per device for one micro-batch (see the module docstring); with context
    parallelism those of the rank's ``seq_len / C`` tokens plus the keys and values its attentions gathered
    (:mod:`~fabric_hsdp.planning.context`)."""
    return _activation_parts(model, training, tensor_parallel_size, context_parallel_size)[0]


def _activation_parts(
    model: ModelShape, training: Training, tensor_parallel_size: int, context_parallel_size: int
) -> tuple[int, int, int, int]:
    """(all activations, of them the loss's, one layer's recompute, the logits in the compute dtype)."""
    gathered = gathered_key_value_bytes(model, training, context_parallel_size)
    local = local_training(training, context_parallel_size)
    split = split_attention_bytes(model, local, context_parallel_size)
    saved, loss, recompute, logits = _local_activation_bytes(model, local, tensor_parallel_size)
    return gathered + split + saved, loss, recompute, logits


def _local_activation_bytes(
    model: ModelShape, training: Training, tensor_parallel_size: int
) -> tuple[int, int, int, int]:
    dims, tokens, element = model.dims, training.workload.tokens, training.compute_bytes
    tensor = tensor_parallel_size
    outside = tensor if training.sequence_parallel else 1  # the region outside TP, sequence-sharded with SP
    expert_layers = dims.expert_layers or 0
    dense = tokens * layer_activation_bytes_per_token(dims, element, tensor, outside)
    routed = tokens * layer_activation_bytes_per_token(dims, element, tensor, outside, routed=True)
    layer = (expert_layers * routed + (dims.num_layers - expert_layers) * dense) / max(dims.num_layers, 1)
    vocabulary = tensor if training.loss_parallel else 1
    head = tokens * dims.vocab_size * (element + 8) / vocabulary
    logits = tokens * dims.vocab_size * element / vocabulary
    checkpointed = training.checkpointed_layers(dims.num_layers)
    if training.checkpointing == "selective":
        kept = tokens * element * (3 * dims.hidden_size / outside + _selective_split(dims, expert_layers > 0) / tensor)
    else:
        kept = tokens * dims.hidden_size * element / outside
    recompute = max(routed if expert_layers else 0, dense) if checkpointed else 0  # one layer's forward again
    saved = checkpointed * kept + (dims.num_layers - checkpointed) * layer + recompute
    return int(saved + head), int(head), int(recompute), int(logits)


def layer_activation_bytes_per_token(
    dims: TransformerDims,
    element_bytes: int,
    tensor_parallel_size: int = 1,
    outside_divisor: int = 1,
    routed: bool = False,
) -> float:
    """What one Llama-style block keeps for backward per token: ``b_a (2h + (5h + 2kv + 4i) / T) + 2h max(b_a, 4)``.

    ``outside_divisor``: ``T`` with sequence parallelism (the ``2h`` terms are sequence-sharded), else 1.
    ``routed``: a mixture-of-experts block, whose MLP is the ``k`` experts each token is routed to, each keeping
    its copy of the token, gate and up outputs, the activation, their product and the expert's output (transformers'
    experts also the weighted output): ``k (3h + 4 i_e)`` instead of ``4i``; plus the router's logits (``E``, in the
    compute dtype) and their fp32 softmax (``4E`` bytes).
    """
    hidden, kv, inner = dims.hidden_size, dims.kv_size, dims.intermediate_size
    mlp, router = 4 * inner, 0
    if routed and dims.num_experts and dims.experts_per_token and dims.expert_intermediate_size:
        experts = dims.num_experts
        mlp = dims.experts_per_token * (3 * hidden + 4 * dims.expert_intermediate_size) + experts
        router = 4 * experts
    split = (5 * hidden + 2 * kv + mlp) / tensor_parallel_size
    outside = (element_bytes * 2 * hidden + 2 * hidden * max(element_bytes, 4) + router) / outside_divisor
    return element_bytes * split + outside


def _selective_split(dims: TransformerDims, routed: bool = False) -> float:
    """Per token, the tensor-parallel outputs selective AC saves: q, k, v, attention, gate and up (an MoE layer:
    each routed expert's gate-up and down outputs, and the router's logits)."""
    if routed and dims.num_experts and dims.experts_per_token and dims.expert_intermediate_size:
        expert = dims.experts_per_token * (2 * dims.expert_intermediate_size + dims.hidden_size) + dims.num_experts
        return 2 * dims.hidden_size + 2 * dims.kv_size + expert
    return 2 * dims.hidden_size + 2 * dims.kv_size + 2 * dims.intermediate_size
