"""Dry runs at the users' scale, on this machine: the figures docs/dryrun.md and the issue note quote (not CI).

    python benchmarks/dryrun_scale.py 70b          # litgpt Llama-3-70B as rank 77 of 16 x 8, TP 8, bf16-true, AC
    python benchmarks/dryrun_scale.py 70b-load     # the same, load_raw from a sparse safetensors file of its shapes
    python benchmarks/dryrun_scale.py 70b-plan     # the planner's 70B answer on 16 x 8 (FSDP over 128, selective AC,
                                                   # bf16-mixed, 1 x 2048 tokens), rank 0, 2 steps, --no_compute
    python benchmarks/dryrun_scale.py 8b           # transformers Llama-3-8B (from_config): rank of 2 x 8, 4 x 8 TP 2
                                                   # (--optimizer none: without AdamW's 4 GB of state per rank)
    python benchmarks/dryrun_scale.py world        # setup + load planning of one rank at 8 .. 4096 ranks

Each dry run is its own process (``fabric-hsdp dryrun --json_file``), so its memory figures are its own. The 70B
cases take ~7 GB of host memory each: run them one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "fabric_hsdp" / "dryrun" / "train_script.py"
GB = 1e9


def dry_run(
    nodes: int, per_node: int, rank: int, script_args: list[str], max_steps: int = 1, no_compute: bool = False
) -> dict[str, Any]:
    """One ``fabric-hsdp dryrun`` in a fresh process; its report and wall time."""
    with tempfile.TemporaryDirectory(prefix="dryrun-scale-") as directory:
        report_file = Path(directory) / "report.json"
        command = [sys.executable, "-m", "fabric_hsdp", "dryrun", "--json_file", str(report_file)]
        command += ["--num_nodes", str(nodes), "--devices_per_node", str(per_node), "--rank", str(rank)]
        command += ["--max_steps", str(max_steps)] + ["--no_compute"] * no_compute + [str(SCRIPT), *script_args]
        command += ["--num_nodes", str(nodes), "--devices", str(per_node)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"dry run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        report = json.loads(report_file.read_text())
    report["wall_s"] = seconds
    return report


def sparse_safetensors(model_name: str, path: Path) -> int:
    """A safetensors file with ``model_name``'s real header and a hole for its data (no disk used); its size."""
    import torch

    from fabric_hsdp.dryrun.train_script import build

    with torch.device("meta"):
        model, _, _ = build(model_name)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(parameter.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as stream:
        stream.write(len(text).to_bytes(8, "little"))
        stream.write(text)
        stream.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def row(label: str, report: dict[str, Any]) -> str:
    phases = report["phases"]
    planned = report["planned"]["total"] if report["planned"] else 0
    ratio = report["measured_over_planned"]
    fraction = report["global_parameters"] / max(1, report["local_parameters"])
    return (
        f"{label:<34} mesh {str(tuple(report['mesh_shape'])):<12} at {str(tuple(report['coordinates'])):<11}"
        f" 1/{fraction:,.1f} of params | setup {phases['setup']['host_peak'] / GB:.2f} GB"
        f" {phases['setup']['seconds']:.1f} s | load read {report['checkpoint_read'] / GB:.4f} GB"
        f" | step peak {report['step_peak'] / GB:.2f} GB vs plan {planned / GB:.2f} GB"
        f" ({ratio:.2f}x) | {report['wall_s']:.0f} s"
        if ratio
        else f"{label:<34} mesh {str(tuple(report['mesh_shape'])):<12} at {str(tuple(report['coordinates'])):<11}"
        f" 1/{fraction:,.1f} of params | setup {phases['setup']['host_peak'] / GB:.2f} GB"
        f" {phases['setup']['seconds']:.1f} s | load read {report['checkpoint_read'] / GB:.4f} GB,"
        f" host peak {phases.get('load', {}).get('host_peak', 0) / GB:.2f} GB | no step | {report['wall_s']:.0f} s"
    )


def case_70b(load: bool) -> None:
    args = ["--model", "Llama-3-70B", "--shard_size", "world", "--tp", "8", "--precision", "bf16-true"]
    args += ["--activation_checkpointing", "--seq_len", "16"]
    with tempfile.TemporaryDirectory(prefix="dryrun-70b-") as directory:
        if load:
            file = Path(directory) / "llama-3-70b.safetensors"
            size = sparse_safetensors("Llama-3-70B", file)
            print(
                f"sparse safetensors: {size / GB:.1f} GB logical, {os.stat(file).st_blocks * 512 / 1e6:.1f} MB on disk"
            )
            args += ["--init_from", str(file)]
        # the load case stops at the first forward (--max_steps 0): its step is the 70b case's (a CPU step of a
        # 70B rank is ~1 TFLOP of bf16 matmuls, tens of minutes here without AVX512-BF16)
        report = dry_run(16, 8, 77, args, max_steps=0 if load else 1)
        print(row("litgpt Llama-3-70B" + (" + load_raw" if load else ""), report))
        if load:
            print(
                f"  read {report['checkpoint_read'] / GB:.4f} GB = 1/{size / report['checkpoint_read']:.1f} of the file"
            )
        print(json.dumps({key: report[key] for key in ("phases", "planned", "saves", "notes")}, indent=1))


def llama3_8b_config(directory: Path) -> Path:
    """Llama-3-8B's transformers config (``config.json``), written to ``directory``."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ).save_pretrained(directory)
    return directory / "config.json"


def case_8b(optimizer: str, steps: int = 2) -> None:
    with tempfile.TemporaryDirectory(prefix="dryrun-8b-") as directory:
        config = llama3_8b_config(Path(directory))
        # 2 tokens: a rank of 2 x 8 computes the whole 8B forward (no TP), in bf16 matmuls that run at ~1 GFLOP/s on
        # a CPU without bf16 units; activations are then small next to the sharded state the comparison is about
        base = ["--model", str(config), "--precision", "bf16-true", "--activation_checkpointing", "--seq_len", "2"]
        base += ["--optimizer", optimizer, "--shard_size", "node"]
        # 2 steps: the first step's backward runs before AdamW allocates its state (at its first step()), so only
        # the second is the steady state the planner describes (the phase keeps the larger step)
        print(row("transformers Llama-3-8B, 2 x 8 HSDP", dry_run(2, 8, 13, base, max_steps=steps)))
        print(row("transformers Llama-3-8B, 4 x 8 TP 2", dry_run(4, 8, 29, [*base, "--tp", "2"], max_steps=steps)))


def case_world() -> None:
    print("setup + load planning of one rank (load_raw from a safetensors file), by world size:")
    import torch
    from safetensors.torch import save_file

    from fabric_hsdp.dryrun.train_script import build

    with tempfile.TemporaryDirectory(prefix="dryrun-world-") as directory:
        file = Path(directory) / "model.safetensors"
        model_name = "pythia-160m"  # 12 layers, 162 M parameters: every rank of 1,024 still holds rows
        torch.manual_seed(0)
        with torch.device("meta"):
            model, _, _ = build(model_name)
        save_file({name: torch.zeros(p.shape, dtype=torch.bfloat16) for name, p in model.named_parameters()}, file)
        print(f"  {model_name}, shard_size='world', bf16-true, the last rank of the world")
        print("  world  nodes x per node  setup s  setup host GB  load s  load host GB  read MB")
        for nodes in (1, 8, 64, 128, 256, 512):
            args = ["--model", model_name, "--shard_size", "world", "--init_from", str(file), "--optimizer", "none"]
            report = dry_run(nodes, 8, nodes * 8 - 1, args, max_steps=0)  # set-up and load only
            setup, load = report["phases"]["setup"], report["phases"]["load"]
            print(
                f"  {nodes * 8:>5}  {nodes:>5} x 8        {setup['seconds']:>7.2f}  {setup['host_peak'] / GB:>13.3f}"
                f"  {load['seconds']:>6.2f}  {load['host_peak'] / GB:>12.3f}  {report['checkpoint_read'] / 1e6:>7.2f}"
            )


def case_70b_plan() -> None:
    """``fabric-hsdp plan Llama-3-70B --num_nodes 16 --devices_per_node 8 --device_memory 80GB``'s answer, rank 0
    (the largest shards), two steps (the second with AdamW's state), counted without compute."""
    args = ["--model", "Llama-3-70B", "--shard_size", "128", "--precision", "bf16-mixed", "--seq_len", "2048"]
    args += ["--activation_checkpointing", "--activation_checkpointing_mode", "selective", "--steps", "2"]
    report = dry_run(16, 8, 0, args, max_steps=2, no_compute=True)
    print(row("litgpt Llama-3-70B, the plan's answer", report))
    print(json.dumps({key: report[key] for key in ("phases", "planned", "notes")}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=["70b", "70b-load", "70b-plan", "8b", "world"])
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"], help="for the 8b case")
    options = parser.parse_args()
    case = options.case
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"machine: {os.cpu_count()} cores, {memory:.0f} GiB, load average {os.getloadavg()[0]:.1f} at the start")
    if case in ("70b", "70b-load"):
        case_70b(load=case == "70b-load")
    elif case == "70b-plan":
        case_70b_plan()
    elif case == "8b":
        case_8b(options.optimizer)
    else:
        case_world()


if __name__ == "__main__":
    main()
