"""Random numbers under tensor parallelism: the same draws where the ranks hold the same values, different where not.

Users seed each rank differently (``seed_everything(seed + rank)``), which is right across data-parallel ranks but
wrong across tensor-parallel peers: in the replicated regions (the residual stream between layers, the embedding's
output) every peer computes the same activation and must draw the same dropout mask, or the copies diverge. Inside a
split region (attention heads, MLP columns; with sequence parallelism the whole layer, which works on a sequence
shard) each peer holds different values and must draw its own mask, or the masks of different heads or tokens are
correlated. Megatron keeps two generator states for this (``model_parallel_cuda_manual_seed``); torchtitan seeds the
tensor-parallel peers alike.

Here: :func:`synchronize_random_state` gives the tensor-parallel peers rank 0's CPU and device generator states at
``setup_module`` (peers then run the same ops and stay in step), and :func:`seed_split_regions` wraps each split
region's forward: it draws one number from the shared generator (every peer draws the same, so the shared stream
advances alike), and runs the region on generators seeded with that number and the peer's tensor-parallel index,
restoring the shared state afterwards. The region's seed comes from the shared state at its entry, so activation
checkpointing (which restores that state before recomputing) recomputes the same masks. Only regions that have
dropout (:func:`has_dropout`) are wrapped: the wrapper's ``.item()`` and ``fork_rng`` are graph breaks under
``compile=True`` (a Llama block without dropout compiled to 6 graphs with them, one without), and a region that
draws nothing needs no generator of its own.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fabric_hsdp.versions import dropout_base_class

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_SEED_RANGE = 2**62


def split_regions(model: nn.Module, rowwise: list[str], sequence_parallel: bool) -> list[str]:
    """The modules whose forward runs on split values: the parents of the row-wise layers (attention, MLP), or with
    sequence parallelism the layers (elements of an ``nn.ModuleList``) holding them."""
    layers = {
        f"{name}.{index}" if name else str(index)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for index in range(len(module))
    }
    regions = []
    for name in rowwise:
        region = name.rpartition(".")[0]
        if sequence_parallel:
            ancestors = [region[:i] for i in range(len(region), 0, -1) if i == len(region) or region[i] == "."]
            region = next((ancestor for ancestor in ancestors if ancestor in layers), region)
        if region not in regions:
            regions.append(region)
    nested = [r for r in regions if any(r.startswith(f"{other}.") for other in regions)]
    return [r for r in regions if r not in nested]


def seed_split_regions(model: nn.Module, regions: list[str], tensor_rank: int, device: torch.device) -> None:
    """Run each region's forward on generators of its own for this tensor-parallel rank (see module docstring);
    ``device``: where the model computes (its generator is seeded besides the CPU's)."""
    devices = [device.index or 0] if device.type == "cuda" else []
    for name in regions:
        module = model.get_submodule(name)
        if not has_dropout(module):
            continue
        stacks: list[ExitStack] = []

        def enter(module: nn.Module, args: Any, stacks: list[ExitStack] = stacks) -> None:
            seed = int(torch.randint(_SEED_RANGE, (), dtype=torch.int64).item())  # the same on every peer
            stack = ExitStack()
            stack.enter_context(torch.random.fork_rng(devices=devices))
            own = (seed * 1_000_003 + tensor_rank + 1) % _SEED_RANGE
            torch.default_generator.manual_seed(own)
            if devices:
                torch.cuda.default_generators[devices[0]].manual_seed(own)
            stacks.append(stack)

        def leave(module: nn.Module, args: Any, output: Any, stacks: list[ExitStack] = stacks) -> None:
            if stacks:
                stacks.pop().close()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` may draw dropout masks: it holds an ``nn.Dropout`` (of any kind) with ``p > 0``, or a
    float attribute named ``*dropout*`` above 0 that its forward passes to ``F.dropout`` or an attention function
    (transformers' ``attention_dropout``, the example model's ``dropout``). A forward that draws random numbers
    without either (``F.dropout(x, 0.1)`` with a literal) is not seen: its peers then draw alike in that region."""
    for sub in module.modules():
        if isinstance(sub, dropout_base_class()) and sub.p > 0:
            return True
        if any("dropout" in key and isinstance(value, float) and value > 0 for key, value in vars(sub).items()):
            return True
    return False


def synchronize_random_state(mesh: DeviceMesh, device: torch.device) -> None:
    """Give every tensor-parallel peer the CPU (and ``device``'s) generator state of tensor-parallel rank 0."""
    states: list[Any] = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    dist.broadcast_object_list(states, group=mesh.get_group(), group_src=0, device=device)
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
