"""A LoRA model's merged weights (``W + delta``, the adapters folded into the base) written as the base model's own
checkpoint: a transformers directory (``from_pretrained``) for peft, litgpt's ``lit_model.pth`` for ``lora.GPT``.

Each delta is the library's own: peft's ``layer.get_delta_weight(adapter)`` (summed over the active adapters, as
``merge_and_unload`` does), litgpt's ``layer.get_lora_AB()``. They run on the layer's adapter tensors gathered whole
(small), swapped in for the call. Rank 0 asks for one base tensor at a time; every rank gathers it (and the adapters
it merges), so rank 0 holds one full tensor, never the model.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.writers.full_files import write_safetensors, write_torch_file
from fabric_hsdp.models.lora import Wrapper, base_names, user_module, wrappers_of
from fabric_hsdp.versions import module_parameters


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def _whole_adapters(layer: nn.Module, wrapper: Wrapper) -> Iterator[None]:
    """Within this context ``layer``'s adapter parameters are their full tensors (plain, gathered), so the library's
    own delta function runs as in one process; the sharded ones are put back after."""
    owners: list[tuple[nn.Module, str]] = []
    for attribute in wrapper.adapter_attributes:
        held = getattr(layer, attribute, None)
        if isinstance(held, nn.Module):
            owners += [(sub, name) for sub in held.modules() for name in module_parameters(sub)]
        elif isinstance(held, torch.Tensor):
            owners.append((layer, attribute))
    saved = [(owner, name, module_parameters(owner)[name]) for owner, name in owners]
    try:
        for owner, name, param in saved:
            if param is not None:
                module_parameters(owner)[name] = nn.Parameter(_full(param).detach(), requires_grad=False)
        yield
    finally:
        for owner, name, param in saved:
            module_parameters(owner)[name] = param


def _delta(layer: nn.Module, wrapper: Wrapper) -> torch.Tensor | None:
    """The layer's weight update by its library's own function, or ``None`` when it has no adapter."""
    with torch.no_grad(), _whole_adapters(layer, wrapper):
        if wrapper.library == "peft":
            deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in getattr(layer, "lora_A", {})]
            return sum(deltas[1:], deltas[0]) if deltas else None
        if layer.r > 0 and any(getattr(layer, "enable_lora", [True])):
            return layer.get_lora_AB()
    return None


def _merged(tensor: torch.Tensor, merge: tuple[nn.Module, Wrapper] | None) -> torch.Tensor:
    full = _full(tensor).detach()
    delta = None if merge is None else _delta(*merge)
    if delta is not None:
        full = full + delta.to(full.dtype)  # W + delta, as the libraries' merge does in place
    return full.cpu()


def _merged_tensors(module: nn.Module) -> dict[str, tuple[torch.Tensor, tuple[nn.Module, Wrapper] | None]]:
    """Each base tensor by its base name: the sharded tensor, and the adapted layer that merges into it."""
    names = base_names(module)
    if not names:
        raise ValueError(
            f"{type(module).__name__} holds no LoRA layer (peft's get_peft_model or litgpt's lora.GPT): there is"
            " nothing to merge. Save the model with strategy.save_full_checkpoint."
        )
    wrappers = wrappers_of(module).items()
    weight_of = {f"{name}.{wrapper.inner}.weight": (layer, wrapper) for name, (layer, wrapper) in wrappers}
    seen: set[int] = set()
    entries = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if names[key] is None or id(tensor) in seen:  # an adapter, or the second name of a tied weight
            continue
        seen.add(id(tensor))
        entries[names[key]] = (tensor, weight_of.get(key))
    return entries


def export_merged(
    model: nn.Module, path: str | Path, max_shard_size: str = "5GB", overwrite: bool = True
) -> Path | None:
    """Write ``model``'s weights with its adapters merged in, as its base model's checkpoint: for a peft model a
    transformers directory (``model.safetensors`` or shards with an index, and ``config.json``) that
    ``AutoModelForCausalLM.from_pretrained`` loads; for litgpt's ``lora.GPT`` a ``lit_model.pth`` that litgpt's
    ``GPT.load_state_dict`` takes.

    Call on every rank; rank 0 writes (atomically) and returns the path, the others ``None``.
    """
    module = user_module(model)
    entries = _merged_tensors(module)
    library = next(iter(wrappers_of(module).values()))[1].library
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    order = list(entries)

    def read(name: str) -> torch.Tensor:
        _announce(order.index(name))
        return _merged(*entries[name])

    tensors = {
        name: LazyTensor(name, tensor.shape, tensor.dtype, lambda name=name: read(name))
        for name, (tensor, _) in entries.items()
    }
    written = None
    with fail_together(f"exporting the merged model to '{path}'"):
        if rank == 0:
            try:
                if library == "peft":
                    with tempfile.TemporaryDirectory() as scratch:
                        config = Path(scratch) / "config.json"
                        module.get_base_model().config.to_json_file(config)
                        write_safetensors(
                            path, tensors, max_shard_size=max_shard_size, extra_files={"config.json": config},
                            overwrite=overwrite,
                        )  # fmt: skip
                else:
                    write_torch_file(path, tensors, overwrite=overwrite)
                written = path
            finally:
                _announce(None)  # releases the other ranks, also when writing failed
        else:
            failed: Exception | None = None
            while (index := _announce(None)) is not None:
                if failed is None:  # after a failure, follow rank 0 to its end (it fails at the same tensor)
                    try:
                        _merged(*entries[order[index]])
                    except Exception as error:  # noqa: BLE001 - raised below, once rank 0 has stopped asking
                        failed = error
            if failed is not None:
                raise failed
    return written


def _announce(index: int | None) -> int | None:
    """Rank 0 names the tensor every rank gathers next (``None``: done); a no-op in one process."""
    if not dist.is_initialized():
        return index
    box = [index]
    dist.broadcast_object_list(box, src=0)
    return box[0]
