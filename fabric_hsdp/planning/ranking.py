"""The ranking of a plan's rows and the sentence that says why the winner won.

Every row runs the same global batch, so bytes and times per step compare directly. Without bandwidths the rows rank
by the bytes the busiest node sends between nodes per step; bytes cannot see what recompute and tensor parallelism
cost in time, so a row within 10 % that recomputes less or uses less TP wins. With a bandwidth they rank by the
estimated step time, within 2 %. Near-ties go to the row without recompute, then the least TP, then (bytes) the
fewest bytes, then the smallest shard group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_hsdp.planning.layout import layout_summary
from fabric_hsdp.planning.step import ACTIVATION_HEADROOM, describe_step
from fabric_hsdp.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from fabric_hsdp.planning.plan import LayoutPlan, Plan

_SAME_TRAFFIC = 0.02
# bytes alone cannot see what recompute and tensor parallelism cost in time: without bandwidths a row with less of
# them wins unless another sends more than 10 % fewer bytes
_SAME_BYTES = 0.10


def _window(timed: bool) -> float:
    return _SAME_TRAFFIC if timed else _SAME_BYTES


def ranking_cost(row: LayoutPlan, timed: bool) -> float:
    """What the recommendation minimises: seconds per step with bandwidths, else inter-node bytes per step (every
    row runs the same global batch, so per step is per token)."""
    rates = row.throughput
    if rates is None:  # a row built by hand: rank it last
        return float("inf")
    if timed:
        return rates.step_seconds or 0.0
    return row.traffic.inter_node_bytes


def near_ties(rows: list[LayoutPlan], timed: bool) -> list[LayoutPlan]:
    """The rows within the window of the cheapest (2 % of the step time, or 10 % of the bytes)."""
    best = min(ranking_cost(row, timed) for row in rows)
    return [row for row in rows if ranking_cost(row, timed) <= best * (1 + _window(timed))]


def recommend(rows: list[LayoutPlan], timed: bool = False) -> LayoutPlan | None:
    """The recommended row among those that fit, or None (see the module docstring)."""
    fitting = [row for row in rows if row.fits]
    if not fitting:
        return None
    near = near_ties(fitting, timed)

    def simplest(row: LayoutPlan) -> tuple:
        # bytes' wider window only lets less recompute and TP win: among rows as simple, the fewest bytes
        bytes_first = () if timed else (ranking_cost(row, timed),)
        return (row.recomputes, row.layout.tensor_parallel_size, *bytes_first, row.layout.shard_size)

    return min(near, key=simplest)


def _figure(row: LayoutPlan, timed: bool) -> str:
    """The ranked figure of ``row``, as the reason quotes it."""
    if timed:
        rates = row.throughput
        per_second = f"~{rates.tokens_per_second:,.0f} tokens/s, MFU ~{rates.mfu:.0%}"
        return f"{format_seconds(rates.step_seconds)} per step ({per_second})"
    return f"{format_bytes(row.traffic.inter_node_bytes)} between nodes per step"


def _costs(row: LayoutPlan, winner: LayoutPlan) -> str:
    """What makes ``row`` dearer than ``winner``: its accumulation steps, its recompute."""
    why = []
    steps, best_steps = row.step.accumulation_steps, winner.step.accumulation_steps
    if steps > best_steps:
        why.append(f"its {steps} micro-batches per step gather the model {steps} times, against {best_steps}")
    if row.recomputes and not winner.recomputes:
        why.append("it recomputes the checkpointed layers' forward")
    if row.layout.tensor_parallel_size > winner.layout.tensor_parallel_size:
        why.append("more tensor-parallel collectives on every layer's critical path")
    return "; ".join(why)


def _alternatives(plan: Plan, row: LayoutPlan) -> list[str]:
    """The best row of each other tensor-parallel size: its figure and why it lost."""
    timed, lines = plan.cluster.timed, []
    for size in sorted({other.layout.tensor_parallel_size for other in plan.rows}):
        if size == row.layout.tensor_parallel_size:
            continue
        of_size = [other for other in plan.rows if other.layout.tensor_parallel_size == size]
        fitting = [other for other in of_size if other.fits]
        label = f"tensor_parallel_size={size}"
        if not fitting:
            smallest = min(of_size, key=lambda other: other.total_with_headroom)
            lines.append(
                f"{label}: nothing fits (at best {format_bytes(smallest.total_with_headroom)} with"
                f" {layout_summary(smallest.layout)}, {describe_step(smallest.training, smallest.step)})"
            )
            continue
        best = min(fitting, key=lambda other: ranking_cost(other, timed))
        ratio = ranking_cost(best, timed) / max(ranking_cost(row, timed), 1e-30)
        costs = _costs(best, row)
        lines.append(
            f"{label}: at best {layout_summary(best.layout)}, {describe_step(best.training, best.step)},"
            f" {_figure(best, timed)} ({ratio:.2f}x)" + (f": {costs}" if costs else "")
        )
    return lines


def reason(plan: Plan, row: LayoutPlan) -> str:
    """Why ``row`` won: its step, its fit with the headroom, the rule and its figure, and what each other TP size's
    best row would cost."""
    timed = plan.cluster.timed
    fits = (
        f"fits ({format_bytes(row.total_with_headroom)} of {format_bytes(plan.usable_memory)} usable per device,"
        f" the estimated activations counted {ACTIVATION_HEADROOM:.0%} over)"
    )
    ranked = "the shortest estimated step time" if timed else "the fewest bytes between nodes per step"
    if plan.cluster.num_nodes == 1 and not timed:
        ranked = "nothing crosses nodes on one node: the least recompute, tensor parallelism and shard group"
    else:
        then = (
            "the least recompute, tensor parallelism and shard group"
            if timed
            else ("the least recompute and tensor parallelism, the fewest bytes, the smallest shard group")
        )
        ranked += f" (within {_window(timed):.0%}, then {then})"
    why = f"{layout_summary(row.layout)}, {describe_step(row.training, row.step)}, {fits} and has {ranked}"
    if not (plan.cluster.num_nodes == 1 and not timed):
        why += f": {_figure(row, timed)}"
    layout = row.layout
    if layout.shard_size <= layout.ranks_per_node and layout.replicate_size > 1 and layout.num_nodes > 1:
        why += ", only the gradient all-reduce of each shard crosses nodes"
    alternatives = _alternatives(plan, row)
    if alternatives:
        why += ". Against it: " + "; ".join(alternatives)
    return why
