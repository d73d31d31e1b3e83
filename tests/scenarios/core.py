"""Scenarios for the strategy core: topology, placements, meta init, training parity, exits and failures."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fabric_hsdp import HybridFSDPStrategy
from tests.helpers.training import batch, build, copy_full_into, hf_config, layer_class, logits_of, make_fabric


def placements(num_nodes: int, devices: int, shard_size: Any = "node", kind: str = "llama") -> dict[str, Any]:
    """Meta init, then setup: mesh, placements, local shard shapes, devices, buffers and logits vs a CPU build."""
    fabric = make_fabric(num_nodes, devices, shard_size=shard_size, sharded_modules={layer_class(kind)})
    reference = build(kind, seed=0)
    with fabric.init_module(empty_init=True):
        model = build(kind, seed=123)
    on_meta_before = all(p.is_meta for p in model.parameters())
    buffers_real_before = all(not b.is_meta for b in model.buffers())
    model = fabric.setup_module(model)
    shards_finite = all(torch.isfinite(p.to_local()).all().item() for p in model.parameters())
    # initialised by reset_parameters() (or Hugging Face's _init_weights), not left as uninitialised memory
    norms_are_ones = [
        bool((sub.weight.to_local() == 1).all())
        for sub in model.module.modules()
        if "Norm" in type(sub).__name__ and getattr(sub, "weight", None) is not None
    ]
    copy_full_into(model, reference.state_dict())
    mesh = fabric.strategy.device_mesh
    params = dict(model.module.named_parameters())
    reference_buffers = dict(reference.named_buffers())
    facts = {
        "mesh_shape": tuple(mesh.shape),
        "mesh_dim_names": mesh.mesh_dim_names,
        "coordinates": fabric.strategy.topology.coordinates(fabric.global_rank),
        "mesh_coordinate": tuple(mesh.get_coordinate()),
        "on_meta_before": on_meta_before,
        "buffers_real_before": buffers_real_before,
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "placements": {name: tuple(str(x) for x in p.placements) for name, p in params.items()},
        "local_shapes": {name: tuple(p.to_local().shape) for name, p in params.items()},
        "global_shapes": {name: tuple(p.shape) for name, p in params.items()},
        "devices": {str(p.to_local().device) for p in params.values()},
        "shards_finite": shards_finite,
        "norms_are_ones": norms_are_ones,
        "buffers_equal": {
            name: torch.equal(buffer.cpu(), reference_buffers[name]) for name, buffer in model.module.named_buffers()
        },
        "sampler": fabric.strategy.distributed_sampler_kwargs,
    }
    tokens, _ = batch(2)
    with torch.no_grad():
        facts["max_logit_diff"] = (logits_of(model, tokens) - logits_of(reference, tokens)).abs().max().item()
    return facts


def mixed_precision(num_nodes: int, devices: int, precision: str = "bf16-mixed") -> dict[str, Any]:
    """bf16-mixed (or 16-mixed): half-precision parameters in compute, fp32 master shards, fp32 gradient reduction
    (the dtypes FSDP2's reduce-scatter over ``shard`` and all-reduce over ``replicate`` are given), finite loss."""
    plugins = []
    if precision == "16-mixed":  # on CPU, Fabric turns "16-mixed" into bf16 unless given the plugin itself
        from lightning.fabric.plugins.precision import MixedPrecision

        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    strategy = HybridFSDPStrategy(sharded_modules={layer_class("llama")})
    fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy,
                      precision=None if plugins else precision, plugins=plugins)  # fmt: skip
    fabric.launch()
    model = fabric.setup_module(build("llama"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    compute_dtypes = []
    linear = model.module.layers[0].attention.wq
    autocast = []

    def record(module: torch.nn.Module, args: Any) -> None:
        compute_dtypes.append(module.weight.dtype)
        autocast.append(torch.is_autocast_enabled("cpu"))

    handle = linear.register_forward_pre_hook(record)
    reduced: dict[str, set[str]] = {"reduce_scatter": set(), "all_reduce": set()}
    # the function FSDP2 calls to reduce-scatter: reduce_scatter_single from torch 2.13, reduce_scatter_tensor before
    scatter_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter, all_reduce = getattr(dist, scatter_name), dist.all_reduce

    def recording_reduce_scatter(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:  # noqa: A002
        reduced["reduce_scatter"].add(str(input.dtype))
        return reduce_scatter(output=output, input=input, **kwargs)

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel() > 1:  # gradients, not a scalar (found-inf flags, losses)
            reduced["all_reduce"].add(str(tensor.dtype))
        return all_reduce(tensor, *args, **kwargs)

    inputs, targets = batch(2, seed=fabric.global_rank)
    losses, output_dtypes = [], set()
    for _ in range(2):
        logits = model(inputs)
        output_dtypes.add(str(logits.dtype))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        setattr(dist, scatter_name, recording_reduce_scatter)
        dist.all_reduce = recording_all_reduce
        fabric.backward(loss)
        setattr(dist, scatter_name, reduce_scatter)
        dist.all_reduce = all_reduce
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    handle.remove()
    fabric.strategy.teardown()
    return {
        "precision": fabric.strategy.precision_name,
        "initialized_after_teardown": dist.is_initialized(),
        "compute_dtypes": [str(d) for d in compute_dtypes],
        "autocast": autocast,
        "output_dtypes": sorted(output_dtypes),
        "master_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "optimizer_state_dtypes": sorted(
            {str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        ),
        "reduced_dtypes": {what: sorted(dtypes) for what, dtypes in reduced.items()},
        "losses": losses,
    }


def replicas_differ(module: torch.nn.Module, world_size: int) -> list[str]:
    """Every parameter and buffer whose local shard differs between replicas (ranks r and r + 2 of a 2 x 2 mesh)."""
    differ = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(pieces, local)
        half = world_size // 2
        if not all(torch.equal(pieces[rank], pieces[rank + half]) for rank in range(half)):
            differ.append(name)
    return differ


def init_consistency(num_nodes: int, devices: int) -> dict[str, Any]:
    """Per-rank seeds (as in the user report): shard peers must differ, replicas must hold identical shards."""
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    fabric.seed_everything(100 + fabric.global_rank)
    facts = {}
    for case, empty_init in (("per-rank seeds, empty_init", True), ("per-rank seeds", False), ("one seed", True)):
        # "one seed": identical generators on every rank, and shard peers must still differ
        seed = 7 if case == "one seed" else fabric.global_rank
        with fabric.init_module(empty_init=empty_init):
            model = build("llama", seed=seed)
        model = fabric.setup_module(model)
        weight = model.module.layers[0].feed_forward.w1.weight  # [96, 64]: local shards of 48 rows
        full = weight.full_tensor()
        facts[case] = {
            "halves_differ": not torch.equal(full[:48], full[48:]),
            "replicas_differ": replicas_differ(model.module, fabric.world_size),
            "checked": len(list(model.module.named_parameters())) + len(list(model.module.named_buffers())),
            "std": full.std().item(),
        }
    return facts


def _train_a_step(num_nodes: int, devices: int, tensor_parallel_size: int) -> tuple[Any, Any, torch.Tensor]:
    """Meta-init, set up and train the llama one step: a plain script's first step; the fabric, model and inputs."""
    fabric = make_fabric(
        num_nodes, devices, sharded_modules={layer_class("llama")}, tensor_parallel_size=tensor_parallel_size
    )
    with fabric.init_module(empty_init=True):
        model = build("llama")
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    inputs, targets = batch(2, seed=fabric.global_rank)
    fabric.backward(torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    optimizer.step()
    return fabric, model, inputs


def train_and_exit(num_nodes: int, devices: int, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """A script that does nothing special: train a step and let the interpreter exit."""
    fabric, model, inputs = _train_a_step(num_nodes, devices, tensor_parallel_size)
    with torch.no_grad():
        model(inputs)
    return {"rank": fabric.global_rank}


def train_then_fail_to_load(num_nodes: int, devices: int, checkpoint: str, tensor_parallel_size: int = 1) -> None:
    """A script that trains a step, then loads a checkpoint that lacks a weight: every rank must exit 1, cleanly."""
    fabric, model, _ = _train_a_step(num_nodes, devices, tensor_parallel_size)
    fabric.load_raw(checkpoint, model)  # raises CheckpointError on every rank


def fail_on_one_rank(num_nodes: int, devices: int, failing_rank: int) -> None:
    """One rank passes a sharding policy that matches nothing; every rank must end with an error, fast."""
    rank = int(os.environ["NODE_RANK"]) * devices + int(os.environ["LOCAL_RANK"])
    policy = {torch.nn.GRU} if rank == failing_rank else {layer_class("llama")}
    fabric = make_fabric(num_nodes, devices, sharded_modules=policy)
    started = time.monotonic()
    try:
        fabric.setup_module(build("llama"))
    finally:
        print(f"setup ended after {time.monotonic() - started:.2f}s", flush=True)
    dist.barrier()  # never reached when setup fails somewhere


def bad_shard_size(num_nodes: int, devices: int, shard_size: int) -> None:
    make_fabric(num_nodes, devices, shard_size=shard_size, sharded_modules={layer_class("llama")})


def bad_tensor_parallel(num_nodes: int, devices: int, tensor_parallel_size: int, heads: int = 4) -> None:
    """A tensor-parallel size the topology rejects, or a model whose heads it would split: every rank must fail."""
    from transformers import LlamaForCausalLM

    started = time.monotonic()
    try:  # the topology fails in make_fabric, the heads in setup_module: both print the line
        fabric = make_fabric(num_nodes, devices, tensor_parallel_size=tensor_parallel_size)
        config = hf_config()
        config.num_attention_heads = config.num_key_value_heads = heads
        config.hidden_size, config.head_dim = 16 * heads, 16  # q_proj: 16 * heads rows, divisible by 2 even for 3
        fabric.setup_module(LlamaForCausalLM(config))
    finally:
        print(f"setup ended after {time.monotonic() - started:.2f}s", flush=True)
    dist.barrier()  # never reached when setup fails somewhere


def tensor_parallel_init(num_nodes: int, devices: int, shard_size: Any = "node") -> dict[str, Any]:
    """Meta init under tensor parallelism: slices differ, values replicated over a dim are equal along it."""
    from fabric_hsdp.tensor_parallel import fused_rows_of

    fabric = make_fabric(num_nodes, devices, shard_size=shard_size, tensor_parallel_size=2)
    fabric.seed_everything(100 + fabric.global_rank)  # per-rank seeds, as in the user report
    facts: dict[str, Any] = {}
    for kind in ("llama", "litgpt"):
        reference = build(kind, seed=0)
        with fabric.init_module(empty_init=True):
            model = build(kind, seed=fabric.global_rank)
        model = fabric.setup_module(model)
        mesh = fabric.strategy.parallel_mesh
        gathered = {}
        for name, param in model.module.named_parameters():
            local = param.to_local().contiguous()
            pieces = [torch.empty_like(local) for _ in range(fabric.world_size)]
            dist.all_gather(pieces, local)
            gathered[name] = pieces
        coordinates = [fabric.strategy.topology.coordinates(rank) for rank in range(fabric.world_size)]
        norms = {
            name: all(bool((piece == 1).all()) for piece in pieces)
            for name, pieces in gathered.items()
            if "norm" in name
        }
        facts[kind] = {
            "coordinates": coordinates,
            "mesh_shape": tuple(mesh.device_mesh.shape),
            "mesh_dim_names": mesh.device_mesh.mesh_dim_names,
            "replicated_dims": {name: mesh.replicated_dims(p) for name, p in model.module.named_parameters()},
            "placements": {name: tuple(str(x) for x in p.placements) for name, p in model.module.named_parameters()},
            "gathered": {name: [piece.clone() for piece in pieces] for name, pieces in gathered.items()},
            "norms_are_ones": norms,
            "fused": sorted(fused_rows_of(model.module)),
            "buffers_equal": {
                name: torch.equal(buffer.cpu(), dict(reference.named_buffers())[name])
                for name, buffer in model.module.named_buffers()
            },
        }
        copy_full_into(model, reference.state_dict())  # the same weights give the same logits
        tokens, _ = batch(2)
        with torch.no_grad():
            facts[kind]["max_logit_diff"] = (logits_of(model, tokens) - logits_of(reference, tokens)).abs().max().item()
        facts[kind]["gradient_norm"] = _gradient_norms(fabric, model, reference, tokens)
    return facts


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _gradient_norms(fabric: L.Fabric, model: Any, reference: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    """One backward's gradient norm from ``fabric.clip_gradients`` and what DTensor logged meanwhile, the same norm
    with DTensor's one all-reduce per mesh dim, and one process's norm of the same weights and batch."""
    from torch.distributed.tensor import _redistribute

    from fabric_hsdp.gradients import clip_grad_norm

    targets = tokens.roll(-1, dims=1)
    for module in (model, reference):
        loss = torch.nn.functional.cross_entropy(logits_of(module, tokens).flatten(0, 1), targets.flatten())
        fabric.backward(loss) if module is model else loss.backward()
    # after the backward: FSDP leaves the root's parameters gathered after a forward (the one above, in no_grad)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.0))
    # torch >= 2.11 merges the all-reduces of several mesh dims into one; 2.8 has no such transform to disable
    sequential_only = getattr(_redistribute, "disable_redistribute_transform_optimization", contextlib.nullcontext)
    with sequential_only():  # max_norm=inf: the gradients stay as they are
        sequential = clip_grad_norm(model.parameters(), max_norm=float("inf")).item()
    getattr(_redistribute, "_warned_flatten_issues", set()).clear()  # DTensor logs a missing flattened dim once
    records = _Records()
    logger = logging.getLogger("torch.distributed.tensor")
    logger.addHandler(records)
    try:
        norm = fabric.clip_gradients(model, optimizer, max_norm=0.5).item()
    finally:
        logger.removeHandler(records)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5).item()
    return {"ours": norm, "sequential": sequential, "reference": expected, "logged": records.messages}


def fail_while_starting(num_nodes: int, devices: int, out: str) -> None:
    """The rank-layout check fails once the process group exists (as under ``srun --distribution=cyclic``). An exit
    handler registered before the strategy's, so run after it (``atexit`` is last in, first out), records whether the
    process group was still alive then: the interpreter's own teardown of it can abort the rank."""
    import atexit
    from pathlib import Path
    from unittest import mock

    atexit.register(lambda: (Path(out) / str(os.getpid())).write_text(str(dist.is_initialized())))
    planted = ValueError("the launcher numbered the global ranks across nodes (planted)")
    with mock.patch("fabric_hsdp.distributed.check_rank_placement", side_effect=planted):
        make_fabric(num_nodes, devices)
