"""The ranking of a plan's rows and the sentence that says why the winner won.

Every row runs the same global batch, so times per step compare directly. The rows rank by the estimated step time
(with the bandwidths given, else a stated typical interconnect), within 2 %. Near-ties go to the row with the least
TP (its collectives sit on every layer's critical path, and it shrinks each device's matmuls, which the estimate
does not count), then the least expert parallelism (its all-to-alls wait on the most loaded rank, which the
estimate counts only on average), then the least context parallelism (its key/value gathers wait on the
slowest rank), then the least recompute (selective recomputes element-wise ops only, which the
estimate does not count either), then not keeping the weights gathered (less memory), then (where a bandwidth was
assumed: the estimate may be off) the fewest bytes between nodes, then the smallest shard group.

The sentence names the lever that won (activation checkpointing by mode, weights kept gathered for the step, or
none) and by how much against the best option without it, the runner-up (the best row of another layout), and the
best row of every other tensor-, expert- and context-parallel size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_hsdp.planning.layout import layout_summary
from fabric_hsdp.planning.step import ACTIVATION_HEADROOM, describe_step, recompute_rank
from fabric_hsdp.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from fabric_hsdp.planning.plan import LayoutPlan, Plan

_SAME_TIME = 0.02


def ranking_cost(row: LayoutPlan) -> float:
    """What the recommendation minimises: the estimated seconds per step (every row runs the same global batch, so
    per step is per token)."""
    rates = row.throughput
    if rates is None or rates.step_seconds is None:  # a row built by hand: rank it last
        return float("inf")
    return rates.step_seconds


def near_ties(rows: list[LayoutPlan]) -> list[LayoutPlan]:
    """The rows within 2 % of the fastest."""
    best = min(ranking_cost(row) for row in rows)
    return [row for row in rows if ranking_cost(row) <= best * (1 + _SAME_TIME)]


def lever_cost(row: LayoutPlan) -> tuple[int, bool]:
    """Among near-ties of one layout: the least recompute, then not kept gathered (the least memory)."""
    return (recompute_rank(row.training), row.keeps_gathered) if row.training is not None else (0, False)


def recommend(rows: list[LayoutPlan], assumed: bool = False) -> LayoutPlan | None:
    """The recommended row among those that fit, or None (see the module docstring). ``assumed``: a bandwidth was
    assumed, so among near-ties the fewest bytes between nodes come before the shard group."""
    fitting = [row for row in rows if row.fits]
    if not fitting:
        return None

    def simplest(row: LayoutPlan) -> tuple:
        inter_node = (row.traffic.inter_node_bytes,) if assumed else ()
        recompute, kept = lever_cost(row)
        layout = row.layout
        parallel = (layout.tensor_parallel_size, layout.expert_parallel_size, layout.context_parallel_size)
        return (*parallel, recompute, kept, *inter_node, layout.shard_size)

    return min(near_ties(fitting), key=simplest)


def _figure(row: LayoutPlan) -> str:
    """The ranked figure of ``row``, as the reason quotes it."""
    rates = row.throughput
    per_second = f"~{rates.tokens_per_second:,.0f} tokens/s, MFU ~{rates.mfu:.0%}"
    return f"{format_seconds(rates.step_seconds)} per step ({per_second})"


def _costs(row: LayoutPlan, winner: LayoutPlan) -> str:
    """What makes ``row`` dearer than ``winner``: its gathers per step, its recompute, its TP."""
    why = []
    gathers, best_gathers = _gathers(row), _gathers(winner)
    if gathers > best_gathers:
        why.append(f"it gathers the model {gathers} times per step, against {best_gathers}")
    if recompute_rank(row.training) > recompute_rank(winner.training):
        why.append("it recomputes more of the checkpointed layers' forward")
    if row.layout.tensor_parallel_size > winner.layout.tensor_parallel_size:
        why.append("more tensor-parallel collectives on every layer's critical path")
    expert, best_expert = row.layout.expert_parallel_size, winner.layout.expert_parallel_size
    if expert < best_expert:
        why.append(f"it gathers {best_expert // expert}x the experts of every MoE layer")
    if expert > best_expert:
        why.append("its token all-to-alls sit on every MoE layer's critical path")
    if row.layout.context_parallel_size > winner.layout.context_parallel_size:
        why.append("its key/value all-gathers sit on every layer's critical path")
    return "; ".join(why)


def _gathers(row: LayoutPlan) -> int:
    """All-gathers of the model per step: one per micro-batch, or one per step when kept gathered."""
    return 1 if row.keeps_gathered else row.step.accumulation_steps


def _alternatives(plan: Plan, row: LayoutPlan) -> list[str]:
    """The best row of each other tensor-, expert- and context-parallel size: its figure and why it lost."""
    lines = []
    for name in ("tensor_parallel_size", "expert_parallel_size", "context_parallel_size"):
        for size in sorted({getattr(other.layout, name) for other in plan.rows}):
            if size != getattr(row.layout, name):
                of_size = [other for other in plan.rows if getattr(other.layout, name) == size]
                lines.append(f"{name}={size}: {_best_of(of_size, row)}")
    return lines


def _best_of(rows: list[LayoutPlan], winner: LayoutPlan) -> str:
    """The best of ``rows`` against ``winner``; where none fits, the smallest."""
    fitting = [other for other in rows if other.fits]
    if not fitting:
        smallest = min(rows, key=lambda other: other.total_with_headroom)
        return (
            f"nothing fits (at best {format_bytes(smallest.total_with_headroom)} with"
            f" {layout_summary(smallest.layout)}, {describe_step(smallest.training, smallest.step)})"
        )
    return f"at best {_versus(min(fitting, key=ranking_cost), winner)}"


def _versus(other: LayoutPlan, row: LayoutPlan) -> str:
    """``other``'s layout, step and figure, its ratio to ``row``'s and what costs it."""
    ratio = ranking_cost(other) / max(ranking_cost(row), 1e-30)
    costs = _costs(other, row)
    return (
        f"{layout_summary(other.layout)}, {describe_step(other.training, other.step)}, {_figure(other)}"
        f" ({ratio:.2f}x)" + (f": {costs}" if costs else "")
    )


def lever_name(row: LayoutPlan) -> str:
    """The levers ``row`` pulls, in words, or ``"none"``."""
    levers = []
    mode = row.training.checkpointing
    if mode != "none":
        levers.append(f"{mode} activation checkpointing" if isinstance(mode, str) else f"recompute every {mode} blocks")
    if row.keeps_gathered:
        levers.append("weights kept gathered for the step")
    return " + ".join(levers) or "none"


def _without_levers(plan: Plan, row: LayoutPlan) -> LayoutPlan | None:
    """The fastest option of any layout without ``row``'s levers (neither its recompute nor its gathering)."""
    options = [
        option
        for other in plan.rows
        for option in (other.options or ((other,) if other.fits else ()))
        if not (option.keeps_gathered and row.keeps_gathered) and not (option.recomputes and row.recomputes)
    ]
    return min(options, key=ranking_cost, default=None)


def _with_levers(plan: Plan) -> LayoutPlan | None:
    """The fastest option of any layout that pulls a lever (recompute or gathering)."""
    options = [
        option
        for other in plan.rows
        for option in (other.options or ((other,) if other.fits else ()))
        if option.recomputes or option.keeps_gathered
    ]
    return min(options, key=ranking_cost, default=None)


def lever_sentence(plan: Plan, row: LayoutPlan) -> str:
    """Which lever won and by how much: the winner against the best option without its levers; with none, the
    best option with one against the winner."""
    name = lever_name(row)
    if name != "none":
        without = _without_levers(plan, row)
        if without is None:
            return f"Lever: {name}, without which nothing fits"
        ratio = ranking_cost(without) / max(ranking_cost(row), 1e-30)
        them = "them" if " + " in name else "it"
        return (
            f"Lever: {name}, {ratio:.2f}x faster than the best without {them} ({layout_summary(without.layout)},"
            f" {describe_step(without.training, without.step)}, {format_seconds(ranking_cost(without))} per step)"
        )
    pulled = _with_levers(plan)
    if pulled is None:
        return "Lever: none (no recompute or gathering fits better)"
    ratio = ranking_cost(pulled) / max(ranking_cost(row), 1e-30)
    return (
        f"Lever: none; the best with one ({lever_name(pulled)}: {layout_summary(pulled.layout)},"
        f" {describe_step(pulled.training, pulled.step)}) takes {format_seconds(ranking_cost(pulled))} per step"
        f" ({ratio:.2f}x)"
    )


def runner_up(plan: Plan, row: LayoutPlan) -> LayoutPlan | None:
    """The best fitting row of another layout."""
    others = [other for other in plan.rows if other.fits and other.layout != row.layout]
    return min(others, key=ranking_cost, default=None)


def _bound(plan: Plan, row: LayoutPlan) -> str:
    """Whether ``row``'s step is its compute's or its inter-node traffic's, by its own estimates."""
    rates = row.throughput
    inter = row.inter_node_seconds or 0.0
    if rates.compute_seconds is None:
        return ""
    what = "communication-bound" if inter > rates.compute_seconds else "compute-bound"
    return (
        f", {what} (compute {format_seconds(rates.compute_seconds)}, inter-node traffic"
        f" {format_bytes(row.traffic.inter_node_bytes)} in {format_seconds(inter)})"
    )


def reason(plan: Plan, row: LayoutPlan) -> str:
    """Why ``row`` won: its step, its fit with the headroom, the rule and its figure, the lever that won and by how
    much, the runner-up, and what each other TP size's best row would cost."""
    fits = (
        f"fits ({format_bytes(row.total_with_headroom)} of {format_bytes(plan.usable_memory)} usable per device,"
        f" the estimated activations counted {ACTIVATION_HEADROOM:.0%} over)"
    )
    assumed = bool(plan.cluster.assumed_bandwidths)
    then = "the least tensor, expert and context parallelism, recompute and gathering" + (
        ", the fewest bytes between nodes (the bandwidth is assumed)" if assumed else ""
    )
    ranked = f"the shortest estimated step time (within {_SAME_TIME:.0%}, then {then}, the smallest shard group)"
    why = f"{layout_summary(row.layout)}, {describe_step(row.training, row.step)}, {fits} and has {ranked}"
    why += f": {_figure(row)}{_bound(plan, row)}"
    layout = row.layout
    if layout.shard_size <= layout.ranks_per_node and layout.replicate_size > 1 and layout.num_nodes > 1:
        why += ", only the gradient all-reduce of each shard crosses nodes"
    why += f". {lever_sentence(plan, row)}"
    second = runner_up(plan, row)
    why += f". Runner-up: {_versus(second, row)}" if second is not None else ". Runner-up: none (no other layout fits)"
    alternatives = _alternatives(plan, row)
    if alternatives:
        why += ". Against it: " + "; ".join(alternatives)
    return why
