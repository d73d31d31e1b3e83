"""A plan as a readable table, or as one JSON-ready dict."""

from __future__ import annotations

from typing import Any

from fabric_hsdp.planning.layout import describe
from fabric_hsdp.planning.plan import LayoutPlan, Plan
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
        f"training: {training.precision}, optimizer {workload.optimizer}, micro-batch {workload.micro_batch_size} x"
        f" {workload.seq_len} tokens, activation checkpointing {'on' if training.activation_checkpointing else 'off'},"
        f" CPU offload {'on' if training.cpu_offload else 'off'},"
        f" reshard_after_forward={training.reshard_after_forward}",
        "",
    ]
    inter_timed, intra_timed = cluster.inter_node_bandwidth is not None, cluster.intra_node_bandwidth is not None
    header = ["", "shard", "TP", "mesh", "params", "grads", "optim", "gathered", "activ.*", "total", "fits"]
    header += ["inter-node/step", "intra-node/step"]
    header += (["inter-node time"] if inter_timed else []) + (["intra-node time"] if intra_timed else [])
    table = [header]
    for row in plan.rows:
        memory = row.memory
        cells = [
            "->" if row.recommended else "",
            str(row.layout.shard_size),
            str(row.layout.tensor_parallel_size),
            "x".join(str(size) for size in row.layout.mesh_shape),
            *(format_bytes(value) for value in (memory.parameters, memory.gradients, memory.optimizer)),
            format_bytes(memory.gathered),
            format_bytes(memory.activations),
            format_bytes(memory.total),
            "yes" if row.fits else "no",
            format_bytes(row.traffic.inter_node_bytes),
            format_bytes(row.traffic.intra_node_bytes),
        ]
        if inter_timed:
            cells.append(format_seconds(row.inter_node_seconds or 0.0))
        if intra_timed:
            cells.append(format_seconds(row.intra_node_seconds or 0.0))
        table.append(cells)
    widths = [max(len(cells[column]) for cells in table) for column in range(len(header))]
    for cells in table:
        aligned = [
            cell.ljust(width) if column in (0, 3) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(cells, widths))
        ]
        lines.append("  ".join(aligned).rstrip())
    lines.append("")
    if plan.recommended is not None:
        lines.append(f"recommended: {plan.reason}")
    else:
        lines.append("recommended: none (no layout fits; see the error below)")
    if training.cpu_offload and plan.recommended is not None:
        host = plan.recommended.memory.host
        lines.append(
            f"CPU offload: the recommended layout keeps {format_bytes(host)} of parameters, gradients and optimizer"
            f" state per device in CPU memory ({format_bytes(host * cluster.devices_per_node)} per node)"
        )
    for layout, reason in plan.skipped:
        lines.append(f"skipped: {describe(layout)}: {reason}")
    lines.append(ACTIVATIONS_NOTE)
    lines.append(
        "  inter-node/step: bytes the busiest node sends to other nodes; intra-node/step: bytes the busiest device"
        " sends within its node (ring collectives, one micro-batch per step)"
        + ("; time: those bytes over the bandwidth given, not overlapped" if inter_timed or intra_timed else "")
    )
    return "\n".join(lines)


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
        },
        "training": {
            "precision": training.precision,
            "optimizer": workload.optimizer,
            "micro_batch_size": workload.micro_batch_size,
            "seq_len": workload.seq_len,
            "activation_checkpointing": training.activation_checkpointing,
            "cpu_offload": training.cpu_offload,
            "reshard_after_forward": training.reshard_after_forward,
        },
        "layouts": [_row_dict(row) for row in plan.rows],
        "skipped": [
            {"shard_size": layout.shard_size, "tensor_parallel_size": layout.tensor_parallel_size, "reason": reason}
            for layout, reason in plan.skipped
        ],
        "recommended": None if plan.recommended is None else _row_dict(plan.recommended),
        "reason": plan.reason or None,
    }


def _row_dict(row: LayoutPlan) -> dict[str, Any]:
    layout, memory, traffic = row.layout, row.memory, row.traffic
    return {
        "shard_size": layout.shard_size,
        "tensor_parallel_size": layout.tensor_parallel_size,
        "fsdp_size": layout.fsdp_size,
        "replicate_size": layout.replicate_size,
        "mesh_shape": list(layout.mesh_shape),
        "mesh_dim_names": list(layout.mesh_dim_names),
        "fits": row.fits,
        "recommended": row.recommended,
        "bytes_per_device": {
            "parameters": memory.parameters,
            "gradients": memory.gradients,
            "optimizer": memory.optimizer,
            "gathered": memory.gathered,
            "activations_estimate": memory.activations,
            "total": memory.total,
        },
        "cpu_offload_bytes_per_device": memory.host,
        "inter_node_bytes_per_step": round(traffic.inter_node_bytes),
        "inter_node_bytes_per_step_all_nodes": round(traffic.inter_node_total),
        "intra_node_bytes_per_step": round(traffic.intra_node_bytes),
        "inter_node_seconds_per_step": row.inter_node_seconds,
        "intra_node_seconds_per_step": row.intra_node_seconds,
    }


def _bandwidths(plan: Plan) -> str:
    parts = []
    if plan.cluster.inter_node_bandwidth is not None:
        parts.append(f"{format_bytes(plan.cluster.inter_node_bandwidth)}/s between nodes (per node)")
    if plan.cluster.intra_node_bandwidth is not None:
        parts.append(f"{format_bytes(plan.cluster.intra_node_bandwidth)}/s within a node (per device)")
    return ("; " + ", ".join(parts)) if parts else ""
