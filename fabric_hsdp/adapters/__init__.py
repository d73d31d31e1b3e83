"""LoRA models under the strategy: peft around transformers, litgpt's ``lora.GPT``.

A base checkpoint loads into them with ``fabric.load_raw`` by the base model's names
(:mod:`fabric_hsdp.models.lora`), their adapters get their library's own init when made real from
the meta device (:mod:`.init`), and the trained adapters export in each library's own format (:mod:`.export`), or
merged into the base (:mod:`.merge`): ``from fabric_hsdp.adapters import export_peft_adapter``.
"""

from fabric_hsdp.adapters.export import export_litgpt_adapter, export_peft_adapter
from fabric_hsdp.adapters.merge import export_merged
from fabric_hsdp.models.lora import adapter_keys, base_names

__all__ = ["adapter_keys", "base_names", "export_litgpt_adapter", "export_merged", "export_peft_adapter"]
