"""Scenarios that measure what the planner predicts: local shard bytes after a step, and peak process memory."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from examples.tiny_llama import Llama, LlamaConfig, loss_fn
from fabric_hsdp.planning import model_shape_of_module
from tests.helpers.training import make_fabric

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _train_steps(
    fabric: Any, model: torch.nn.Module, optimizer: Any, config: LlamaConfig, batch: int, seq: int, steps: int
) -> None:
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        del loss, tokens


def measurements(
    num_nodes: int, devices: int, peak: dict[str, Any], cases: list[dict[str, Any]], auto: list[dict[str, Any]]
) -> dict[str, Any]:
    """All in one launch: the peak first (nothing else has run yet), then the shard bytes, then shard_size='auto'."""
    return {
        "peak": peak_memory(num_nodes, devices, **peak),
        "state": state_bytes(num_nodes, devices, cases),
        "auto": [auto_layout(num_nodes, devices, **case) for case in auto],
    }


def auto_layout(num_nodes: int, devices: int, budget: int, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """shard_size='auto' with ``budget`` bytes per rank: the mesh it built and one training step, or its error."""
    from fabric_hsdp.planning import Workload

    fabric = make_fabric(
        num_nodes,
        devices,
        shard_size="auto",
        memory_budget=budget,
        workload=Workload(2, 8),
        tensor_parallel_size=tensor_parallel_size,
    )
    config = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=16)
    with fabric.init_module(empty_init=True):
        model = Llama(config)
    try:
        model = fabric.setup_module(model)
    except ValueError as error:
        return {"error": str(error)}
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    _train_steps(fabric, model, optimizer, config, batch=2, seq=8, steps=1)
    return {"mesh_shape": tuple(fabric.strategy.device_mesh.shape), "shard_size": fabric.strategy.topology.shard_size}


def peak_memory(
    num_nodes: int,
    devices: int,
    config: dict[str, Any],
    batch: int,
    seq: int,
    steps: int,
    mmap_threshold: int | None = None,
) -> dict[str, Any]:
    """Peak resident memory of a short training run, above the footprint of a process that has trained before.

    A warm-up step on a tiny model first pays the one-time costs of a process's first training step (kernel
    libraries' buffers, thread pools, gloo pairs); that growth is reported too. Then the high-water mark is reset
    (``/proc/self/clear_refs``), and pages of shared libraries first touched afterwards (``RssFile`` growth) are
    subtracted, so the figure is anonymous memory: what the model, its gradients, optimizer state, gathered units,
    activations and temporaries took, plus what the allocator kept.
    """
    # Freed buffers of 128 KiB and more go back to the OS at once, so the resident set follows the allocations. glibc's
    # default threshold grows to 32 MiB as large buffers are freed, after which freed activations stay in its heaps.
    # (The MALLOC_MMAP_THRESHOLD_ variable would do the same, but ranks forked from the test's fork server have
    # read their environment already.)
    if mmap_threshold is not None:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    fabric = make_fabric(num_nodes, devices, shard_size="node")
    gc.collect()
    started = _status()
    warm_config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=seq)
    with fabric.init_module(empty_init=True):
        warm = Llama(warm_config)
    warm = fabric.setup_module(warm)
    warm_optimizer = fabric.setup_optimizers(torch.optim.AdamW(warm.parameters(), lr=1e-4))
    _train_steps(fabric, warm, warm_optimizer, warm_config, batch, seq, 1)
    del warm, warm_optimizer
    gc.collect()
    llama_config = LlamaConfig(**config)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status()
    with fabric.init_module(empty_init=True):
        model = Llama(llama_config)
    shape = model_shape_of_module(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    _train_steps(fabric, model, optimizer, llama_config, batch, seq, steps)
    after = _status()
    return {
        "peak": after["VmHWM"] - before["VmRSS"] - (after["RssFile"] - before["RssFile"]),
        "warm_up": before["RssAnon"] - started["RssAnon"],
        "before": before,
        "after": after,
        "model_shape": shape,
    }


def state_bytes(num_nodes: int, devices: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case (shard_size, tensor_parallel_size, precision, optimizer): set up, take a step, sum local bytes."""
    results = []
    for case in cases:
        fabric = make_fabric(
            num_nodes,
            devices,
            precision=case["precision"],
            shard_size=case["shard_size"],
            tensor_parallel_size=case.get("tensor_parallel_size", 1),
        )
        config = LlamaConfig(**case["config"])
        with fabric.init_module(empty_init=True):
            model = Llama(config)
        model = fabric.setup_module(model)
        if case["optimizer"] == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9 if case["optimizer"] == "sgd" else 0)
        optimizer = fabric.setup_optimizers(optimizer)
        _train_steps_keep_grads(fabric, model, optimizer, config)
        parameters = list(model.parameters())
        results.append(
            {
                **case,
                "mesh_shape": tuple(fabric.strategy.device_mesh.shape),
                "bytes": {
                    "parameters": sum(_local_bytes(p) for p in parameters),
                    "gradients": sum(_local_bytes(p.grad) for p in parameters if p.grad is not None),
                    "optimizer": sum(
                        _local_bytes(value)
                        for state in optimizer.state.values()
                        for value in state.values()
                        if isinstance(value, torch.Tensor)
                    ),
                },
            }
        )
        del model, optimizer, parameters
        gc.collect()
    return results


def _train_steps_keep_grads(fabric: Any, model: torch.nn.Module, optimizer: Any, config: LlamaConfig) -> None:
    """One step, then a backward whose gradients stay (as during the next step), so all three can be counted."""
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(2):
        tokens = torch.randint(0, config.vocab_size, (2, 9), generator=generator)
        fabric.backward(loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).float())
        if step == 0:
            optimizer.step()
            optimizer.zero_grad()
