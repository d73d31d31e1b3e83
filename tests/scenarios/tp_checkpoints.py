"""Scenarios for checkpoints under tensor parallelism: sharded saves and loads across layouts, full exports, raw loads.

Every scenario handles transformers' Llama and litgpt's GPT (both with grouped-query attention) in one launch.
Expected values are written in the model's own layout (litgpt's ``qkv`` rows in ``[Q; K; V]`` order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.counters import ReadCounter
from tests.helpers.training import (
    build,
    full_optimizer_state,
    full_state,
    logits_of,
    make_fabric,
    setup_training,
    train_steps,
)

KINDS = ("hf", "litgpt")
TOKENS = torch.arange(2 * 16).remainder(256).view(2, 16)


def save(
    num_nodes: int,
    devices: int,
    out: str,
    tensor_parallel_size: int,
    async_save: bool = False,
    full: bool = False,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Train 2 steps and save sharded (and, with ``full``, as one .pth and one .safetensors file).

    ``strategy_kwargs``: e.g. ``sequence_parallel=True``."""
    fabric = make_fabric(
        num_nodes, devices, tensor_parallel_size=tensor_parallel_size, async_save=async_save, **strategy_kwargs
    )
    facts = {}
    for kind in KINDS:
        model, optimizer, scheduler = setup_training(fabric, kind, empty_init=False, seed=0)
        train_steps(fabric, model, optimizer, scheduler, steps=2)
        expected = {
            "model": full_state(model),
            "optimizer": full_optimizer_state(model.module, optimizer.optimizer),
            "scheduler": scheduler.state_dict(),
        }
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "note": kind}
        fabric.save(Path(out) / f"{kind}-sharded", state)
        if full:
            fabric.strategy.save_full_checkpoint(Path(out) / f"{kind}-full.pth", state)
            fabric.save(Path(out) / f"{kind}-model.safetensors", {"model": model})
        if fabric.global_rank == 0:
            torch.save(expected, Path(out) / f"{kind}-expected.pt")
        facts[kind] = sorted(name for name, _ in model.module.named_parameters())
    fabric.strategy.wait_for_checkpoint()
    return facts


def load(
    num_nodes: int,
    devices: int,
    out: str,
    tensor_parallel_size: int,
    split_replica_reads: bool = False,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Load each saved checkpoint into a meta-initialised model on this layout; compare exactly with expected.

    Where ``save(full=True)`` also wrote the full checkpoint (``KIND-full.pth``, with optimizer state), it is loaded
    the same way (facts under ``KIND-full``).
    """
    fabric = make_fabric(
        num_nodes,
        devices,
        tensor_parallel_size=tensor_parallel_size,
        split_replica_reads=split_replica_reads,
        **strategy_kwargs,
    )
    facts = {}
    for kind in KINDS:
        for name in (f"{kind}-sharded", f"{kind}-full.pth"):
            if not (Path(out) / name).exists():
                continue
            model, optimizer, scheduler = setup_training(fabric, kind, empty_init=True, seed=99)
            state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
            remainder = fabric.load(Path(out) / name, state)
            expected = torch.load(Path(out) / f"{kind}-expected.pt", weights_only=False)
            actual = full_state(model)
            actual_optimizer = full_optimizer_state(model.module, optimizer.optimizer)
            facts[kind if name.endswith("sharded") else f"{kind}-full"] = {
                "model_equal": {key: torch.equal(actual[key], tensor) for key, tensor in expected["model"].items()},
                "optimizer_equal": {
                    f"{key}.{entry}": torch.equal(actual_optimizer[key][entry], value)
                    for key, entries in expected["optimizer"].items()
                    for entry, value in entries.items()
                },
                "scheduler_equal": scheduler.state_dict() == expected["scheduler"],
                "step": state["step"],
                "remainder": remainder,
                "mesh": tuple(fabric.strategy.device_mesh.shape),
            }
    return facts


def load_raw(
    num_nodes: int, devices: int, cases: list[dict[str, Any]], tensor_parallel_size: int = 2, **strategy_kwargs: Any
) -> list[dict]:
    """Each case: fill a meta-initialised model from a consolidated file; compare the gathered weights exactly.

    Also counts the tensor bytes each rank reads.
    """
    counter = ReadCounter()
    fabric = make_fabric(num_nodes, devices, tensor_parallel_size=tensor_parallel_size, **strategy_kwargs)
    results = []
    for case in cases:
        with fabric.init_module(empty_init=True):
            model = build(case["kind"], seed=123)
        model = fabric.setup_module(model)
        counter.bytes = 0
        if case.get("via_fabric_load"):
            fabric.load(case["file"], {"model": model})
        else:
            fabric.strategy.load_raw(case["file"], model, load_mode=case.get("mode"))
        read = counter.bytes
        expected = torch.load(case["reference"], weights_only=True)
        actual = full_state(model)
        with torch.no_grad():
            reference = build(case["kind"], seed=0)
            reference.load_state_dict(expected)
            difference = (logits_of(model, TOKENS) - logits_of(reference, TOKENS)).abs().max().item()
        dist.barrier()
        results.append(
            {
                "file": Path(case["file"]).name,
                "mode": case.get("mode"),
                "weights_equal": all(torch.equal(actual[name], tensor) for name, tensor in expected.items()),
                "unequal": [name for name, tensor in expected.items() if not torch.equal(actual[name], tensor)],
                "bytes_read": read,
                "max_logit_diff": difference,
            }
        )
    return results
