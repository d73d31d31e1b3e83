"""LoRA models under the strategy: peft around transformers, litgpt's ``lora.GPT``.

A base checkpoint loads into them with ``fabric.load_raw`` by the base model's names (:mod:`.names`), their adapters
get their library's own init when made real from the meta device (:mod:`.init`), and the trained adapters export in
each library's own format (:mod:`.export`), or merged into the base (:mod:`.merge`):
``from fabric_hsdp.adapters import export_peft_adapter``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["adapter_keys", "base_names", "export_litgpt_adapter", "export_merged", "export_peft_adapter"]


def __getattr__(name: str) -> Any:
    # imported on first use: the checkpoint package imports .names, and .export imports the checkpoint package
    if name in ("export_litgpt_adapter", "export_peft_adapter"):
        from fabric_hsdp.adapters import export

        return getattr(export, name)
    if name == "export_merged":
        from fabric_hsdp.adapters import merge

        return merge.export_merged
    if name in ("adapter_keys", "base_names"):
        from fabric_hsdp.adapters import names

        return getattr(names, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
