"""The trained adapters of a sharded LoRA model, written in each library's own format: a peft adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``, written by peft's ``save_pretrained``, so
``PeftModel.from_pretrained`` loads it) and litgpt's adapter file (``lit_model.pth.lora``: ``{"model": {name: tensor}}``
as litgpt's ``finetune/lora.py`` writes it, for its ``merge_lora``).

Call on every rank: each adapter tensor is gathered whole (a collective), rank 0 keeps it in CPU memory and writes.
Adapters are small (the base is never gathered).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core.commit import atomic_output
from fabric_hsdp.models.lora import adapter_keys, user_module


def gathered_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor of ``model`` whole, on CPU, by state-dict key, on rank 0 (empty elsewhere).

    Raises:
        ValueError: ``model`` has no LoRA layer (peft's or litgpt's).
    """
    from torch.distributed.tensor import DTensor

    model = user_module(model)
    keys = set(adapter_keys(model))
    if not keys:
        raise ValueError(
            f"{type(model).__name__} holds no LoRA layer (peft's get_peft_model or litgpt's lora.GPT): there are no"
            " adapters to export. Save the whole model with fabric.save or strategy.save_full_checkpoint."
        )
    adapters = {}
    with torch.no_grad():  # tensor parallelism (regrouped rows) is refused for LoRA models at setup
        for key, tensor in model.state_dict().items():
            if key not in keys:
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if _is_rank_zero():
                adapters[key] = full.detach().cpu().clone()
    return adapters


def export_peft_adapter(model: nn.Module, directory: str | Path, overwrite: bool = True) -> Path | None:
    """Write ``model``'s (a peft ``PeftModel`` set up by the strategy) adapters as a peft adapter directory, with
    peft's own ``save_pretrained``: ``PeftModel.from_pretrained(base_model, directory)`` loads it anywhere.

    Call on every rank; rank 0 writes, and the directory appears whole (written aside, then renamed). Returns the
    directory on rank 0, ``None`` elsewhere.
    """
    module = user_module(model)
    if not callable(getattr(module, "save_pretrained", None)) or not hasattr(module, "peft_config"):
        raise TypeError(
            f"export_peft_adapter takes a peft PeftModel (get_peft_model(...)), got {type(module).__name__}; for"
            " litgpt's lora.GPT use export_litgpt_adapter."
        )
    adapters = gathered_adapters(module)
    written = None
    with fail_together(f"exporting the peft adapter to '{directory}'"):
        if _is_rank_zero():
            with atomic_output(Path(directory), overwrite=overwrite) as output:
                # peft's own writer: keys as peft names them (the adapter name dropped), its config beside them
                module.save_pretrained(str(output), state_dict=adapters)
            written = Path(directory)
    return written


def export_litgpt_adapter(model: nn.Module, path: str | Path, overwrite: bool = True) -> Path | None:
    """Write ``model``'s (litgpt's ``lora.GPT`` set up by the strategy) adapters as litgpt's fine-tune does
    (``torch.save({"model": {name: tensor}}, "lit_model.pth.lora")``), for litgpt's ``merge_lora``.

    Call on every rank; rank 0 writes, atomically. Returns the path on rank 0, ``None`` elsewhere.
    """
    adapters = gathered_adapters(model)
    written = None
    with fail_together(f"exporting the litgpt adapter to '{path}'"):
        if _is_rank_zero():
            with atomic_output(Path(path), overwrite=overwrite) as output:
                torch.save({"model": adapters}, output)
            written = Path(path)
    return written


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
