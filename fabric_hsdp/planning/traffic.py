"""Bytes each node sends to other nodes, and each device to the devices of its node, in one training step.

Ring collectives, as NCCL (and gloo) run them: a group of ``n`` ranks forms a ring in rank order, and each rank sends
its successor ``(n-1)/n M`` for an all-gather or a reduce-scatter of ``M`` bytes (the full tensor), ``2 (n-1)/n M``
for an all-reduce. gloo's ``reduce_scatter_tensor`` is an all-reduce of the whole input, so with ``backend="gloo"``
it costs an all-reduce. Each ring edge between two nodes counts for the sending node; the rest are intra-node.

Per optimizer step of ``a`` micro-batches (gradient accumulation), for a layout with FSDP degree ``S``, ``R`` replicas
and TP degree ``T``:

* FSDP (``shard`` groups): an all-gather of every unit in forward, again in backward for every unit resharded after
  forward (all layers by default; the root too with ``reshard_after_forward=True``; none with ``False``), in the
  compute dtype; a reduce-scatter of every unit's gradients in the reduce dtype (trainable parameters only: a LoRA
  model's frozen base has none); all of it once per micro-batch (FSDP2 gathers again for every forward, and
  ``fabric.no_backward_sync`` keeps the reduce-scatter: see ``fabric_hsdp/setup/gradients.py``). With
  ``keep_gathered_while_accumulating`` the units stay gathered for the whole step: one all-gather of every unit per
  step (none in backward), the reduce-scatter still once per micro-batch.
* Replication (``replicate`` groups): an all-reduce of each rank's gradient shard (trainable parameters only), once
  per optimizer step (``no_backward_sync`` skips it between micro-batches).
* Tensor parallelism (``tensor`` groups, always inside a node): per layer one all-reduce of the activations
  (``tokens x hidden``) per row-wise layer in forward (again when activation checkpointing recomputes the forward),
  and one per column-wise layer in backward: torch's ``ColwiseParallel`` all-reduces the gradient of each layer's
  input on its own (a Llama layer: attention and MLP outputs forward; q, k, v, gate and up backward = 7, measured by
  benchmarks/comm_volume.py; litgpt's fused qkv: 5). Plus one for the vocabulary-parallel embedding in forward and
  one for the output head in backward, and an all-gather of the logits (``tokens x vocab``), whatever the plan says
  about the embedding and the head (transformers' Llama plan leaves the embedding whole): an upper bound, small next
  to the per-layer ones. Full activation checkpointing recomputes the forward's all-reduces (every k-th layer's with
  an int k; selective AC saves the collectives' outputs, so none). Sequence parallelism turns each all-reduce into a
  reduce-scatter and an all-gather: the same bytes. Loss parallel keeps the logits sharded: no logits all-gather.
  Once per micro-batch.
* Expert parallelism of degree ``N`` (:mod:`~fabric_hsdp.planning.experts`): the fused experts' gathers and
  reduce-scatters, as above, of this rank's ``E / N`` experts over the ``expert_shard`` group (``S / N`` ranks, every
  ``N``-th rank of the copy: a ring crossing nodes at every edge when the copy spans nodes) instead of the shard
  group; and the tokens' all-to-alls in the ``expert`` group (consecutive ranks of a node), each rank sending an equal
  share to each other rank. Once per micro-batch.
* Context parallelism of degree ``C`` (:mod:`~fabric_hsdp.planning.context`): in the ``context`` group (consecutive
  ranks of a node), per layer a ring all-gather of the keys and values in forward (again where full checkpointing
  recomputes it) and a reduce-scatter of their gradients in backward (on gloo an all-reduce). Once per micro-batch.
  FSDP's gathers run over the whole shard group as without it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from fabric_hsdp.planning.context import key_value_exchange_bytes
from fabric_hsdp.planning.experts import token_exchange_bytes
from fabric_hsdp.planning.memory import Training, unit_sizes
from fabric_hsdp.planning.model import ModelShape
from fabric_hsdp.topology import (
    CONTEXT_DIM,
    EXPERT_DIM,
    EXPERT_SHARD_DIM,
    REPLICATE_DIM,
    SHARD_DIM,
    TENSOR_DIM,
    Topology,
)

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Traffic:
    """Bytes per training step: the busiest node's bytes to other nodes, and the busiest device's to its node."""

    inter_node_bytes: float
    intra_node_bytes: float
    inter_node_total: float  # all nodes together (what a switch port counter summed over nodes shows)
    by_dim: dict[str, float]  # inter-node bytes of the busiest node, per mesh dim
    intra_by_dim: dict[str, float] | None = None  # intra-node bytes of the busiest device, per mesh dim


def traffic_per_step(
    model: ModelShape, training: Training, layout: Topology, backend: str = "nccl", accumulation_steps: int = 1
) -> Traffic:
    """Bytes over the links in one optimizer step of ``layout``: ``accumulation_steps`` micro-batches of
    ``training.workload`` each (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}.")
    per_edge = _ring_edge_bytes(model, training, layout, backend, accumulation_steps)
    exchanged = accumulation_steps * token_exchange_bytes(model, training, layout.expert_parallel_size)
    inter: dict[str, dict[int, float]] = {dim: defaultdict(float) for dim in (*per_edge, EXPERT_DIM)}
    intra_of: dict[str, dict[int, float]] = {dim: defaultdict(float) for dim in (*per_edge, EXPERT_DIM)}
    for dim, edge_bytes in per_edge.items():
        if edge_bytes == 0:
            continue
        for group in layout.rank_groups(dim):
            _count_ring(group, edge_bytes, layout.ranks_per_node, inter[dim], intra_of[dim])
    if exchanged:
        for group in layout.rank_groups(EXPERT_DIM):
            _count_all_to_all(group, exchanged, layout.ranks_per_node, inter[EXPERT_DIM], intra_of[EXPERT_DIM])
    return _busiest(inter, intra_of)


@dataclass
class _Volume:
    """Bytes one micro-batch gathers in forward and in backward, and reduces, of some parameters of the units."""

    forward: float = 0.0
    backward: float = 0.0
    reduced: float = 0.0

    def add(self, gathered: float, reduced: float, again: bool, training: Training) -> None:
        self.forward += gathered * training.compute_bytes
        self.backward += gathered * training.compute_bytes if again else 0
        self.reduced += reduced * training.reduce_bytes  # frozen parameters have no gradient

    def per_step(self, gathers: int, reductions: int, reduce_scatter_factor: float) -> float:
        return gathers * (self.forward + self.backward) + reductions * reduce_scatter_factor * self.reduced


def _ring_edge_bytes(
    model: ModelShape, training: Training, layout: Topology, backend: str, accumulation_steps: int
) -> dict[str, float]:
    """Bytes each rank sends its successor in one step, per mesh dim of the ring collectives."""
    fsdp, tensor, expert = layout.fsdp_size, layout.tensor_parallel_size, layout.expert_parallel_size
    dense, experts, shard = _Volume(), _Volume(), 0.0  # experts: the fused experts under expert parallelism
    for unit, size in unit_sizes(model, fsdp, tensor, expert).items():
        again = training.reshard_after_forward is True or (training.reshard_after_forward is None and unit != "")
        split, trainable_split = (size.expert_unsharded, size.trainable_expert_unsharded) if expert > 1 else (0, 0)
        dense.add(size.unsharded - split, size.trainable_unsharded - trainable_split, again, training)
        experts.add(split, trainable_split, again, training)
        shard += size.trainable_local * training.reduce_bytes
    reduce_scatter_factor = 2.0 if backend == "gloo" else 1.0
    # kept gathered for the step: gathered once, whatever the accumulation (and never again in backward)
    gathers = 1 if training.keep_gathered_while_accumulating else accumulation_steps
    return {
        SHARD_DIM: _ring(fsdp) * dense.per_step(gathers, accumulation_steps, reduce_scatter_factor),
        EXPERT_SHARD_DIM: _ring(layout.expert_shard_size)
        * experts.per_step(gathers, accumulation_steps, reduce_scatter_factor),
        REPLICATE_DIM: 2 * _ring(layout.replicate_size) * shard,
        TENSOR_DIM: accumulation_steps * _tensor_parallel_edge_bytes(model, training, tensor),
        CONTEXT_DIM: accumulation_steps
        * key_value_exchange_bytes(model, training, layout.context_parallel_size, reduce_scatter_factor),
    }


def _busiest(inter: dict[str, dict[int, float]], intra_of: dict[str, dict[int, float]]) -> Traffic:
    """The busiest node's and device's bytes from the counts per mesh dim."""
    intra: dict[int, float] = defaultdict(float)
    for counts in intra_of.values():
        for rank, count in counts.items():
            intra[rank] += count
    per_node: dict[int, float] = defaultdict(float)
    for counts in inter.values():
        for node, count in counts.items():
            per_node[node] += count
    busiest = max(per_node, key=lambda node: per_node[node], default=None)
    return Traffic(
        inter_node_bytes=per_node[busiest] if busiest is not None else 0.0,
        intra_node_bytes=max(intra.values(), default=0.0),
        inter_node_total=sum(per_node.values()),
        by_dim={dim: (counts.get(busiest, 0.0) if busiest is not None else 0.0) for dim, counts in inter.items()},
        intra_by_dim={dim: max(counts.values(), default=0.0) for dim, counts in intra_of.items()},
    )


def _ring(ranks: int) -> float:
    """Bytes each rank sends per byte of an all-gather's output (half an all-reduce's) in a ring of ``ranks``."""
    return (ranks - 1) / ranks


def _tensor_parallel_edge_bytes(model: ModelShape, training: Training, tensor: int) -> float:
    if tensor == 1:
        return 0.0
    dims = model.dims
    activation = training.workload.tokens * dims.hidden_size * training.compute_bytes
    layer_weights = [p for p in model.parameters if p.unit and len(p.shape) == 2]
    rowwise = sum(p.tensor_parallel_dim == 1 for p in layer_weights)  # all layers together
    colwise = sum(p.tensor_parallel_dim == 0 for p in layer_weights)
    layers = dims.num_layers or 1
    recomputed = 0 if training.checkpointing == "selective" else training.checkpointed_layers(layers) / layers
    all_reduces = rowwise * (1 + recomputed) + colwise + 2
    logits = 0 if training.loss_parallel else training.workload.tokens * dims.vocab_size * training.compute_bytes
    return 2 * _ring(tensor) * all_reduces * activation + _ring(tensor) * logits


def _count_ring(
    group: Iterable[int], edge_bytes: float, ranks_per_node: int, inter: dict[int, float], intra: dict[int, float]
) -> None:
    ranks = list(group)
    if len(ranks) < 2:
        return
    for source, target in zip(ranks, ranks[1:] + ranks[:1]):
        if source // ranks_per_node != target // ranks_per_node:
            inter[source // ranks_per_node] += edge_bytes
        else:
            intra[source] += edge_bytes


def _count_all_to_all(
    group: Iterable[int], sent_bytes: float, ranks_per_node: int, inter: dict[int, float], intra: dict[int, float]
) -> None:
    """Each rank of ``group`` sends ``sent_bytes`` split evenly over the others (balanced routing)."""
    ranks = list(group)
    if len(ranks) < 2:
        return
    to_each = sent_bytes / (len(ranks) - 1)
    for source in ranks:
        for target in ranks:
            if target == source:
                continue
            if source // ranks_per_node != target // ranks_per_node:
                inter[source // ranks_per_node] += to_each
            else:
                intra[source] += to_each
