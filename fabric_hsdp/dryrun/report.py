"""The dry run's report: the world and this rank's place, memory by phase, checkpoint bytes, and the plan beside it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fabric_hsdp.units import format_binary_bytes

NOT_MEANINGFUL = "collectives carry no data: losses are not meaningful"
PHASES = ("setup", "load", "step", "save")


@dataclass
class ExpertsHeld:
    """A mixture-of-experts layer's experts as this rank holds them (the first layer's; every layer is alike).

    Attributes:
        layer: The experts module's name.
        experts: Experts per layer (``E``).
        expert_parallel_size: Ranks the experts are split over (``N``); this rank computes ``E / N`` of them.
        shapes: Each fused parameter's local shape (what this rank holds, after FSDP's share) and global shape.
    """

    layer: str
    experts: int
    expert_parallel_size: int
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

    def text(self) -> str:
        held = ", ".join(f"{name} {list(local)} of {list(full)}" for name, (local, full) in self.shapes.items())
        if self.expert_parallel_size == 1:
            split = "not split (expert_parallel_size 1): sharded by FSDP"
        else:
            split = (
                f"split {self.expert_parallel_size} ways over 'expert': this rank computes"
                f" {self.experts // self.expert_parallel_size}"
            )
        return f"  experts: {self.experts} per layer, {split}; {self.layer} holds {held}"


@dataclass
class PlannedMemory:
    """The planner's bytes per device for the same layout and workload (``fabric-hsdp plan``'s formulas)."""

    parameters: int
    optimizer: int
    gradients: int
    gathered: int
    activations: int
    total: int
    workload: str


@dataclass
class DryRunReport:
    """What one rank of the dry-run world did and used. Memory figures are bytes above the resident memory at
    ``fabric.launch()``; ``device`` figures exist only on CUDA."""

    world: str
    rank: int
    world_size: int
    node_rank: int
    local_rank: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    coordinates: tuple[int, ...]
    layout: str
    device: str
    precision: str
    local_parameters: int
    global_parameters: int
    local_parameter_bytes: int
    checkpoint_read: int
    steps: int
    max_steps: int
    phases: dict[str, dict[str, Any]]
    saves: list[dict[str, Any]]
    planned: PlannedMemory | None
    notes: list[str] = field(default_factory=list)
    experts: ExpertsHeld | None = None

    @property
    def step_peak(self) -> int:
        phase = self.phases.get("step") or {}
        if phase.get("counted_peak") is not None:
            return int(phase["counted_peak"])
        peak = phase.get("device_peak")
        return int(peak if peak is not None else phase.get("host_peak", 0))

    @property
    def ratio(self) -> float | None:
        if self.planned is None or not self.planned.total or "step" not in self.phases:
            return None
        return self.step_peak / self.planned.total

    def as_dict(self) -> dict[str, Any]:
        document = asdict(self)
        document["step_peak"], document["measured_over_planned"] = self.step_peak, self.ratio
        document["losses"] = NOT_MEANINGFUL
        return document

    def text(self) -> str:
        """The report as printed by ``fabric-hsdp dryrun``."""
        size = format_binary_bytes
        coordinates = ", ".join(f"{n}={c}" for n, c in zip(self.mesh_dim_names, self.coordinates, strict=True))
        fraction = self.local_parameters / self.global_parameters if self.global_parameters else 0.0
        lines = [
            f"dry run: {self.world}",
            f"  mesh {self.mesh_shape} {self.mesh_dim_names}: this rank at ({coordinates}); {self.layout}",
            f"  device: {self.device}; precision {self.precision}",
            f"  parameters held: {self.local_parameters:,} of {self.global_parameters:,} (1/{1 / fraction:,.0f};"
            f" {size(self.local_parameter_bytes)})"
            if fraction
            else "  parameters held: none",
            *([self.experts.text()] if self.experts else []),
            f"  steps: {self.steps} of --max_steps {self.max_steps}",
            "  memory above the start of fabric.launch(), peak per phase:",
        ]
        for name in PHASES:
            phase = self.phases.get(name)
            if phase is None:
                continue
            device = "" if phase["device_peak"] is None else f", device {size(phase['device_peak'])}"
            read = (
                f", read {size(self.checkpoint_read)} of checkpoint tensor data"
                f" ({size(phase['bytes_read'])} through read calls in all)"
                if name == "load"
                else ""
            )
            if phase.get("counted_peak") is not None:
                lines.append(
                    f"    {name:<6} counted {size(phase['counted_peak'])} (no compute: resident at the first forward"
                    f" {size(phase['counted_peak'] - phase['counted_allocations'])} + the steps' allocations at their"
                    f" peak {size(phase['counted_allocations'])}) in {phase['seconds']:.1f} s"
                )
                continue
            lines.append(f"    {name:<6} host {size(phase['host_peak'])}{device}{read} in {phase['seconds']:.1f} s")
        for save in self.saves:
            if save["kind"] == "full":
                lines.append(
                    f"  save '{save['path']}' (full file): rank 0 gathers and writes"
                    f" {size(save['expected_share'])} from this rank's view; nothing written in a dry run"
                )
                continue
            by = " (by the dry run: the script's own save comes after the step limit)" if save["by_dry_run"] else ""
            lines.append(
                f"  save '{save['path']}'{by}: this rank wrote {size(save['written'])} in {len(save['files'])}"
                f" file(s) to {save['scratch']}; its share of tensor bytes after DCP spreads replicated chunks:"
                f" {size(save['expected_share'])}. Not committed: the other ranks' files do not exist in a dry run."
            )
        if self.planned is not None:
            planned = self.planned
            ratio = self.ratio
            lines.append(
                f"  planner ({planned.workload}): parameters {size(planned.parameters)}, optimizer"
                f" {size(planned.optimizer)}, gradients {size(planned.gradients)}, gathered {size(planned.gathered)},"
                f" activations {size(planned.activations)}, peak {size(planned.total)}"
            )
            if ratio is not None:
                how = "counted" if (self.phases.get("step") or {}).get("counted_peak") is not None else "measured"
                lines.append(
                    f"  {how} peak of a step {size(self.step_peak)} vs planned {size(planned.total)}: {ratio:.2f}x"
                )
        lines.extend(f"  note: {note}" for note in self.notes)
        lines.append(f"  {NOT_MEANINGFUL}")
        return "\n".join(lines)


def build_report(session: Any) -> DryRunReport:
    """The report of a finished :class:`~fabric_hsdp.dryrun.session.DryRunSession`."""
    from torch.distributed.tensor import DTensor

    strategy, world = session.strategy, session.world
    topology = strategy.topology
    local = global_ = local_bytes = 0
    if session.model is not None:
        for parameter in session.model.parameters():
            tensor = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            local += tensor.numel()
            local_bytes += tensor.numel() * tensor.element_size()
            global_ += parameter.numel()
    device = str(strategy.root_device)
    if session.device.type == "cuda":
        device = f"cuda:0 of this machine (stands in for local rank {world.local_rank}'s GPU)"
    notes = list(session.notes)
    if not session.meter.mmap_threshold_set:
        notes.append("glibc's mallopt is not available: host figures include memory the allocator keeps after frees")
    if not session.meter.resets:
        notes.append("/proc/self/clear_refs is not writable: each phase's host peak is the run's peak so far")
    if session.no_compute:
        notes.append(
            "--no_compute: the steps ran on tensors with shapes and no data; their memory is counted allocations"
            " (what torch asks its allocator for, as CUDA's memory_allocated counts), not a run's measured memory"
        )
    if session.steps < session.max_steps:
        notes.append(f"the script ended after {session.steps} optimizer step(s), before --max_steps")
    if session.steps == 1 and any(_lazy_state(optimizer) for optimizer in session.optimizers):
        notes.append(
            "one step measured: its backward ran before the optimizer allocated its state (at its first step()),"
            " which the planner counts throughout; --max_steps 2 measures a steady step"
        )
    return DryRunReport(
        world=world.describe(),
        rank=world.rank,
        world_size=world.world_size,
        node_rank=world.node_rank,
        local_rank=world.local_rank,
        mesh_shape=tuple(topology.mesh_shape),
        mesh_dim_names=tuple(topology.mesh_dim_names),
        coordinates=tuple(topology.coordinates(world.rank)),
        layout=f"shard_size {topology.shard_size}, tensor_parallel_size {topology.tensor_parallel_size},"
        + (f" expert_parallel_size {topology.expert_parallel_size}," if topology.expert_parallel_size > 1 else "")
        + f" data-parallel rank {topology.data_parallel_rank(world.rank)} of {topology.data_parallel_size}",
        device=device,
        precision=strategy.precision_name,
        local_parameters=local,
        global_parameters=global_,
        local_parameter_bytes=local_bytes,
        checkpoint_read=session.checkpoint_read,
        steps=session.steps,
        max_steps=session.max_steps,
        phases={name: asdict(phase) for name, phase in session.meter.phases.items()},
        saves=[asdict(save) for save in session.saves],
        planned=_planned(session, notes),
        notes=notes,
        experts=_experts_held(session.model, topology.expert_parallel_size),
    )


def _experts_held(model: Any, expert_parallel_size: int) -> ExpertsHeld | None:
    """The first mixture-of-experts layer's experts of ``model`` (set up) as this rank holds them; None without."""
    from torch.distributed.tensor import DTensor

    from fabric_hsdp.models.experts import expert_count, expert_modules

    found = expert_modules(getattr(model, "module", model)) if model is not None else []
    if not found:
        return None
    name, experts = found[0]
    shapes = {
        parameter_name: (
            tuple((parameter.to_local() if isinstance(parameter, DTensor) else parameter).shape),
            tuple(parameter.shape),
        )
        for parameter_name, parameter in experts.named_parameters(recurse=False)
    }
    return ExpertsHeld(name, expert_count(experts), expert_parallel_size, shapes)


def _planned(session: Any, notes: list[str]) -> PlannedMemory | None:
    """The planner's figures for the layout the strategy built and the workload the script ran."""
    if session.model_shape is None:
        return None
    from fabric_hsdp.planning.memory import Workload, memory_per_device

    strategy = session.strategy
    topology = strategy.topology
    batch, seq_len = session.tokens_shape or session.no_grad_tokens_shape or (1, 2048)
    if session.tokens_shape is None and session.no_grad_tokens_shape is not None:
        notes.append(
            f"no training forward seen: the planner's activations are for the first forward's {batch} x {seq_len}"
            " tokens (without gradients, e.g. a validation batch)"
        )
    elif session.tokens_shape is None:
        notes.append("no forward seen: the planner's activations are for 1 x 2048 tokens")
    workload = Workload(int(batch), int(seq_len), _optimizer_kind(session.optimizers))
    training = strategy.planner_training(workload)
    sizes = (topology.fsdp_size, topology.tensor_parallel_size, topology.expert_parallel_size)
    memory = memory_per_device(session.model_shape, training, *sizes)
    return PlannedMemory(
        parameters=memory.parameters,
        optimizer=memory.optimizer,
        gradients=memory.gradients,
        gathered=memory.gathered,
        activations=memory.activations,
        total=memory.total,
        workload=", ".join([f"{batch} x {seq_len} tokens", workload.optimizer, *_levers(training)]),
    )


def _levers(training: Any) -> list[str]:
    """The options of ``training`` that change the planner's activation estimate, as the report names them."""
    levers = []
    if training.activation_checkpointing and training.activation_checkpointing_mode != "none":
        levers.append(f"activation checkpointing ({training.activation_checkpointing_mode})")
    levers += ["sequence parallel"] * training.sequence_parallel + ["loss parallel"] * training.loss_parallel
    return levers


def _lazy_state(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps per-parameter state (AdamW's moments, SGD's momentum), made at its first step."""
    return any(state for state in getattr(optimizer, "state", {}).values())


def _optimizer_kind(optimizers: list[Any]) -> str:
    import torch

    for optimizer in optimizers:
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            return "adamw"
        if isinstance(optimizer, torch.optim.SGD):
            momentum = optimizer.param_groups[0].get("momentum", 0)
            return "sgd" if momentum else "none"
    return "adamw" if optimizers else "none"
