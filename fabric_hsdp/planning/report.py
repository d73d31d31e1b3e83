"""A plan as a readable table, or as one JSON-ready dict."""

from __future__ import annotations

from typing import Any

from fabric_hsdp.planning.experts import RECEIVED_TOKENS_HEADROOM
from fabric_hsdp.planning.layout import layout_summary
from fabric_hsdp.planning.plan import CONTEXT_PARALLEL_RULE, TYPICAL_FABRIC, LayoutPlan, Plan
from fabric_hsdp.planning.step import ACTIVATION_HEADROOM
from fabric_hsdp.planning.throughput import DEFAULT_DEVICE_FLOPS
from fabric_hsdp.units import format_bytes, format_seconds

ACTIVATIONS_NOTE = (
    "* activations are an estimate (Llama-style blocks with fused attention; see docs/concepts.md); parameters,"
    " gradients, optimizer state and gathered units follow FSDP2's sharding exactly"
)


def plan_table(plan: Plan) -> str:
    """The plan as text: a header, one row per layout, the recommendation, the skipped layouts."""
    cluster, training, workload = plan.cluster, plan.training, plan.training.workload
    lines = [
        f"model:    {plan.model.summary()}",
        f"cluster:  {cluster.num_nodes} node(s) x {cluster.devices_per_node} devices,"
        f" {format_bytes(cluster.device_memory)} per device, {format_bytes(plan.usable_memory)} usable"
        f" ({plan.safety_margin:.0%} safety margin)" + _bandwidths(plan),
        f"training: {training.precision}, optimizer {workload.optimizer}, sequences of {workload.seq_len} tokens,"
        f" activation checkpointing {_weighed_checkpointing(plan)},"
        f" weights kept gathered for the step {_weighed_gathering(plan)},"
        f" CPU offload {'on' if training.cpu_offload else 'off'},"
        f" reshard_after_forward={training.reshard_after_forward}, {_weighed_context(plan)}" + _levers(training),
        _batch_line(plan),
        _compute_line(plan),
        "",
    ]
    header = ["", "shard", "TP", "EP", "CP", "mesh", "DP", "micro x acc.", "AC", "kept", "params", "grads", "optim"]
    header += ["gathered", "activ.*", "tokens in", "total", "+headroom", "fits"]
    header += ["inter-node/step", "inter-node/token", "intra-node/step"]
    header += ["inter-node time", "intra-node time", "compute", "step time", "tokens/s", "MFU"]
    table = [header]
    for row in plan.rows:
        memory = row.memory
        cells = [
            "->" if row.recommended else "",
            str(row.layout.shard_size),
            str(row.layout.tensor_parallel_size),
            str(row.layout.expert_parallel_size),
            str(row.layout.context_parallel_size),
            "x".join(str(size) for size in row.layout.mesh_shape),
            str(row.data_parallel_size),
            f"{row.step.micro_batch_size} x {row.step.accumulation_steps}",
            _checkpointing(row.training),
            "yes" if row.keeps_gathered else "no",
            *(format_bytes(value) for value in (memory.parameters, memory.gradients, memory.optimizer)),
            format_bytes(memory.gathered),
            format_bytes(memory.activations),
            format_bytes(memory.received_tokens) if memory.received_tokens else "-",
            format_bytes(memory.total),
            format_bytes(row.total_with_headroom),
            "yes" if row.fits else "no",
            format_bytes(row.traffic.inter_node_bytes),
            format_bytes(row.traffic.inter_node_bytes / plan.tokens_per_step),
            format_bytes(row.traffic.intra_node_bytes),
        ]
        cells.append(format_seconds(row.inter_node_seconds or 0.0))
        cells.append(format_seconds(row.intra_node_seconds or 0.0))
        rates = row.throughput
        if rates is not None and rates.step_seconds is not None:
            cells.append(format_seconds(rates.compute_seconds))
            cells += [format_seconds(rates.step_seconds), f"{rates.tokens_per_second:,.0f}", f"{rates.mfu:.0%}"]
        table.append(cells)
    widths = [max(len(cells[column]) for cells in table) for column in range(len(header))]
    for cells in table:
        aligned = [
            cell.ljust(width) if column in (0, 5) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(cells, widths))
        ]
        lines.append("  ".join(aligned).rstrip())
    lines.append("")
    if plan.recommended is not None:
        lines.append(f"recommended: {plan.reason}")
        lines.append(f"run it:   {strategy_call(plan.recommended)}")
    else:
        lines.append("recommended: none (no layout fits; see the error below)")
    if training.cpu_offload and plan.recommended is not None:
        host = plan.recommended.memory.host
        lines.append(
            f"CPU offload: the recommended layout keeps {format_bytes(host)} of parameters, gradients and optimizer"
            f" state per device in CPU memory ({format_bytes(host * cluster.devices_per_node)} per node)"
        )
    for layout, reason in plan.skipped:
        lines.append(f"skipped: {layout_summary(layout)}: {reason}")
    lines.append(ACTIVATIONS_NOTE)
    lines.append(
        f"  EP: expert-parallel ranks (each MoE layer's experts split over them, tokens exchanged all-to-all); CP:"
        " context-parallel ranks (each sequence split over them, keys and values all-gathered in every layer: the"
        " activations of seq_len / CP tokens plus the gathered keys and values); DP: data-parallel ranks"
        " (world / (TP x CP)); micro x acc.: sequences per micro-batch x micro-batches per step"
        f" (gradient accumulation), the largest micro-batch that fits; AC: activation checkpointing; kept: weights"
        " kept gathered for the step (keep_gathered_while_accumulating=True: one gather per step); tokens in: one"
        f" MoE layer's rows received from its expert group, counted {RECEIVED_TOKENS_HEADROOM:g}x the balanced"
        " average for uneven routing; +headroom: the"
        f" total with the estimated activations counted {ACTIVATION_HEADROOM:.0%} over, what must fit;"
        " inter-node/step: bytes the busiest node sends to other nodes per optimizer step, /token: per token of"
        " the step; intra-node/step: bytes the busiest device sends within its node (ring collectives)"
        + "; time: those bytes over the bandwidth, not overlapped"
    )
    lines.append(
        "  step time: max(compute, FSDP and replica traffic) + tensor-parallel, all-to-all and key/value traffic (on"
        " the critical path);"
        " compute = (6 N + 12 L d s) FLOPs per token (+ recompute: full AC the layers' forward, selective none of"
        " the matmuls) at the stated efficiency; MFU: model FLOPs over the peak (estimates, not measurements)"
    )
    return "\n".join(lines)


def strategy_call(row: LayoutPlan) -> str:
    """The strategy arguments (and the step) that run ``row``, as a user writes them."""
    training, layout, step = row.training, row.layout, row.step
    arguments = [f"shard_size={layout.shard_size}"]
    if layout.tensor_parallel_size > 1:
        arguments.append(f"tensor_parallel_size={layout.tensor_parallel_size}")
        arguments += [f"{name}=True" for name in ("sequence_parallel", "loss_parallel") if getattr(training, name)]
    if layout.expert_parallel_size > 1:
        arguments.append(f"expert_parallel_size={layout.expert_parallel_size}")
    if layout.context_parallel_size > 1:
        arguments.append(f"context_parallel_size={layout.context_parallel_size}")
    mode = training.checkpointing
    if mode != "none":
        arguments.append("activation_checkpointing={<the block class>}")
        if mode != "full":
            arguments.append(f"activation_checkpointing_mode={mode!r}")
    if training.keep_gathered_while_accumulating:
        arguments.append("keep_gathered_while_accumulating=True")
    elif training.reshard_after_forward is not None:
        arguments.append(f"reshard_after_forward={training.reshard_after_forward}")
    if training.cpu_offload:
        arguments.append("cpu_offload=True")
    steps = step.accumulation_steps
    accumulate = (
        f", {steps} micro-batches per step (fabric.no_backward_sync(model, enabled=True) on all but the last)"
        if steps > 1
        else ", one micro-batch per step"
    )
    if layout.context_parallel_size > 1:
        accumulate += f", each sequence split over the {layout.context_parallel_size} ranks of its context group"

    return (
        f"HybridFSDPStrategy({', '.join(arguments)}), Fabric(precision={training.precision!r}),"
        f" micro-batches of {step.micro_batch_size} sequence{'s' if step.micro_batch_size > 1 else ''}" + accumulate
    )


def _batch_line(plan: Plan) -> str:
    whose = (
        "given"
        if plan.global_batch_given
        else f"the planner's: {plan.cluster.num_nodes * plan.cluster.devices_per_node} devices"
        + (f" / TP {min(plan.tensor_parallel_sizes)}" if min(plan.tensor_parallel_sizes or [1]) > 1 else "")
        + f" x micro-batch {plan.training.workload.micro_batch_size}; pass --global_batch_size to change"
    )
    return (
        f"batch:    {plan.global_batch_size} sequences = {plan.tokens_per_step:,} tokens per optimizer step, every"
        f" layout ({whose})"
    )


def _checkpointing(training: Any) -> str:
    mode = training.checkpointing
    if mode == "none":
        return "off"
    return "on" if mode == "full" else (f"every {mode} blocks" if isinstance(mode, int) else mode)


def _weighed_checkpointing(plan: Plan) -> str:
    if plan.adapt and plan.weigh_recompute:
        return "weighed per layout (none, selective, full)"
    mode = _checkpointing(plan.training)
    return f"{mode} where needed to fit" if plan.adapt and mode != "off" else mode


def _weighed_gathering(plan: Plan) -> str:
    if plan.adapt and plan.weigh_gathering:
        return "weighed per layout"
    return "on" if plan.training.keep_gathered_while_accumulating else "off"


def _weighed_context(plan: Plan) -> str:
    sizes = plan.context_parallel_sizes
    if sizes is None:
        return CONTEXT_PARALLEL_RULE
    return "context_parallel_size " + " or ".join(map(str, sizes))


def _levers(training: Any) -> str:
    on = [name for name, flag in (("sequence parallel", training.sequence_parallel),
                                  ("loss parallel", training.loss_parallel)) if flag]  # fmt: skip
    return (", " + ", ".join(on)) if on else ""


def _compute_line(plan: Plan) -> str:
    cluster = plan.cluster
    if cluster.device_flops is None:
        peak = f"{DEFAULT_DEVICE_FLOPS / 1e12:.0f} TFLOP/s per device (assumed: H100 dense bf16; pass --device_flops)"
    else:
        peak = f"{cluster.device_flops / 1e12:.0f} TFLOP/s per device"
    return f"compute:  {peak} at {cluster.compute_efficiency:.0%} efficiency (--compute_efficiency)"


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-ready dict with a ``layouts`` list."""
    cluster, training, workload = plan.cluster, plan.training, plan.training.workload
    return {
        "model": {
            "description": plan.model.description,
            "parameters": plan.model.num_parameters,
            **{key: getattr(plan.model.dims, key) for key in plan.model.dims.__dataclass_fields__},
        },
        "cluster": {
            "num_nodes": cluster.num_nodes,
            "devices_per_node": cluster.devices_per_node,
            "device_memory": cluster.device_memory,
            "usable_memory": plan.usable_memory,
            "safety_margin": plan.safety_margin,
            "inter_node_bandwidth": cluster.inter_node_bandwidth,
            "intra_node_bandwidth": cluster.intra_node_bandwidth,
            "backend": cluster.backend,
            "device_flops": cluster.device_flops if cluster.device_flops is not None else DEFAULT_DEVICE_FLOPS,
            "assumed_bandwidths": list(cluster.assumed_bandwidths),
            "compute_efficiency": cluster.compute_efficiency,
        },
        "ranked_by": "seconds per step",
        "global_batch_size": plan.global_batch_size,
        "global_batch_given": plan.global_batch_given,
        "tokens_per_step": plan.tokens_per_step,
        "activation_headroom": ACTIVATION_HEADROOM,
        "training": {
            "precision": training.precision,
            "optimizer": workload.optimizer,
            "micro_batch_size": workload.micro_batch_size,
            "seq_len": workload.seq_len,
            "activation_checkpointing": training.activation_checkpointing,
            "activation_checkpointing_mode": training.checkpointing,
            "sequence_parallel": training.sequence_parallel,
            "loss_parallel": training.loss_parallel,
            "cpu_offload": training.cpu_offload,
            "reshard_after_forward": training.reshard_after_forward,
            "keep_gathered_while_accumulating": training.keep_gathered_while_accumulating,
        },
        "layouts": [_row_dict(row) for row in plan.rows],
        "skipped": [
            {
                "shard_size": layout.shard_size,
                "tensor_parallel_size": layout.tensor_parallel_size,
                "expert_parallel_size": layout.expert_parallel_size,
                "context_parallel_size": layout.context_parallel_size,
                "reason": reason,
            }
            for layout, reason in plan.skipped
        ],
        "recommended": None if plan.recommended is None else _row_dict(plan.recommended),
        "run_it": None if plan.recommended is None else strategy_call(plan.recommended),
        "reason": plan.reason or None,
    }


def _row_dict(row: LayoutPlan) -> dict[str, Any]:
    layout, memory, traffic, rates = row.layout, row.memory, row.traffic, row.throughput
    return {
        "shard_size": layout.shard_size,
        "tensor_parallel_size": layout.tensor_parallel_size,
        "expert_parallel_size": layout.expert_parallel_size,
        "context_parallel_size": layout.context_parallel_size,
        "fsdp_size": layout.fsdp_size,
        "expert_shard_size": layout.expert_shard_size,
        "replicate_size": layout.replicate_size,
        "mesh_shape": list(layout.mesh_shape),
        "mesh_dim_names": list(layout.mesh_dim_names),
        "fits": row.fits,
        "recommended": row.recommended,
        "micro_batch_size": None if row.step is None else row.step.micro_batch_size,
        "accumulation_steps": None if row.step is None else row.step.accumulation_steps,
        "activation_checkpointing_mode": None if row.training is None else row.training.checkpointing,
        "keep_gathered_while_accumulating": row.keeps_gathered,
        "total_with_headroom": row.total_with_headroom,
        "bytes_per_device": {
            "parameters": memory.parameters,
            "gradients": memory.gradients,
            "optimizer": memory.optimizer,
            "gathered": memory.gathered,
            "activations_estimate": memory.activations,
            "received_tokens": memory.received_tokens,
            "total": memory.total,
        },
        "cpu_offload_bytes_per_device": memory.host,
        "inter_node_bytes_per_step": round(traffic.inter_node_bytes),
        "inter_node_bytes_per_step_all_nodes": round(traffic.inter_node_total),
        "intra_node_bytes_per_step": round(traffic.intra_node_bytes),
        "inter_node_seconds_per_step": row.inter_node_seconds,
        "intra_node_seconds_per_step": row.intra_node_seconds,
        "data_parallel_size": row.data_parallel_size,
        "tokens_per_step": None if rates is None else rates.tokens_per_step,
        "inter_node_bytes_per_token": None if rates is None else rates.inter_node_bytes_per_token,
        "intra_node_bytes_per_token": None if rates is None else rates.intra_node_bytes_per_token,
        "compute_seconds_per_step_estimate": None if rates is None else rates.compute_seconds,
        "step_seconds_estimate": None if rates is None else rates.step_seconds,
        "tokens_per_second_estimate": None if rates is None else rates.tokens_per_second,
        "mfu_estimate": None if rates is None else rates.mfu,
    }


def _bandwidths(plan: Plan) -> str:
    cluster = plan.cluster
    parts = [
        f"{format_bytes(cluster.inter_node_bandwidth)}/s between nodes (per node)",
        f"{format_bytes(cluster.intra_node_bandwidth)}/s within a node (per device)",
    ]
    text = "; " + ", ".join(parts)
    if cluster.assumed_bandwidths:
        given = {"inter_node_bandwidth": "--inter_node_bandwidth", "intra_node_bandwidth": "--intra_node_bandwidth"}
        flags = " and ".join(given[name] for name in cluster.assumed_bandwidths)
        text += f" (assumed, not given: {TYPICAL_FABRIC}; pass {flags})"
    return text
