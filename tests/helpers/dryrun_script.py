"""A user's Fabric script, unchanged by the dry run: what ``tests/test_dryrun.py`` runs as one rank of a cluster.

``python dryrun_script.py FACTS_JSON [--shard_size S] [--tp T] [--init_from FILE] [--steps N] [--save DIR]
[--no_launch] [--levers] [--validate_first] [--step_buffer_mb MB]``: writes what the rank saw (world, ranks, mesh
coordinates, sampler) to FACTS_JSON before training, and appends the step number to FACTS_JSON.steps after every
optimizer step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.tiny_llama import Block, Llama, LlamaConfig, loss_fn  # noqa: E402
from fabric_hsdp import HybridFSDPStrategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("facts")
    parser.add_argument("--shard_size", default="node")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--init_from", default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", default=None)
    parser.add_argument("--no_launch", action="store_true")
    parser.add_argument("--levers", action="store_true", help="selective activation checkpointing, sequence parallel")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num_nodes", type=int, default=2)
    parser.add_argument("--validate_first", action="store_true", help="a 1 x 8 no-grad eval forward before training")
    parser.add_argument(
        "--step_buffer_mb", type=int, default=0, help="a buffer of this many MiB held from each forward to its backward"
    )
    args = parser.parse_args()
    shard_size = int(args.shard_size) if args.shard_size.isdigit() else args.shard_size
    levers = dict(activation_checkpointing_mode="selective", sequence_parallel=True) if args.levers else {}
    strategy = HybridFSDPStrategy(
        sharded_modules={Block},
        shard_size=shard_size,
        tensor_parallel_size=args.tp,
        activation_checkpointing={Block},
        **levers,
    )
    fabric = L.Fabric(accelerator="cuda", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
    if not args.no_launch:
        fabric.launch()
    with fabric.init_module(empty_init=True):
        model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=172, max_seq_len=32))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    if args.init_from:
        fabric.load_raw(args.init_from, model)
    loader = fabric.setup_dataloaders(DataLoader(torch.arange(4096), batch_size=2))
    facts = {
        "world_size": fabric.world_size,
        "global_rank": fabric.global_rank,
        "node_rank": fabric.node_rank,
        "local_rank": fabric.local_rank,
        "coordinates": list(strategy.device_mesh.get_coordinate()),
        "sampler": [loader.sampler.num_replicas, loader.sampler.rank],
        "device": str(fabric.device),
    }
    Path(args.facts).write_text(json.dumps(facts))
    generator = torch.Generator().manual_seed(0)
    if args.validate_first:  # as examples/finetune.py: a validation loss before training, on another batch shape
        model.eval()
        with torch.no_grad():
            model(torch.randint(0, 256, (1, 8), generator=generator).to(fabric.device))
        model.train()
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, 256, (2, 17), generator=generator).to(fabric.device)
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        # a known allocation inside the step, freed before its end (as activations are): what a step's peak must see
        buffer = torch.ones(args.step_buffer_mb * 2**20 // 4) if args.step_buffer_mb else None
        fabric.backward(loss)
        del buffer
        optimizer.step()
        optimizer.zero_grad()
        with open(args.facts + ".steps", "a") as steps:
            steps.write(f"{step}\n")
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": args.steps})


if __name__ == "__main__":
    main()
