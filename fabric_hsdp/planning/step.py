"""The optimizer step each layout runs at the plan's one global batch: micro-batch, accumulation, checkpointing.

Every row of a plan processes the same global batch ``G`` sequences per optimizer step (the user's
``global_batch_size``, else the planner's stated default: the world size over the smallest TP size, times the
micro-batch), so the rows do the same work and their bytes and times compare directly. A layout with ``D`` data-parallel
ranks gives each ``n = G / D`` sequences per step (a layout whose ``D`` does not divide ``G`` is skipped with the
reason); it runs them as ``a = n / m`` micro-batches of ``m`` sequences.

Tensor parallelism and recompute free memory (a ``T``-th of the gathered layers and of the split activations; the
activations recompute does not keep): with ``adapt`` the planner spends it on the largest micro-batch that fits
(fewer micro-batches: fewer FSDP gathers per step), per checkpointing mode (:func:`checkpointing_modes`) and with or
without the weights kept gathered for the step; the plan takes the fastest of these options. Without ``adapt`` (the
strategy's ``shard_size="auto"``, whose micro-batch is the script's) the micro-batch, checkpointing and gathering are
the user's.

"Fits" keeps headroom for what is estimated: the activations (an estimate, see :mod:`~fabric_hsdp.planning.memory`)
count :data:`ACTIVATION_HEADROOM` more; the exact sharded state does not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fabric_hsdp.planning.memory import Memory, Training

# the activation estimate's margin: its error against measured saved tensors, and the allocator's fragmentation of
# many short-lived tensors, are what the exact columns do not have
ACTIVATION_HEADROOM = 0.25


@dataclass(frozen=True)
class StepShape:
    """How one layout runs the global batch: ``accumulation_steps`` micro-batches of ``micro_batch_size``."""

    global_batch_size: int
    data_parallel_size: int
    micro_batch_size: int
    accumulation_steps: int

    @property
    def sequences_per_rank(self) -> int:
        return self.micro_batch_size * self.accumulation_steps


def default_global_batch(world_size: int, tensor_parallel_sizes: list[int], micro_batch_size: int) -> int:
    """The planner's global batch when the user gives none: what the least tensor-parallel layouts run at the
    user's micro-batch (one micro-batch per step)."""
    return world_size // min(tensor_parallel_sizes) * micro_batch_size


def batch_problem(global_batch_size: int, data_parallel_size: int) -> str | None:
    """Why a layout cannot run the global batch, or None."""
    if global_batch_size % data_parallel_size:
        return (
            f"the global batch of {global_batch_size} sequences does not split over its {data_parallel_size}"
            " data-parallel ranks"
        )
    return None


def with_headroom(memory: Memory, headroom: float = ACTIVATION_HEADROOM) -> Memory:
    """``memory`` with the activation estimate grown by ``headroom``: what a layout must fit with."""
    scale = 1 + headroom
    return replace(
        memory,
        activations=int(memory.activations * scale),
        loss_activations=int(memory.loss_activations * scale),
        recompute=int(memory.recompute * scale),
        logits=int(memory.logits * scale),
    )


def step_options(
    training: Training,
    sequences_per_rank: int,
    adapt: bool,
    weigh_recompute: bool = False,
    weigh_gathering: bool = False,
) -> list[tuple[Training, int]]:
    """The (training, accumulation steps) a layout may run its ``sequences_per_rank`` with, the least memory last.

    With ``adapt``: every micro-batch that divides ``sequences_per_rank`` (largest first), for each checkpointing
    mode (:func:`checkpointing_modes`) and, with ``weigh_gathering``, with the weights kept gathered for the step
    (where the step has several micro-batches) and without. Else only the user's micro-batch, checkpointing and
    gathering (none when the micro-batch does not divide ``sequences_per_rank``).
    """
    workload = training.workload
    if not adapt:
        if sequences_per_rank % workload.micro_batch_size:
            return []
        return [(training, sequences_per_rank // workload.micro_batch_size)]
    gathering = [training.keep_gathered_while_accumulating]
    weighed = weigh_gathering and training.reshard_after_forward is not True and not training.cpu_offload
    if weighed:
        gathering = [True, False]  # kept gathered needs more memory: tried first, so the last option is the least
    checkpointing = [
        replace(training, activation_checkpointing=mode != "none", activation_checkpointing_mode=mode)
        if mode != "none"
        else replace(training, activation_checkpointing=False)
        for mode in checkpointing_modes(training, weigh_recompute)
    ]
    sizes = [size for size in range(sequences_per_rank, 0, -1) if sequences_per_rank % size == 0]
    return [
        (
            replace(chosen, workload=replace(workload, micro_batch_size=size), keep_gathered_while_accumulating=keep),
            sequences_per_rank // size,
        )
        for keep in gathering
        for chosen in checkpointing
        for size in sizes
        # weighed, the lever is what it is for: keeping the weights across micro-batches (one micro-batch per step
        # kept gathered is reshard_after_forward=False, the user's to choose)
        if not (keep and weighed and size == sequences_per_rank)
    ]


def checkpointing_modes(training: Training, weigh_recompute: bool) -> list[str | int]:
    """The activation checkpointing modes a row may choose, the least recompute first and the least memory last:
    none; with ``weigh_recompute`` selective and full (and the user's every-k-th, between them), else the user's
    mode when checkpointing is on."""
    user = training.checkpointing
    if not weigh_recompute:
        return ["none"] + ([user] if user != "none" else [])
    return ["none", "selective", *([user] if isinstance(user, int) else []), "full"]


def recompute_rank(training: Training) -> int:
    """How much a mode recomputes, for the tie-breaks: none 0, selective 1 (element-wise ops only), every k-th
    block 2, full 3 (the whole forward of every block)."""
    mode = training.checkpointing
    return {"none": 0, "selective": 1, "full": 3}.get(mode, 2) if isinstance(mode, str) else 2


def describe_step(training: Training, step: StepShape) -> str:
    """E.g. ``micro-batch 2 x 4 accumulation steps, activation checkpointing off``."""
    mode = training.checkpointing
    checkpointing = "off" if mode == "none" else ("on" if mode == "full" else str(mode))
    steps = step.accumulation_steps
    kept = ", weights kept gathered for the step" if training.keep_gathered_while_accumulating else ""
    return (
        f"micro-batch {step.micro_batch_size} x {steps} accumulation step{'s' if steps > 1 else ''},"
        f" activation checkpointing {checkpointing}{kept}"
    )
