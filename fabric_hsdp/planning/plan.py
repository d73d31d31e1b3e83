"""The plan: every valid layout with its memory and traffic, the recommended one, and what to change when none fits.

The recommendation (and ``HybridFSDPStrategy(shard_size="auto")``, which uses the same function), among the layouts
whose total fits in the device memory less the safety margin, compares them **per token**: a layout with TP degree
``T`` processes ``T`` times fewer tokens per step than one without (see :mod:`~fabric_hsdp.planning.throughput`).

* Without bandwidths: the fewest bytes between nodes per token (within 2 %); among those near-ties the smallest
  tensor-parallel size (TP adds collectives to the critical path of every layer), then the smallest shard group. On
  one node nothing crosses nodes, so the smallest tensor-parallel size and shard group that fit win.
* With a bandwidth: the shortest estimated step time per token, compute included (within 2 %), then the same
  tie-breaks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from fabric_hsdp.errors import NoLayoutFitsError
from fabric_hsdp.planning.layout import candidate_layouts, layout_summary
from fabric_hsdp.planning.memory import Memory, Training, memory_per_device
from fabric_hsdp.planning.model import ModelShape
from fabric_hsdp.planning.throughput import DEFAULT_COMPUTE_EFFICIENCY, Throughput, parse_flops, throughput
from fabric_hsdp.planning.traffic import Traffic, traffic_per_step
from fabric_hsdp.topology import Topology
from fabric_hsdp.units import format_bytes, format_seconds, parse_bandwidth, parse_bytes

DEFAULT_SAFETY_MARGIN = 0.1
_SAME_TRAFFIC = 0.02


@dataclass(frozen=True)
class Cluster:
    """The machines: nodes, devices per node, memory per device, and (optional) link bandwidths.

    Attributes:
        num_nodes: Nodes in the job.
        devices_per_node: Devices (ranks) per node.
        device_memory: Bytes per device (or a string like ``"80GB"``).
        inter_node_bandwidth: Bytes/s each node can send to the others (or ``"400Gbit/s"``); optional.
        intra_node_bandwidth: Bytes/s each device can send to the others of its node (or ``"450GB/s"``); optional.
        backend: ``"nccl"`` or ``"gloo"`` (whose reduce-scatter is an all-reduce, twice the bytes).
        device_flops: Peak FLOP/s per device in the compute dtype (or ``"989TFLOPS"``); with a bandwidth and no
            value, an H100's dense bf16 peak (989 TFLOP/s) is assumed and the table says so.
        compute_efficiency: The fraction of ``device_flops`` the model's FLOPs run at (default 0.4).
    """

    num_nodes: int
    devices_per_node: int
    device_memory: int | str
    inter_node_bandwidth: float | str | None = None
    intra_node_bandwidth: float | str | None = None
    backend: str = "nccl"
    device_flops: float | str | None = None
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY

    @property
    def timed(self) -> bool:
        """Whether a bandwidth was given: the plan then ranks by estimated step time per token."""
        return self.inter_node_bandwidth is not None or self.intra_node_bandwidth is not None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_memory", parse_bytes(self.device_memory, "device_memory"))
        if self.device_flops is not None:
            object.__setattr__(self, "device_flops", parse_flops(self.device_flops))
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"compute_efficiency={self.compute_efficiency!r} must be in (0, 1].")
        for name in ("inter_node_bandwidth", "intra_node_bandwidth"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, parse_bandwidth(getattr(self, name), name))


@dataclass(frozen=True)
class LayoutPlan:
    """One row of the plan."""

    layout: Topology
    memory: Memory
    traffic: Traffic
    fits: bool
    inter_node_seconds: float | None
    intra_node_seconds: float | None
    recommended: bool = False
    throughput: Throughput | None = None

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size


@dataclass(frozen=True)
class Plan:
    """Every valid layout of ``model`` on ``cluster``, the skipped ones with the reason, and the recommendation."""

    model: ModelShape
    cluster: Cluster
    training: Training
    safety_margin: float
    rows: list[LayoutPlan]
    skipped: list[tuple[Topology, str]] = field(default_factory=list)
    recommended: LayoutPlan | None = None
    reason: str = ""

    @property
    def usable_memory(self) -> int:
        return int(self.cluster.device_memory * (1 - self.safety_margin))


def make_plan(
    model: ModelShape,
    cluster: Cluster,
    training: Training,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    tensor_parallel_sizes: list[int] | None = None,
) -> Plan:
    """Plan every layout the topology accepts (and the model can be split into) and recommend one.

    Args:
        model: The model's shapes (``fabric_hsdp.planning.load_model_shape`` or ``model_shape_of_module``).
        cluster: Nodes, devices, memory and bandwidths.
        training: Precision, workload, activation checkpointing, offload.
        safety_margin: Fraction of the device memory kept free (allocator fragmentation, CUDA context, buffers).
        tensor_parallel_sizes: Only these TP sizes (default: every divisor of the devices per node).
    """
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin={safety_margin!r} must be in [0, 1).")
    usable = cluster.device_memory * (1 - safety_margin)
    rows, skipped = [], []
    for layout in candidate_layouts(cluster.num_nodes, cluster.devices_per_node, tensor_parallel_sizes):
        problem = model.tensor_parallel_problem(layout.tensor_parallel_size)
        if problem is not None:
            skipped.append((layout, problem))
            continue
        memory = memory_per_device(model, training, layout.fsdp_size, layout.tensor_parallel_size)
        traffic = traffic_per_step(model, training, layout, cluster.backend)
        inter_seconds = _seconds(traffic.inter_node_bytes, cluster.inter_node_bandwidth)
        intra_seconds = _seconds(traffic.intra_node_bytes, cluster.intra_node_bandwidth)
        rates = throughput(
            model,
            training,
            layout,
            traffic,
            cluster.inter_node_bandwidth,
            cluster.intra_node_bandwidth,
            cluster.device_flops,
            cluster.compute_efficiency,
        )
        fits = memory.total <= usable
        rows.append(LayoutPlan(layout, memory, traffic, fits, inter_seconds, intra_seconds, throughput=rates))
    plan = Plan(model, cluster, training, safety_margin, rows, skipped)
    best = _recommend(rows, cluster.timed)
    if best is None:
        return plan
    rows = [replace(row, recommended=row is best) for row in rows]
    chosen = next(row for row in rows if row.recommended)
    return replace(plan, rows=rows, recommended=chosen, reason=_reason(plan, chosen))


def choose_layout(
    model: ModelShape,
    cluster: Cluster,
    training: Training,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    tensor_parallel_size: int = 1,
) -> LayoutPlan:
    """The recommended layout with ``tensor_parallel_size``: ``shard_size="auto"`` makes the same choice (both take
    :func:`recommended_layout` of :func:`make_plan`).

    Raises:
        NoLayoutFitsError: Nothing fits; the message shows the smallest total per device and what would fit.
    """
    plan = make_plan(model, cluster, training, safety_margin, [tensor_parallel_size])
    return recommended_layout(plan, tensor_parallel_size)


def recommended_layout(plan: Plan, tensor_parallel_size: int | None = None) -> LayoutPlan:
    """``plan``'s recommended layout; raise :func:`no_fit_error` when it has none."""
    if plan.recommended is None:
        raise no_fit_error(plan, tensor_parallel_size)
    return plan.recommended


def no_fit_error(plan: Plan, tensor_parallel_size: int | None = None) -> NoLayoutFitsError:
    """The error for a plan where nothing fits: the smallest total, and each change that would make one fit."""
    sizes = None if tensor_parallel_size is None else [tensor_parallel_size]
    cluster, training = plan.cluster, plan.training
    if not plan.rows:
        reasons = "; ".join(f"{layout_summary(layout)}: {why}" for layout, why in plan.skipped) or "none"
        return NoLayoutFitsError(f"no layout of {plan.model.description} is valid here ({reasons}).", plan, [])
    smallest = min(plan.rows, key=lambda row: row.memory.total)
    options = _more_nodes(plan, sizes)
    fitting_changes: list[frozenset[str]] = []
    for labels, changed in _changes(training):
        if any(smaller <= labels for smaller in fitting_changes):
            continue  # a part of this combination fits already
        fitting = make_plan(plan.model, cluster, changed, plan.safety_margin, sizes).recommended
        if fitting is not None:
            fitting_changes.append(labels)
            options.append(f"{' + '.join(sorted(labels))} ({_fit_summary(fitting)})")
    memory = smallest.memory
    message = (
        f"no layout fits {format_bytes(plan.usable_memory)} per device ({format_bytes(cluster.device_memory)} less a"
        f" {plan.safety_margin:.0%} safety margin) for {plan.model.description} with {training.precision},"
        f" {training.workload.optimizer}: the smallest total is {format_bytes(memory.total)} per device with"
        f" {layout_summary(smallest.layout)} (parameters {format_bytes(memory.parameters)}, gradients"
        f" {format_bytes(memory.gradients)}, optimizer {format_bytes(memory.optimizer)}, gathered"
        f" {format_bytes(memory.gathered)}, activations ~{format_bytes(memory.activations)})."
    )
    if options:
        message += " These would fit: " + "; ".join(options) + "."
    else:
        message += (
            " Nothing tried fits (up to 64x the nodes, CPU offload, activation checkpointing, bf16-true): reduce the"
            " micro-batch or the sequence length."
        )
    return NoLayoutFitsError(message, plan, options)


def _changes(training: Training) -> list[tuple[frozenset[str], Training]]:
    """Each change not already set, then their combinations, smallest first."""
    single: list[tuple[str, dict]] = []
    if not training.activation_checkpointing:
        single.append(("activation checkpointing", {"activation_checkpointing": True}))
    if not training.cpu_offload:
        single.append(("CPU offload", {"cpu_offload": True}))
    if training.precision not in ("bf16-true", "16-true"):
        single.append(("precision bf16-true", {"precision": "bf16-true"}))
    changes = []
    for size in range(1, len(single) + 1):
        for chosen in itertools.combinations(single, size):
            kwargs = {key: value for _, change in chosen for key, value in change.items()}
            changes.append((frozenset(label for label, _ in chosen), replace(training, **kwargs)))
    return changes


def _more_nodes(plan: Plan, sizes: list[int] | None) -> list[str]:
    """The fewest nodes that fit: one more at a time up to 16 more, then doubling, up to 64x."""
    start = plan.cluster.num_nodes
    counts = list(range(start + 1, start + 17))
    counts += [start * 2**power for power in range(1, 7) if start * 2**power > start + 16]
    for nodes in counts:
        fitting = make_plan(
            plan.model, replace(plan.cluster, num_nodes=nodes), plan.training, plan.safety_margin, sizes
        )
        if fitting.recommended is not None:
            return [f"{nodes} nodes ({_fit_summary(fitting.recommended)})"]
    return []


def _fit_summary(row: LayoutPlan) -> str:
    host = f", {format_bytes(row.memory.host)} CPU memory per device" if row.memory.host else ""
    return f"{layout_summary(row.layout)}: {format_bytes(row.memory.total)} per device{host}"


def ranking_cost(row: LayoutPlan, timed: bool) -> float:
    """What the recommendation minimises: seconds per token with bandwidths, else inter-node bytes per token."""
    rates = row.throughput
    if rates is None:  # a row built by hand: rank it last
        return float("inf")
    if timed:
        return rates.seconds_per_token or 0.0
    return rates.inter_node_bytes_per_token


def _recommend(rows: list[LayoutPlan], timed: bool = False) -> LayoutPlan | None:
    fitting = [row for row in rows if row.fits]
    if not fitting:
        return None
    best = min(ranking_cost(row, timed) for row in fitting)
    near = [row for row in fitting if ranking_cost(row, timed) <= best * (1 + _SAME_TRAFFIC)]
    return min(near, key=lambda row: (row.layout.tensor_parallel_size, row.layout.shard_size))


def _reason(plan: Plan, row: LayoutPlan) -> str:
    layout, memory, rates = row.layout, row.memory, row.throughput
    timed = plan.cluster.timed
    fits = f"fits ({format_bytes(memory.total)} of {format_bytes(plan.usable_memory)} usable per device)"
    if layout.num_nodes == 1 and not timed:
        why = "nothing crosses nodes on one node, and it is the smallest shard group that fits"
    else:
        best = min(ranking_cost(r, timed) for r in plan.rows)
        among = "all layouts" if ranking_cost(row, timed) <= best * (1 + _SAME_TRAFFIC) else "the layouts that fit"
        if timed:
            why = (
                f"and has the shortest estimated step time per token of {among} (within {_SAME_TRAFFIC:.0%}):"
                f" {format_seconds(rates.step_seconds)} per step of {rates.tokens_per_step:,} tokens,"
                f" ~{rates.tokens_per_second:,.0f} tokens/s, MFU ~{rates.mfu:.0%}"
            )
        else:
            why = (
                f"and sends the fewest bytes between nodes per token of {among} (within {_SAME_TRAFFIC:.0%}):"
                f" {format_bytes(rates.inter_node_bytes_per_token)} per token"
                f" ({format_bytes(row.traffic.inter_node_bytes)} per node per step of {rates.tokens_per_step:,}"
                f" tokens, data-parallel size {rates.data_parallel_size})"
            )
    if layout.shard_size <= layout.ranks_per_node and layout.replicate_size > 1 and layout.num_nodes > 1:
        why += ", only the gradient all-reduce of each shard"
    if layout.tensor_parallel_size > 1:
        why += f"; tensor_parallel_size={layout.tensor_parallel_size}: no layout with less tensor parallelism fits"
        why += "" if layout.num_nodes == 1 and not timed else " with as little cost per token"
    separator = " " if layout.num_nodes > 1 or timed else ": "
    return f"{layout_summary(layout)} {fits}{separator}{why}"


def _seconds(count: float, bandwidth: float | str | None) -> float | None:
    return None if bandwidth is None else count / float(bandwidth)
