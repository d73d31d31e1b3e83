"""Step time and peak memory of the levers against the plain strategy, in the same processes and the same run.

1 node x 2 CPU ranks (gloo, ``tests/helpers/launch.py``), FSDP over both; the example LLaMA (``examples/tiny_llama``)
at dim 256, 4 layers, 8 heads, sequence 256, micro-batch 4. Each rank sets up one model per variant -- plain (no
activation checkpointing), AC full, selective, every 2nd block, ``compile=True`` (inductor), compile + selective,
tensor parallelism over the two ranks (TP 2), TP 2 with sequence parallelism, and with loss parallelism too --
runs a warm-up step each (compile happens there), then ``--rounds`` rounds in which every variant runs ``--steps``
steps, the order rotated each round. Per variant: the median step seconds (the slowest rank's), and the peak resident
memory of a step above the resident memory before it (``VmHWM`` reset through ``/proc/self/clear_refs``, glibc told to
return freed blocks: ``MALLOC_MMAP_THRESHOLD_``), the larger of the two ranks. Ratios are against plain.

Run: ``python benchmarks/levers.py`` (a few minutes on 2 cores) or ``--rounds 2 --steps 1``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "plain": {},
    "AC full": {"ac": "full"},
    "AC selective": {"ac": "selective"},
    "AC every 2nd": {"ac": 2},
    "compile": {"compile": True},
    "compile + selective": {"compile": True, "ac": "selective"},
    # tensor parallelism over the 2 ranks (mesh (1, 1, 2)): sequence parallel, then loss parallel on top
    "TP 2": {"tp": 2},
    "TP 2 + SP": {"tp": 2, "sp": True},
    "TP 2 + SP + LP": {"tp": 2, "sp": True, "lp": True},
}
SEQ, BATCH = 256, 4


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rank(num_nodes: int, devices: int, rounds: int, steps: int) -> dict[str, Any]:
    import lightning as L
    import torch

    from examples.tiny_llama import Block, Llama, LlamaConfig
    from fabric_hsdp import HybridFSDPStrategy

    torch.set_num_threads(1)
    setups = {}
    for name, lever in VARIANTS.items():
        kwargs: dict[str, Any] = {"sharded_modules": {Block}, "compile": lever.get("compile", False)}
        if "ac" in lever:
            kwargs.update(activation_checkpointing={Block}, activation_checkpointing_mode=lever["ac"])
        if "tp" in lever:
            kwargs.update(tensor_parallel_size=lever["tp"], sequence_parallel=lever.get("sp", False))
            kwargs.update(loss_parallel=lever.get("lp", False))
        fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=HybridFSDPStrategy(**kwargs))
        fabric.launch()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=8, hidden_dim=688, max_seq_len=SEQ)
        model = fabric.setup_module(Llama(config))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        setups[name] = (fabric, model, optimizer)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    tokens = torch.randint(0, 512, (BATCH, SEQ + 1), generator=generator)

    def step(name: str) -> tuple[float, int]:
        fabric, model, optimizer = setups[name]
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set size
        before = _status("VmRSS")
        start = time.perf_counter()
        train_step(fabric, model, optimizer, tokens)
        return time.perf_counter() - start, _status("VmHWM") - before

    warm_up = {name: step(name)[0] for name in VARIANTS}
    tracked = {name: tracked_activations(*setups[name], tokens) for name in VARIANTS if "compile" not in VARIANTS[name]}
    losses = {name: loss_memory(*setups[name], tokens) for name in VARIANTS if "tp" in VARIANTS[name]}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    peaks: dict[str, list[int]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            fabric.barrier()
            for _ in range(steps):
                seconds, peak = step(name)
                times[name].append(seconds)
                peaks[name].append(peak)
    return {"warm_up": warm_up, "times": times, "peaks": peaks, "tracked": tracked, "losses": losses}


def train_step(fabric: Any, model: Any, optimizer: Any, tokens: Any) -> None:
    """One optimizer step on ``tokens`` (next-token loss; vocabulary-split under ``loss_parallel=True``)."""
    import torch

    with fabric.strategy.loss_parallel():  # a no-op unless loss_parallel=True
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def tracked_activations(fabric: Any, model: Any, optimizer: Any, tokens: Any) -> int:
    """Activation + temporary bytes at the peak of one step, by torch's ``FSDPMemTracker`` (it follows every
    tensor's storage through the dispatcher, so the allocator's reuse does not blur it; not under compile)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model.module, optimizer.optimizer)  # Fabric's wrappers hold the FSDP module and optimizer
    with tracker:
        train_step(fabric, model, optimizer, tokens)
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return sum(value for kind, value in snapshot.items() if str(getattr(kind, "value", kind)) in ("Activation", "Temp"))


def loss_memory(fabric: Any, model: Any, optimizer: Any, tokens: Any) -> dict[str, int]:
    """What loss parallelism changes, per rank: the bytes of the logits this rank holds, and the peak bytes torch's
    ``MemTracker`` sees while the loss and its gradient into the logits are computed (the vocabulary-wide
    temporaries: log-softmax, the gradient), the model's own backward not included."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor

    logits = model(tokens[:, :-1])
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    tracker = MemTracker()
    with tracker, fabric.strategy.loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        torch.autograd.grad(loss, logits)
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return {"logits": local.numel() * local.element_size(), "loss_peak": snapshot["Total"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    from tests.helpers.launch import launch

    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    result = launch(
        "benchmarks.levers:rank",
        {"rounds": args.rounds, "steps": args.steps},
        num_nodes=1,
        ranks_per_node=2,
        timeout=1800,
        env=env,
    ).check()
    values = result.values
    step = {
        name: statistics.median(max(v["times"][name][i] for v in values) for i in range(len(values[0]["times"][name])))
        for name in VARIANTS
    }
    peak = {name: max(statistics.median(v["peaks"][name]) for v in values) for name in VARIANTS}
    warm = {name: max(v["warm_up"][name] for v in values) for name in VARIANTS}
    planned = planned_activations()
    tracked = {name: max(v["tracked"][name] for v in values) for name in values[0]["tracked"]}
    load = os.getloadavg()[0]
    print(f"1 node x 2 CPU ranks, {args.rounds} rounds x {args.steps} steps; medians; ratios vs plain; load {load:.1f}")
    print(
        f"{'variant':<22}{'step s':>9}{'x plain':>9}{'RSS peak MiB':>14}{'x plain':>9}{'tracked MiB':>13}"
        f"{'planned MiB':>13}{'plan/tracked':>14}{'first step s':>14}"
    )
    for name in VARIANTS:
        measured = f"{tracked[name] / 2**20:>13.1f}{planned[name] / 2**20:>13.1f}" if name in tracked else " " * 26
        ratio = f"{planned[name] / tracked[name]:>14.2f}" if name in tracked else f"{'-':>14}"
        print(
            f"{name:<22}{step[name]:>9.3f}{step[name] / step['plain']:>9.2f}{peak[name] / 2**20:>14.1f}"
            f"{peak[name] / peak['plain']:>9.2f}{measured}{ratio}{warm[name]:>14.1f}"
        )
    print(
        "tracked: activation + temporary bytes at the step's peak (torch's FSDPMemTracker, not under compile);"
        " planned: the planner's activation estimate for the same model, workload and AC mode"
    )
    losses = {
        name: {key: max(v["losses"][name][key] for v in values) for key in ("logits", "loss_peak")}
        for name in values[0]["losses"]
    }
    print(f"\n{'logits per rank':<22}{'logits MiB':>12}{'loss peak MiB':>15}{'x TP 2 + SP':>13}")
    for name, figures in losses.items():
        ratio = figures["loss_peak"] / losses["TP 2 + SP"]["loss_peak"]
        print(f"{name:<22}{figures['logits'] / 2**20:>12.2f}{figures['loss_peak'] / 2**20:>15.2f}{ratio:>13.2f}")
    print(
        "logits: the output this rank holds; loss peak: bytes torch's MemTracker sees while the cross-entropy and"
        " its gradient into the logits are computed (loss parallel: 1/2 of the vocabulary per rank)"
    )


def planned_activations() -> dict[str, int]:
    """The planner's activation estimate per rank for each variant (``fabric-hsdp plan``'s formula, same model and
    workload): the column to hold against the measured step peaks."""
    import torch

    from examples.tiny_llama import Llama, LlamaConfig
    from fabric_hsdp.planning import Training, Workload, memory_per_device, model_shape_of_module

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=8, hidden_dim=688, max_seq_len=SEQ))
    planned = {}
    for name, lever in VARIANTS.items():
        training = Training(
            "32-true",
            Workload(BATCH, SEQ, "adamw"),
            activation_checkpointing="ac" in lever,
            activation_checkpointing_mode=lever.get("ac", "full"),
            sequence_parallel=lever.get("sp", False),
            loss_parallel=lever.get("lp", False),
        )
        tp = lever.get("tp", 1)
        shape = model_shape_of_module(model, tensor_parallel_plan="auto" if tp > 1 else None)
        planned[name] = memory_per_device(shape, training, 2 // tp, tp).activations
    return planned


if __name__ == "__main__":
    main()
