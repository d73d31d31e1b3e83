"""The plan: every valid layout with its memory and traffic, the recommended one, and what to change when none fits.

Every layout is compared at **one global batch** (the user's ``global_batch_size``, else the planner's stated
default; see :mod:`~fabric_hsdp.planning.step`), so every row processes the same tokens per optimizer step. Each row
weighs the levers experts pull (issue #45): the largest micro-batch that fits (fewer micro-batches, fewer FSDP gathers
per step), no, selective or full activation checkpointing where recompute lets a larger micro-batch fit, and the
weights kept gathered for the step (one gather per step) where the memory allows; it runs the fastest option. A row
fits when its total, with the activation estimate counted 25 % over, is within the device memory less the safety
margin.

The recommendation (and ``HybridFSDPStrategy(shard_size="auto")``, which uses the same function) among the rows that
fit: the shortest estimated step time, compute included, with the bandwidths given or, where one is not given, a
stated typical interconnect (:data:`TYPICAL_FABRIC`); within 2 % the least TP, recompute and gathering, then (with an
assumed bandwidth) the fewest bytes between nodes, then the smallest shard group. The ranking and the
``recommended:`` line (why the winner won: its figure and whether it is compute-bound, the lever that won and by how
much, the runner-up, and the best layout of every other tensor-parallel size) are
:mod:`~fabric_hsdp.planning.ranking`'s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from fabric_hsdp.errors import NoLayoutFitsError
from fabric_hsdp.planning.context import context_parallel_candidates, context_parallel_problem
from fabric_hsdp.planning.experts import expert_parallel_candidates, expert_parallel_problem
from fabric_hsdp.planning.layout import candidate_layouts, layout_summary
from fabric_hsdp.planning.memory import Memory, Training, memory_per_device
from fabric_hsdp.planning.model import ModelShape
from fabric_hsdp.planning.ranking import lever_cost, near_ties, reason, recommend
from fabric_hsdp.planning.step import (
    ACTIVATION_HEADROOM,
    StepShape,
    batch_problem,
    default_global_batch,
    describe_step,
    step_options,
    with_headroom,
)
from fabric_hsdp.planning.throughput import DEFAULT_COMPUTE_EFFICIENCY, Throughput, parse_flops, throughput
from fabric_hsdp.planning.traffic import Traffic, traffic_per_step
from fabric_hsdp.topology import Topology
from fabric_hsdp.units import format_bytes, parse_bandwidth, parse_bytes

DEFAULT_SAFETY_MARGIN = 0.1
# Context parallelism is weighed only where nothing fits without it: it asks the training loop to split each
# sequence over the group (the strategy's, not the model's, change), and its key/value gathers sit on every layer's
# critical path, so it is the lever for sequences too long to fit, not for speed. --context_parallel_size weighs a size.
CONTEXT_PARALLEL_RULE = "context parallelism weighed only where no layout fits without it"
# The interconnect assumed where none is given: an H100 node as DGX H100 / HGX H100 clusters (and AWS p5, Azure
# ND H100 v5) build it, eight 400 Gbit/s InfiniBand or Ethernet NICs (one per GPU) and NVLink 4 at 450 GB/s per GPU
# per direction. Stated in the plan's output.
TYPICAL_INTER_NODE_BANDWIDTH = "3200Gbit/s"
TYPICAL_INTRA_NODE_BANDWIDTH = "450GB/s"
TYPICAL_FABRIC = "an H100 node's: 8 x 400 Gbit/s NICs (3200 Gbit/s) between nodes, NVLink 450 GB/s per device"


@dataclass(frozen=True)
class Cluster:
    """The machines: nodes, devices per node, memory per device, and (optional) link bandwidths.

    Attributes:
        num_nodes: Nodes in the job.
        devices_per_node: Devices (ranks) per node.
        device_memory: Bytes per device (or a string like ``"80GB"``).
        inter_node_bandwidth: Bytes/s each node can send to the others (or ``"400Gbit/s"``); not given: the
            typical H100 node's, :data:`TYPICAL_INTER_NODE_BANDWIDTH` (the plan says it assumed it).
        intra_node_bandwidth: Bytes/s each device can send to the others of its node (or ``"450GB/s"``); not
            given: :data:`TYPICAL_INTRA_NODE_BANDWIDTH`.
        backend: ``"nccl"`` or ``"gloo"`` (whose reduce-scatter is an all-reduce, twice the bytes).
        device_flops: Peak FLOP/s per device in the compute dtype (or ``"989TFLOPS"``); no value: an H100's dense
            bf16 peak (989 TFLOP/s) is assumed and the table says so.
        compute_efficiency: The fraction of ``device_flops`` the model's FLOPs run at (default 0.4).
        assumed_bandwidths: Set by the cluster: the names of the bandwidths it assumed (not given).
    """

    num_nodes: int
    devices_per_node: int
    device_memory: int | str
    inter_node_bandwidth: float | str | None = None
    intra_node_bandwidth: float | str | None = None
    backend: str = "nccl"
    device_flops: float | str | None = None
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY
    assumed_bandwidths: tuple[str, ...] = ()  # filled in: the bandwidths not given, assumed typical

    def __post_init__(self) -> None:
        # kept through dataclasses.replace: a replanned cluster still says what was assumed
        assumed = tuple(
            name
            for name in ("inter_node_bandwidth", "intra_node_bandwidth")
            if getattr(self, name) is None or name in self.assumed_bandwidths
        )
        object.__setattr__(self, "assumed_bandwidths", assumed)
        if self.inter_node_bandwidth is None:
            object.__setattr__(self, "inter_node_bandwidth", TYPICAL_INTER_NODE_BANDWIDTH)
        if self.intra_node_bandwidth is None:
            object.__setattr__(self, "intra_node_bandwidth", TYPICAL_INTRA_NODE_BANDWIDTH)
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
    """One row of the plan: a layout, the step it runs the global batch with, and its memory and traffic per step."""

    layout: Topology
    memory: Memory
    traffic: Traffic
    fits: bool
    inter_node_seconds: float | None
    intra_node_seconds: float | None
    recommended: bool = False
    throughput: Throughput | None = None
    training: Training | None = None  # the micro-batch, checkpointing and gathering this row runs
    step: StepShape | None = None
    options: tuple[LayoutPlan, ...] = ()  # every option of this layout that fits (the row's own included)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def recomputes(self) -> bool:
        return self.training is not None and self.training.checkpointing != "none"

    @property
    def keeps_gathered(self) -> bool:
        return self.training is not None and self.training.keep_gathered_while_accumulating

    @property
    def total_with_headroom(self) -> int:
        """The total that must fit: the activation estimate counted :data:`ACTIVATION_HEADROOM` over."""
        return with_headroom(self.memory).total


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
    global_batch_size: int = 0  # sequences per optimizer step, every row
    global_batch_given: bool = False  # the user's; else the planner's default
    adapt: bool = True  # rows choose their micro-batch and checkpointing
    tensor_parallel_sizes: list[int] | None = None
    weigh_recompute: bool = True  # rows weigh selective and full activation checkpointing
    weigh_gathering: bool = True  # rows weigh keeping the weights gathered for the step
    expert_parallel_sizes: list[int] | None = None  # the user's; None: every size the model and topology allow
    context_parallel_sizes: list[int] | None = None  # the user's; None: every size the topology allows

    @property
    def usable_memory(self) -> int:
        return int(self.cluster.device_memory * (1 - self.safety_margin))

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.training.workload.seq_len


def make_plan(
    model: ModelShape,
    cluster: Cluster,
    training: Training,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    tensor_parallel_sizes: list[int] | None = None,
    global_batch_size: int | None = None,
    adapt: bool = True,
    weigh_recompute: bool = True,
    weigh_gathering: bool = True,
    expert_parallel_sizes: list[int] | None = None,
    context_parallel_sizes: list[int] | None = None,
) -> Plan:
    """Plan every layout the topology accepts (and the model can be split into) at one global batch; recommend one.

    Args:
        model: The model's shapes (``fabric_hsdp.planning.load_model_shape`` or ``model_shape_of_module``).
        cluster: Nodes, devices, memory and bandwidths.
        training: Precision, workload, activation checkpointing, offload. With ``adapt``, the micro-batch sets the
            default global batch and the checkpointing is the most a row may use.
        safety_margin: Fraction of the device memory kept free (allocator fragmentation, CUDA context, buffers).
        tensor_parallel_sizes: Only these TP sizes (default: every divisor of the devices per node).
        global_batch_size: Sequences per optimizer step for every row (default: the world size over the smallest TP
            size, times the micro-batch; the table states it).
        adapt: Each row picks its micro-batch and checkpointing (see :mod:`~fabric_hsdp.planning.step`); False keeps
            ``training``'s (what ``shard_size="auto"`` does: the script's batch is fixed).
        weigh_recompute: With ``adapt``, each row weighs no, selective and full activation checkpointing (else only
            ``training``'s mode, where it needs it to fit).
        weigh_gathering: With ``adapt``, each row weighs keeping the weights gathered for the step (one gather per
            step) where that fits (else ``training``'s choice).
        expert_parallel_sizes: Only these EP sizes (default: for a model with fused routed experts, every divisor
            of its experts per layer that divides the shard group and the devices per node; else 1).
        context_parallel_sizes: Only these CP sizes. Default: none (1) where some layout fits without it, else
            every divisor of the devices per node that divides the shard group, without tensor or expert
            parallelism (:data:`CONTEXT_PARALLEL_RULE`); a size whose 2 x C does not divide the sequence length is
            skipped with the reason.
    """
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin={safety_margin!r} must be in [0, 1).")
    arguments = (model, cluster, training, safety_margin, tensor_parallel_sizes, global_batch_size, adapt)
    arguments += (weigh_recompute, weigh_gathering, expert_parallel_sizes)
    if context_parallel_sizes is None:  # the last resort (CONTEXT_PARALLEL_RULE), still the user's choice to replan
        plan = _plan(*arguments, [1])
        if plan.recommended is not None:
            return replace(plan, context_parallel_sizes=None)
        weighed = _plan(*arguments, context_parallel_candidates(cluster.devices_per_node))
        # where it does not make a layout fit either, the plan (and its error) is the one without it
        return replace(weighed if weighed.recommended is not None else plan, context_parallel_sizes=None)
    return _plan(*arguments, context_parallel_sizes)


def _plan(
    model: ModelShape,
    cluster: Cluster,
    training: Training,
    safety_margin: float,
    tensor_parallel_sizes: list[int] | None,
    global_batch_size: int | None,
    adapt: bool,
    weigh_recompute: bool,
    weigh_gathering: bool,
    expert_parallel_sizes: list[int] | None,
    context_parallel_sizes: list[int],
) -> Plan:
    per_node = cluster.devices_per_node
    sizes = tensor_parallel_sizes or [size for size in range(1, per_node + 1) if per_node % size == 0]
    world = cluster.num_nodes * per_node
    given = global_batch_size is not None
    if given and (
        isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1
    ):
        raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive number of sequences.")
    batch = global_batch_size if given else default_global_batch(world, sizes, training.workload.micro_batch_size)
    usable = cluster.device_memory * (1 - safety_margin)
    rows, skipped = [], []
    experts = expert_parallel_sizes or expert_parallel_candidates(model)
    for layout in candidate_layouts(
        cluster.num_nodes, per_node, tensor_parallel_sizes, experts, context_parallel_sizes
    ):
        problem = model.tensor_parallel_problem(layout.tensor_parallel_size)
        problem = problem or expert_parallel_problem(model, layout.expert_parallel_size)
        problem = problem or context_parallel_problem(training.workload.seq_len, layout.context_parallel_size)
        problem = problem or batch_problem(batch, layout.data_parallel_size)
        weigh = (weigh_recompute, weigh_gathering)
        row = None if problem else _plan_layout(model, cluster, training, layout, batch, usable, adapt, weigh)
        if row is None:
            problem = problem or (
                f"micro-batch {training.workload.micro_batch_size} does not divide its"
                f" {batch // layout.data_parallel_size} sequences per data-parallel rank"
            )
            skipped.append((layout, problem))
            continue
        rows.append(row)
    plan = Plan(
        model, cluster, training, safety_margin, rows, skipped, None, "", batch, given, adapt, sizes, *weigh,
        expert_parallel_sizes, context_parallel_sizes,
    )  # fmt: skip
    best = recommend(rows, bool(cluster.assumed_bandwidths))
    if best is None:
        return plan
    rows = [replace(row, recommended=row is best) for row in rows]
    chosen = next(row for row in rows if row.recommended)
    return replace(plan, rows=rows, recommended=chosen, reason=reason(replace(plan, rows=rows), chosen))


def _plan_layout(
    model: ModelShape,
    cluster: Cluster,
    training: Training,
    layout: Topology,
    batch: int,
    usable: float,
    adapt: bool,
    weigh: tuple[bool, bool] = (False, False),
) -> LayoutPlan | None:
    """The row of ``layout``: among its step options that fit, the fastest (a near-tie: the least recompute, then
    not kept gathered); when none fits, the option with the least memory. None when it has no option (a fixed
    micro-batch that does not divide its sequences). ``weigh``: (recompute, gathering), see :func:`make_plan`."""
    data_parallel = layout.data_parallel_size
    options = step_options(training, batch // data_parallel, adapt, *weigh)
    if not options:
        return None
    candidates, seen, last = [], set(), None
    largest: dict[bool, int] = {}  # per gathering: the largest micro-batch that fits with less recompute
    for chosen, accumulation in options:
        kept = chosen.keep_gathered_while_accumulating
        key = (chosen.checkpointing, kept)
        if key in seen:
            continue  # a larger micro-batch of these levers fits already: fewer gathers per step
        sizes = (layout.tensor_parallel_size, layout.expert_parallel_size, layout.context_parallel_size)
        memory = memory_per_device(model, chosen, layout.fsdp_size, *sizes)
        fits = with_headroom(memory).total <= usable
        last = (chosen, accumulation, memory)
        if fits:
            seen.add(key)
            if chosen.workload.micro_batch_size <= largest.get(kept, 0):
                continue  # more recompute for no larger micro-batch: never faster
            largest[kept] = chosen.workload.micro_batch_size
            candidates.append(_row(model, cluster, chosen, layout, batch, accumulation, memory, True))
    if not candidates:
        chosen, accumulation, memory = last
        return _row(model, cluster, chosen, layout, batch, accumulation, memory, False)
    best = min(near_ties(candidates), key=lever_cost)
    return replace(best, options=tuple(candidates))


def _row(
    model: ModelShape,
    cluster: Cluster,
    training: Training,
    layout: Topology,
    batch: int,
    accumulation: int,
    memory: Memory,
    fits: bool,
) -> LayoutPlan:
    traffic = traffic_per_step(model, training, layout, cluster.backend, accumulation)
    rates = throughput(
        model,
        training,
        layout,
        traffic,
        cluster.inter_node_bandwidth,
        cluster.intra_node_bandwidth,
        cluster.device_flops,
        cluster.compute_efficiency,
        accumulation,
    )
    step = StepShape(batch, layout.data_parallel_size, training.workload.micro_batch_size, accumulation)
    inter_seconds = _seconds(traffic.inter_node_bytes, cluster.inter_node_bandwidth)
    intra_seconds = _seconds(traffic.intra_node_bytes, cluster.intra_node_bandwidth)
    return LayoutPlan(
        layout, memory, traffic, fits, inter_seconds, intra_seconds, throughput=rates, training=training, step=step
    )


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
    smallest = min(plan.rows, key=lambda row: row.total_with_headroom)
    options = _more_nodes(plan, sizes)
    fitting_changes: list[frozenset[str]] = []
    for labels, changed in _changes(training, weighed=plan.adapt and plan.weigh_recompute):
        if any(smaller <= labels for smaller in fitting_changes):
            continue  # a part of this combination fits already
        fitting = _replan(plan, sizes, training=changed).recommended
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
        f" {format_bytes(memory.gathered)}, activations ~{format_bytes(memory.activations)}; with the estimated"
        f" activations counted {ACTIVATION_HEADROOM:.0%} over, {format_bytes(smallest.total_with_headroom)})."
    )
    if options:
        message += " These would fit: " + "; ".join(options) + "."
    else:
        message += (
            " Nothing tried fits (up to 64x the nodes, CPU offload, activation checkpointing, bf16-true): reduce the"
            " micro-batch or the sequence length."
        )
    return NoLayoutFitsError(message, plan, options)


def _replan(plan: Plan, sizes: list[int] | None, **changes: Cluster | Training) -> Plan:
    """``plan`` again with another cluster or training: the same global batch when the user gave it."""
    batch = plan.global_batch_size if plan.global_batch_given else None
    cluster, training = changes.get("cluster", plan.cluster), changes.get("training", plan.training)
    weigh = (plan.weigh_recompute, plan.weigh_gathering)
    return make_plan(
        plan.model, cluster, training, plan.safety_margin, sizes, batch, plan.adapt, *weigh, plan.expert_parallel_sizes,
        plan.context_parallel_sizes,
    )  # fmt: skip


def _changes(training: Training, weighed: bool = False) -> list[tuple[frozenset[str], Training]]:
    """Each change not already set (activation checkpointing only where the plan did not weigh it), then their
    combinations, smallest first."""
    single: list[tuple[str, dict]] = []
    if not training.activation_checkpointing and not weighed:
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
        fitting = _replan(plan, sizes, cluster=replace(plan.cluster, num_nodes=nodes))
        if fitting.recommended is not None:
            return [f"{nodes} nodes ({_fit_summary(fitting.recommended)})"]
    return []


def _fit_summary(row: LayoutPlan) -> str:
    host = f", {format_bytes(row.memory.host)} CPU memory per device" if row.memory.host else ""
    step = f", {describe_step(row.training, row.step)}" if row.training is not None and row.step is not None else ""
    return f"{layout_summary(row.layout)}{step}: {format_bytes(row.memory.total)} per device{host}"


def _seconds(count: float, bandwidth: float | str | None) -> float | None:
    return None if bandwidth is None else count / float(bandwidth)
