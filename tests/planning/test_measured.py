"""The planner's predictions against 2 simulated nodes x 2 CPU ranks (gloo), in one launch.

* Local shard bytes of parameters, gradients and optimizer state after an optimizer step, for ``shard_size`` "node",
  "world" and 1, fp32 and bf16-mixed (plus bf16-true and SGD with momentum): within 2 % of ``memory_per_device``.
* Peak resident memory of a short AdamW training run against the predicted total: 0.93-1.03 of it. The ranks set
  glibc's mmap threshold to 128 KiB (``mallopt``, as ``MALLOC_MMAP_THRESHOLD_=131072`` would), so freed buffers of
  128 KiB and more go back to the OS at once and the resident set follows what is allocated; with glibc's default
  (a threshold that grows to 32 MiB), freed activation and gradient buffers stay in its heaps and the resident set
  ends 1.3-1.6x higher (docs/concepts.md has the figures).
* ``HybridFSDPStrategy(shard_size="auto", memory_budget=...)`` picks the layout the plan recommends (both nodes when
  one node's group does not fit; with ``tensor_parallel_size=2`` too), trains with it, and fails every rank with the
  planner's error when nothing fits.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from examples.tiny_llama import Llama, LlamaConfig, loss_fn
from fabric_hsdp.planning import Training, Workload, memory_per_device, model_shape_of_module
from fabric_hsdp.topology import Topology
from tests.helpers.launch import launch
from tests.helpers.training import make_fabric

pytestmark = pytest.mark.slow

TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=16)
UNEVEN = dict(vocab_size=250, dim=64, n_layers=2, n_heads=4, hidden_dim=98, max_seq_len=16)  # rows % 4 != 0
PEAK = dict(vocab_size=8192, dim=256, n_layers=4, n_heads=4, hidden_dim=688, max_seq_len=128)
SHARD = {"node": 2, "world": 4, 1: 1}


def shape_of(config):
    with torch.device("meta"):
        return model_shape_of_module(Llama(LlamaConfig(**config)))


def test_predicted_shard_bytes_and_peak_memory_match_the_measured():
    cases = [
        dict(shard_size=size, precision=precision, optimizer="adamw", config=TINY)
        for precision in ("32-true", "bf16-mixed")
        for size in ("node", "world", 1)
    ]
    cases.append(dict(shard_size="node", precision="bf16-true", optimizer="adamw", config=TINY))
    cases.append(dict(shard_size="world", precision="32-true", optimizer="sgd", config=TINY))
    cases.append(dict(shard_size="world", precision="32-true", optimizer="adamw", config=UNEVEN))
    # tensor parallelism: the tiny Llama's own plan splits attention, MLP, embedding and head 2 ways, norms not
    cases.append(dict(shard_size="world", tensor_parallel_size=2, precision="32-true", optimizer="adamw", config=TINY))
    cases.append(dict(shard_size="node", tensor_parallel_size=2, precision="bf16-mixed", optimizer="sgd", config=TINY))
    peak = dict(config=PEAK, batch=4, seq=128, steps=2, mmap_threshold=128 * 1024)
    # shard_size="auto": a budget where one node's shard group does not fit but both nodes' does, and one too small
    tiny, training = shape_of(TINY), Training("32-true", Workload(2, 8))
    node, world = (memory_per_device(tiny, training, shard, 1).total for shard in (2, 4))
    node_tp, world_tp = (memory_per_device(tiny, training, shard, 2).total for shard in (1, 2))
    auto = [
        dict(budget=int((node + world) / 2 / 0.9)),
        dict(budget=int(world / 2)),
        dict(budget=int((node_tp + world_tp) / 2 / 0.9), tensor_parallel_size=2),
    ]
    values = (
        launch(
            measurements,
            {"peak": peak, "cases": cases, "auto": auto},
            timeout=240,
        )
        .check()
        .values
    )

    for index, case in enumerate(cases):
        shard, tensor = SHARD[case["shard_size"]], case.get("tensor_parallel_size", 1)
        training = Training(case["precision"], Workload(optimizer=case["optimizer"]))
        predicted = memory_per_device(shape_of(case["config"]), training, shard // tensor, tensor)
        mesh_shape = Topology(2, 2, shard, tensor).mesh_shape
        assert all(rank["state"][index]["mesh_shape"] == mesh_shape for rank in values)
        for kind in ("parameters", "gradients", "optimizer"):
            measured = [rank["state"][index]["bytes"][kind] for rank in values]
            expected = getattr(predicted, kind)
            # the planner reports the device with the most rows (FSDP2's first chunk): rank 0 holds it
            assert measured[0] == pytest.approx(expected, rel=0.02), (case, kind, measured, expected)
            if case["config"] is TINY:
                assert all(value == pytest.approx(expected, rel=0.02) for value in measured), (case, kind, measured)
            else:
                assert max(measured) == measured[0] > min(measured), (case, kind, measured)

    predicted_peak = memory_per_device(shape_of(PEAK), Training("32-true", Workload(4, 128, "adamw")), 2, 1).total
    # measured here (torch 2.13, glibc, 2 x 2 gloo ranks): 0.982-0.985 of the planned 160.0 MB (the peak as the
    # largest moment, #45; summed at the start of backward it was 177.9 MB and the ratio 0.883-0.888); the band is
    # that figure 5 % either way, for other machines' allocators. It was +-25 %, in which a planner forgetting the
    # loss's fp32 copies of the logits (plant 46j6) passed.
    ratios = [rank["peak"]["peak"] / predicted_peak for rank in values]
    print("peak RSS / planned peak, per rank:", [round(ratio, 4) for ratio in ratios])
    assert all(0.93 <= ratio <= 1.03 for ratio in ratios), (ratios, predicted_peak)

    for rank in values:
        fits_both_nodes, fits_nowhere, with_tensor_parallel = rank["auto"]
        assert fits_both_nodes == {"mesh_shape": (1, 4), "shard_size": 4}
        assert fits_nowhere["error"].startswith(f"no layout fits {int(world / 2) * 0.9 / 1e3:.1f} KB per device")
        assert f"the smallest total is {world / 1e6:.1f} MB per device with shard_size=4" in fits_nowhere["error"]
        assert with_tensor_parallel == {"mesh_shape": (1, 2, 2), "shard_size": 4}


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# What the planner predicts, measured: local shard bytes after a step, and peak process memory.


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
