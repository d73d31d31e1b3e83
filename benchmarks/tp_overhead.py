"""What the plugin costs per training step under tensor parallelism: ``HybridFSDPStrategy(tensor_parallel_size=2)``
against the same job written by hand with torch's APIs, on the same mesh, model and data, in the same processes.

On 2 simulated nodes x 2 CPU ranks (gloo, ``tests/helpers/launch.py``), each rank builds two copies of the
LLaMA-shaped model of ``examples/tiny_llama.py``:

* **ours**: ``L.Fabric(strategy=HybridFSDPStrategy(shard_size=..., tensor_parallel_size=2))``, the model built under
  ``fabric.init_module(empty_init=True)``, ``fabric.setup_module`` (plan ``"auto"``: the model's ``_tp_plan``),
  ``fabric.setup_optimizers(AdamW)``; a step is ``fabric.backward(loss)``, ``optimizer.step()``,
  ``optimizer.zero_grad()`` through Fabric's wrappers.
* **hand-written**: ``init_device_mesh("cpu", (R, S, 2), ("replicate", "shard", "tensor"))``, the model built on the
  meta device, ``parallelize_module`` on ``mesh["tensor"]`` with the ``_tp_plan`` translated by hand to torch's
  styles (``RowwiseParallel(input_layouts=Replicate())`` for the embedding, ``ColwiseParallel`` for
  ``wq``/``wk``/``wv``/``w1``/``w3``, ``RowwiseParallel`` for ``wo``/``w2``, ``ColwiseParallel(output_layouts=
  Replicate())`` for ``output``), ``fully_shard`` of each ``Block`` and then the root over ``mesh["replicate",
  "shard"]``, ``to_empty``; a step is plain ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``.

The hand-written model's local shards are copied from ours (their placements and local shapes are checked equal
first), so both compute the same thing: the losses of every step are compared and must agree to the last bit. Both
see the same batches (seeded by data-parallel rank, identical on tensor-parallel peers). After a warm-up step each,
the variants alternate for ``--rounds`` rounds of ``--steps`` steps (ours first in even rounds, hand-written first in
odd ones, so a drift in machine load hits both alike); a round's time is the slowest rank's, between barriers.
Reported: the median seconds per step of each variant and the ratio ours / hand-written (target <= 1.05), per mesh,
also in CPU seconds (less sensitive to other jobs on a shared machine), with the load average.

``--control`` measures the noise floor of that ratio: the "ours" slot runs a second hand-written copy instead (an
A/A comparison, whose true ratio is 1), with everything else the same.

Run: ``python benchmarks/tp_overhead.py`` (both meshes, a few minutes here) or ``--quick``; ``--meshes 2,1,2``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import (  # noqa: E402 (after the sys.path line)
    NUM_NODES,
    RANKS_PER_NODE,
    VariantFailed,
    cpu_seconds,
    llama_tp_plan,
    machine_load,
    release,
    run_ranks,
)

RANK_FUNCTION = "benchmarks.tp_overhead:measure_rank"
TENSOR_PARALLEL_SIZE = 2
# mesh (replicate, shard, tensor) on 2 nodes x 2 ranks -> HybridFSDPStrategy's shard_size
MESHES = {(2, 1, 2): "node", (1, 2, 2): "world"}
TARGET = 1.05


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def build_hand_written(config: Any, mesh_shape: tuple[int, int, int]) -> Any:
    """The model sharded by hand: TP on the ``tensor`` sub-mesh, then ``fully_shard`` on ``(replicate, shard)``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from examples.tiny_llama import Llama, rope_cache

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard", "tensor"))
    with torch.device("meta"):
        model = Llama(config)
    parallelize_module(model, mesh["tensor"], llama_tp_plan())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["replicate", "shard"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    model.to_empty(device="cpu")
    model.rope = rope_cache(config.dim // config.n_heads, config.max_seq_len, config.rope_base)
    return model


def copy_shards(source: Any, target: Any) -> None:
    """Copy ``source``'s local shards into ``target``'s; raises if a parameter's placements or local shape differ."""
    import torch

    targets = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            other = targets[name]
            if (param.placements, param.device_mesh.shape, param.to_local().shape) != (
                other.placements,
                other.device_mesh.shape,
                other.to_local().shape,
            ):
                raise RuntimeError(
                    f"{name}: ours {param.placements} on {param.device_mesh.shape}, local"
                    f" {tuple(param.to_local().shape)}; hand-written {other.placements} on {other.device_mesh.shape},"
                    f" local {tuple(other.to_local().shape)}"
                )
            other.to_local().copy_(param.to_local())


def measure_rank(
    config: dict[str, Any],
    mesh_shape: list[int],
    batch_size: int,
    seq_len: int,
    rounds: int,
    steps: int,
    num_nodes: int,
    devices: int,
    control: bool = False,
) -> dict[str, Any]:
    import warnings

    import lightning as L
    import torch

    from examples.tiny_llama import Llama, LlamaConfig, loss_fn
    from fabric_hsdp import HybridFSDPStrategy

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    shape = tuple(mesh_shape)
    strategy = HybridFSDPStrategy(shard_size=MESHES[shape], tensor_parallel_size=shape[2])
    fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy)
    fabric.launch()
    model_config = LlamaConfig(**config)
    with fabric.init_module(empty_init=True):
        ours = Llama(model_config)
    ours = fabric.setup_module(ours)
    our_optimizer = fabric.setup_optimizers(torch.optim.AdamW(ours.parameters(), lr=1e-3))
    hand = build_hand_written(model_config, shape)
    copy_shards(ours.module, hand)
    hand_optimizer = torch.optim.AdamW(hand.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(strategy.topology.data_parallel_rank(fabric.global_rank))
    total_steps = 1 + rounds * steps
    batches = [
        torch.randint(0, model_config.vocab_size, (batch_size, seq_len + 1), generator=generator)
        for _ in range(total_steps)
    ]

    def our_step(tokens: torch.Tensor) -> float:
        loss = loss_fn(ours(tokens[:, :-1]), tokens[:, 1:])
        fabric.backward(loss)
        our_optimizer.step()
        our_optimizer.zero_grad()
        return loss.item()

    if control:  # A/A: the "ours" slot runs a second copy of the hand-written job
        second = build_hand_written(model_config, shape)
        copy_shards(ours.module, second)
        second_optimizer = torch.optim.AdamW(second.parameters(), lr=1e-3)

        def our_step(tokens: torch.Tensor) -> float:
            loss = loss_fn(second(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            second_optimizer.step()
            second_optimizer.zero_grad()
            return loss.item()

    def hand_step(tokens: torch.Tensor) -> float:
        loss = loss_fn(hand(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        hand_optimizer.step()
        hand_optimizer.zero_grad()
        return loss.item()

    variants = {"ours": our_step, "hand-written": hand_step}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for name, step in variants.items():  # warm-up: FSDP2's lazy init, gloo connections, allocator
        losses[name].append(step(batches[0]))
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        window = batches[1 + round_index * steps : 1 + (round_index + 1) * steps]
        for name in order:
            fabric.barrier()
            cpu, started = cpu_seconds(), time.perf_counter()
            for tokens in window:
                losses[name].append(variants[name](tokens))
            fabric.barrier()
            times[name].append(((time.perf_counter() - started) / steps, (cpu_seconds() - cpu) / steps))
    labels = ["hand-written #2" if control else "ours", "hand-written"]
    report = {"times": times, "losses": losses, "mesh": str(strategy.topology.mesh_shape), "labels": labels}
    release(fabric, [ours, hand])
    return report


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


def _mesh(text: str) -> tuple[int, int, int]:
    shape = tuple(int(part) for part in text.split(","))
    if shape not in MESHES:
        raise argparse.ArgumentTypeError(f"mesh {text!r}: choose from {[','.join(map(str, m)) for m in MESHES]}")
    return shape  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    from examples.tiny_llama import config_for_parameters

    parser = argparse.ArgumentParser(
        description="Step time of HybridFSDPStrategy(tensor_parallel_size=2) vs a hand-written init_device_mesh +"
        " parallelize_module + fully_shard job, alternating in the same processes.",
        epilog="Prints per-mesh medians and ours / hand-written (target <= 1.05); exits 1 if a launch fails or the"
        " two variants' losses differ.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--millions", type=float, default=16.0, help="model size in millions (default 16)")
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--batch_size", type=int, default=2, help="sequences per data-parallel rank (default 2)")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 15; quick 3)")
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round (default 2)")
    parser.add_argument(
        "--meshes",
        type=_mesh,
        nargs="+",
        default=list(MESHES),
        help="(replicate, shard, tensor) shapes, e.g. 2,1,2 1,2,2 (default both: shard_size='node' and 'world')",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="A/A run: a second hand-written copy in the 'ours' slot, to see how far the ratio strays from 1 by noise",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch before it is killed")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    config = config_for_parameters(args.millions, vocab_size=args.vocab_size)
    print(
        f"model: examples/tiny_llama.py config_for_parameters({args.millions:g}, vocab_size={args.vocab_size}): dim"
        f" {config.dim}, {config.n_layers} layers, {config.n_heads} heads, hidden {config.hidden_dim}; fp32; batch"
        f" {args.batch_size} x {args.seq_len} tokens per data-parallel rank; {NUM_NODES} nodes x {RANKS_PER_NODE}"
        f" CPU ranks (gloo); {rounds} rounds x {args.steps} steps per variant, alternating"
        + ("; CONTROL run (A/A: two hand-written copies)" if args.control else "")
    )
    results: dict[str, Any] = {}
    failed = False
    work = Path(tempfile.mkdtemp(prefix="fabric_hsdp_tp_overhead_"))
    for shape in args.meshes:
        load_before = machine_load()
        try:
            ranks = run_ranks(
                RANK_FUNCTION,
                {
                    "config": vars(config),
                    "mesh_shape": list(shape),
                    "batch_size": args.batch_size,
                    "seq_len": args.seq_len,
                    "rounds": rounds,
                    "steps": args.steps,
                    "control": args.control,
                },
                timeout=args.timeout,
                out_dir=work / "x".join(map(str, shape)),
            )
        except VariantFailed as error:
            print(f"FAILED: {error}", file=sys.stderr)
            return 1
        load_after = machine_load()
        failed |= _report(shape, ranks, load_before, load_after, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


def _report(
    shape: tuple[int, ...], ranks: list[dict[str, Any]], load_before: str, load_after: str, results: dict[str, Any]
) -> bool:
    """Print one mesh's figures; return True if the variants computed different losses."""
    names = list(ranks[0]["times"])
    labels = dict(zip(names, ranks[0]["labels"]))
    rounds = len(ranks[0]["times"][names[0]])
    # a round's time: the slowest rank's (they meet in every collective, so they differ by little)
    wall = {name: [max(rank["times"][name][i][0] for rank in ranks) for i in range(rounds)] for name in names}
    cpu = {name: [max(rank["times"][name][i][1] for rank in ranks) for i in range(rounds)] for name in names}
    per_round = [ours / hand for ours, hand in zip(wall["ours"], wall["hand-written"])]
    median = {name: statistics.median(values) for name, values in wall.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu.items()}
    ratio = median["ours"] / median["hand-written"]
    cpu_ratio = cpu_median["ours"] / cpu_median["hand-written"]
    loss_gap = max(abs(a - b) for rank in ranks for a, b in zip(rank["losses"]["ours"], rank["losses"]["hand-written"]))
    print(f"\nmesh (replicate, shard, tensor) = {shape} (shard_size={MESHES[shape]!r}); {load_before} -> {load_after}")
    print(f"  {'variant':<16}{'median s/step':>14}{'min':>8}{'max':>8}{'CPU s/step':>12}")
    for name in names:
        print(
            f"  {labels[name]:<16}{median[name]:>14.3f}{min(wall[name]):>8.3f}{max(wall[name]):>8.3f}"
            f"{cpu_median[name]:>12.3f}"
        )
    verdict = "met" if ratio <= TARGET else "MISSED"
    if labels["ours"] != "ours":
        verdict = "n/a (control run: the true ratio is 1)"
    print(
        f"  {labels['ours']} / hand-written: {ratio:.3f} (median wall), {cpu_ratio:.3f} (median CPU); per round"
        f" {min(per_round):.3f} .. {max(per_round):.3f}, median {statistics.median(per_round):.3f};"
        f" target <= {TARGET}: {verdict}"
    )
    steps = len(ranks[0]["losses"]["ours"])
    print(f"  losses, max |{labels['ours']} - hand-written| over {steps} steps and all ranks: {loss_gap:.3g}")
    results["x".join(map(str, shape))] = {
        "wall": wall,
        "cpu": cpu,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "loss_gap": loss_gap,
        "load": [load_before, load_after],
        "labels": ranks[0]["labels"],
    }
    return loss_gap != 0


if __name__ == "__main__":
    sys.exit(main())
