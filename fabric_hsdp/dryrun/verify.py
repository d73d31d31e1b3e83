"""``fabric-hsdp plan --verify``: dry-run the recommended layout through the real code path, measured beside planned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fabric_hsdp.units import format_binary_bytes

TRAIN_SCRIPT = Path(__file__).with_name("train_script.py")


def verify_plan(args: Any, plan: Any) -> tuple[str, Any]:
    """Dry-run rank 0 (it holds the largest shards) of the plan's recommended layout for one optimizer step.

    ``args`` are ``fabric-hsdp plan``'s; the model is built from ``args.model``'s config on the meta device (with
    ``--lora_r``: its LoRA adapters, the base frozen) and runs the recommended row's micro-batch x ``args.seq_len``
    tokens, with its checkpointing. Returns the text to print and the dry run's report.

    Raises:
        ValueError: Nothing to verify (no layout fits), or options the dry run cannot reproduce.
    """
    from fabric_hsdp.dryrun.runner import dry_run

    row = plan.recommended
    if row is None:
        raise ValueError("--verify: no layout fits, so there is none to dry-run")
    if args.cpu_offload or getattr(args, "sequence_parallel", False) or getattr(args, "loss_parallel", False):
        raise ValueError("--verify dry-runs plain layouts: drop --cpu_offload, --sequence_parallel, --loss_parallel")
    if getattr(args, "lora_targets", None) is not None:
        raise ValueError(
            "--verify dry-runs LoRA on every linear layer of the blocks (as examples/finetune.py --lora_r builds it):"
            " drop --lora_targets"
        )
    layout, micro_batch = row.layout, row.training.workload.micro_batch_size
    script_args = ["--model", str(args.model), "--shard_size", str(layout.shard_size)]
    script_args += ["--tp", str(layout.tensor_parallel_size), "--precision", plan.training.precision]
    script_args += ["--batch_size", str(micro_batch), "--seq_len", str(args.seq_len)]
    script_args += ["--optimizer", args.optimizer, "--num_nodes", str(args.num_nodes)]
    script_args += ["--devices", str(args.devices_per_node), "--steps", "1"]
    if row.recomputes:
        mode = row.training.checkpointing
        if not isinstance(mode, str):
            raise ValueError(f"--verify dry-runs full or selective recompute, not every {mode} blocks")
        script_args += ["--activation_checkpointing", "--activation_checkpointing_mode", mode]
    if row.keeps_gathered:
        script_args.append("--keep_gathered_while_accumulating")
    if getattr(args, "lora_r", None):
        script_args += ["--lora_r", str(args.lora_r)]
    report = dry_run(
        TRAIN_SCRIPT, script_args, num_nodes=args.num_nodes, devices_per_node=args.devices_per_node, rank=0
    )
    size = format_binary_bytes
    measured = report.step_peak
    planned = row.memory.total
    where = "device" if (report.phases.get("step") or {}).get("device_peak") is not None else "host (no GPU here)"
    lines = [
        f"verify: dry run of rank 0 of {args.num_nodes} x {args.devices_per_node}, shard_size {layout.shard_size},"
        f" tensor_parallel_size {layout.tensor_parallel_size}, mesh {report.mesh_shape}, one step of"
        f" {micro_batch} x {args.seq_len} tokens:",
        f"  parameters per device: planned {size(row.memory.parameters)}, measured"
        f" {size(report.local_parameter_bytes)}",
        f"  peak of a step: planned {size(planned)}, measured {size(measured)} ({where}): {measured / planned:.2f}x",
    ]
    lines.extend(f"  note: {note}" for note in report.notes)
    return "\n".join(lines), report
