"""What the package knows about model libraries, the lowest floor: every other room may ask it, it asks none of them.

* :mod:`lora`: peft's and litgpt's LoRA wrappers in a model, and the names its tensors have in the base checkpoint.
* :mod:`fused_rows`: the rows of a fused weight (litgpt's ``qkv``) that tensor parallelism regrouped, and the order
  checkpoints store them in.
* :mod:`experts`: mixture-of-experts layers (transformers' fused experts, litgpt's ``LLaMAMoE``) and the config names
  of their counts.
* :mod:`tied`: tied weights, by identity.
* :mod:`transformers`: the transformers ``PreTrainedModel`` inside a module.

Its modules import torch and the model libraries (only those already imported), and nothing of this package above
:mod:`fabric_hsdp.versions`, :mod:`fabric_hsdp.logs` and :mod:`fabric_hsdp.errors`.
"""
