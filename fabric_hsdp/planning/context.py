"""Context parallelism in the plan: which layouts may split a sequence, the keys and values they gather, and the memory.

With ``context_parallel_size=C`` the ``C`` ranks of a context group (consecutive ranks of one node, the shard dim
split into ``(data_shard, context)``: :mod:`fabric_hsdp.topology`) take the same micro-batch and each
computes on ``s / C`` of every sequence's tokens (two head-tail chunks of ``s / 2C``, so ``s`` must divide by ``2C``).
The parameters are sharded over the whole shard group as without it. So, per rank and micro-batch of ``m`` sequences
(``n_kv d_h`` the key/value width, ``b_a`` the compute dtype's bytes, ``L`` layers):

* activations: those of ``m s / C`` tokens (the existing estimate at the shorter length; the output head's logits
  too), plus the full-length keys and values each attention all-gathers, ``2 m s n_kv d_h b_a`` per layer: kept by
  every layer that keeps its activations (the attention saves its inputs for backward; selective checkpointing saves
  the all-gather outputs), and by the one layer full checkpointing recomputes at a time
  (:func:`kept_key_value_layers`). A layer that keeps all its activations keeps what the unsplit estimate counts
  differently (:func:`split_attention_bytes`): not its local keys and values (the all-gather saves no input), but a
  second copy of the attention output (each head-tail chunk is its own SDPA call, which saves its output; the output
  projection reads their concatenation): ``m s / C (h - 2 n_kv d_h) b_a`` per such layer;
* traffic, in the context group, per layer: a forward all-gather of K and V, ``2 (C - 1) / C m s n_kv d_h b_a`` sent
  per rank (a ring), the backward reduce-scatter of their gradients the same (on gloo an all-reduce, twice), and the
  all-gather again for each layer full checkpointing recomputes. Inside a node, and on the critical path: the
  attention waits for its keys and values;
* compute: ``1 / C`` of the micro-batch's FLOPs (the queries of ``s / C`` tokens against all ``s`` keys is ``1 / C``
  of the attention too), and ``world / C`` data-parallel ranks, as tensor-parallel peers share a micro-batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from fabric_hsdp.planning.model import ModelShape

if TYPE_CHECKING:
    from fabric_hsdp.planning.memory import Training


def context_parallel_candidates(ranks_per_node: int) -> list[int]:
    """The context-parallel sizes worth planning: every divisor of the devices per node (the topology keeps those
    that divide the shard group and come without tensor or expert parallelism)."""
    return [size for size in range(1, ranks_per_node + 1) if ranks_per_node % size == 0]


def context_parallel_problem(seq_len: int, size: int) -> str | None:
    """Why sequences of ``seq_len`` tokens cannot be split ``size`` ways (None if they can, or ``size`` is 1)."""
    if size == 1 or seq_len % (2 * size) == 0:
        return None
    return (
        f"context_parallel_size({size}) needs the sequence length ({seq_len}) divisible by 2 x {size} = {2 * size}"
        " (each rank takes a head and a tail chunk of every sequence); pad the sequences"
    )


def local_training(training: Training, size: int) -> Training:
    """``training`` as one rank of a context group of ``size`` sees it: sequences of ``seq_len / size`` tokens."""
    if size == 1:
        return training
    workload = training.workload
    return replace(training, workload=replace(workload, seq_len=workload.seq_len // size))


def key_value_bytes(model: ModelShape, training: Training) -> int:
    """One layer's full-length keys and values for one micro-batch: ``2 m s n_kv d_h b_a``."""
    return 2 * training.workload.tokens * model.dims.kv_size * training.compute_bytes


def kept_key_value_layers(training: Training, num_layers: int) -> int:
    """Layers whose gathered keys and values are held at the start of backward: every layer not checkpointed and,
    under selective checkpointing, every layer (the all-gather outputs are saved); under full (or every-k-th)
    checkpointing the layers not checkpointed plus the one being recomputed."""
    if training.checkpointing == "selective":
        return num_layers
    checkpointed = training.checkpointed_layers(num_layers)
    return num_layers - checkpointed + (1 if checkpointed else 0)


def gathered_key_value_bytes(model: ModelShape, training: Training, size: int) -> int:
    """The full-length keys and values a rank holds at the start of backward (0 without context parallelism)."""
    if size == 1:
        return 0
    return kept_key_value_layers(training, model.dims.num_layers) * key_value_bytes(model, training)


def split_attention_bytes(model: ModelShape, training: Training, size: int) -> int:
    """What a rank's split attentions keep beyond the unsplit estimate at its ``s / C`` tokens (``training`` the
    rank's :func:`local_training`), all layers: in each layer that keeps all its activations (not checkpointed, or
    recomputed), a second copy of the attention output, ``h b_a`` per token, in place of the local keys and values,
    ``2 n_kv d_h b_a`` (negative where those are wider). 0 without context parallelism."""
    if size == 1:
        return 0
    dims = model.dims
    checkpointed = training.checkpointed_layers(dims.num_layers)
    whole_layers = dims.num_layers - checkpointed + (1 if checkpointed else 0)
    per_token = (dims.hidden_size - 2 * dims.kv_size) * training.compute_bytes
    return whole_layers * training.workload.tokens * per_token


def gathers_per_layer(training: Training, num_layers: int) -> float:
    """K/V all-gathers per layer and micro-batch, averaged over the layers: 1, and 1 more for each layer full (or
    every-k-th) checkpointing recomputes; selective checkpointing saves their outputs."""
    if training.checkpointing == "selective" or num_layers == 0:
        return 1.0
    return 1 + training.checkpointed_layers(num_layers) / num_layers


def key_value_exchange_bytes(model: ModelShape, training: Training, size: int, reduce_scatter_factor: float) -> float:
    """Bytes each rank sends its successor in the context group's rings in one micro-batch, all layers together:
    the K/V all-gathers (again where recomputed) and the reduce-scatter of their gradients (``reduce_scatter_factor``
    2 on gloo, where it is an all-reduce)."""
    if size == 1:
        return 0.0
    layers = model.dims.num_layers
    per_collective = key_value_bytes(model, training) * (size - 1) / size
    return layers * (gathers_per_layer(training, layers) + reduce_scatter_factor) * per_collective
