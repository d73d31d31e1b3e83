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
  ``fabric.no_backward_sync`` keeps the reduce-scatter: see ``fabric_hsdp/gradients.py``). With
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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from fabric_hsdp.planning.memory import Training, unit_sizes
from fabric_hsdp.planning.model import ModelShape
from fabric_hsdp.topology import REPLICATE_DIM, SHARD_DIM, TENSOR_DIM, Topology

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
    fsdp, tensor = layout.fsdp_size, layout.tensor_parallel_size
    gathered_forward = gathered_backward = reduced = shard = 0.0
    for unit, size in unit_sizes(model, fsdp, tensor).items():
        gathered_forward += size.unsharded * training.compute_bytes
        again = training.reshard_after_forward is True or (training.reshard_after_forward is None and unit != "")
        gathered_backward += size.unsharded * training.compute_bytes if again else 0
        reduced += size.trainable_unsharded * training.reduce_bytes  # frozen parameters have no gradient
        shard += size.trainable_local * training.reduce_bytes
    reduce_scatter_factor = 2.0 if backend == "gloo" else 1.0
    # kept gathered for the step: gathered once, whatever the accumulation (and never again in backward)
    gathers = 1 if training.keep_gathered_while_accumulating else accumulation_steps
    per_edge = {
        SHARD_DIM: _ring(fsdp)
        * (gathers * (gathered_forward + gathered_backward) + accumulation_steps * reduce_scatter_factor * reduced),
        REPLICATE_DIM: 2 * _ring(layout.replicate_size) * shard,
        TENSOR_DIM: accumulation_steps * _tensor_parallel_edge_bytes(model, training, tensor),
    }
    inter: dict[str, dict[int, float]] = {dim: defaultdict(float) for dim in per_edge}
    intra_of: dict[str, dict[int, float]] = {dim: defaultdict(float) for dim in per_edge}
    for dim, edge_bytes in per_edge.items():
        if edge_bytes == 0:
            continue
        for group in layout.rank_groups(dim):
            _count_ring(group, edge_bytes, layout.ranks_per_node, inter[dim], intra_of[dim])
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
