"""An exported Hugging Face directory's ``config.json`` must describe the tensors written beside it.

``from_pretrained`` builds the model of the config and fills what matches: with another model's config (an OLMoE
checkpoint exported with Mistral's) it only warns that some weights were "newly initialized", and the export looks
fine until its outputs are wrong. So a conversion builds the config's model on the meta device (no memory), reads
the tensors in that model's layout (transformers' own conversion rules, as a raw load does) and refuses a config that
does not fit, naming what differs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from fabric_hsdp.checkpoint.core.keys import format_key_errors, match_keys
from fabric_hsdp.checkpoint.core.lazy_expression import StoredTensor
from fabric_hsdp.checkpoint.core.mismatch import Configs
from fabric_hsdp.checkpoint.formats.conversions import ConvertedSource, convert_for_model
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.errors import CheckpointError
from fabric_hsdp.models.tied import tied_names

_logger = logging.getLogger(__name__)
# transformers' fused experts, as its models hold them in memory (the hub keeps one tensor per expert)
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def model_of_config(config_path: Path) -> nn.Module | None:
    """The transformers model ``config_path`` describes, on the meta device; ``None`` (logged) when transformers
    cannot build it (no ``model_type`` it knows, custom code)."""
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        values = json.loads(config_path.read_text())
        config = AutoConfig.for_model(**values)
        architecture = getattr(transformers, (values.get("architectures") or [""])[0], None)
        with torch.device("meta"):
            if isinstance(architecture, type) and issubclass(architecture, transformers.PreTrainedModel):
                return architecture(config)
            return AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 - any reason it cannot be built: not checked, and said so
        _logger.info(
            "not checking '%s' against the tensors: transformers cannot build its model (%s)", config_path, error
        )
        return None


def refuse_config_that_does_not_fit(source: CheckpointSource, names: dict[str, str], config_path: Path) -> None:
    """Raise ``CheckpointError`` when the model of ``config_path`` does not have exactly the tensors ``names``
    (output name -> name in ``source``) with their shapes, in the model's layout.

    A tied tensor (``tie_word_embeddings``) may be written once; the model's others must all be there.
    """
    model = model_of_config(config_path)
    if model is None:
        return
    renamed = ConvertedSource(source, {new: StoredTensor(source, old) for new, old in names.items()})
    converted = convert_for_model(renamed, model)
    targets = model.state_dict()
    match = match_keys(converted.keys(), targets, tied=tied_names(model))
    model_infos = {name: TensorInfo(name, tensor.shape, tensor.dtype) for name, tensor in targets.items()}
    source_infos = {key: converted.tensor_info(key) for key in converted.keys()}  # noqa: SIM118 - a source, not a dict
    message = format_key_errors(
        match,
        model_infos,
        source_infos,
        source_name=str(source.path),
        hint="",
        configs=Configs(model=model.config.to_dict()),
    )
    if message is not None:
        model_type = model.config.model_type
        raise CheckpointError(
            f"config '{config_path}' (model_type {model_type!r}, {type(model).__name__}) does not describe the"
            f" checkpoint's tensors, so from_pretrained would leave weights at random init: {message.strip()} Pass"
            " hf_config= (CLI: --hf_config) the config.json of the model the checkpoint was saved from."
        )


def fused_experts(names: list[str]) -> list[str]:
    """The names among ``names`` of transformers' fused experts (its in-memory layout, not the hub's)."""
    return [name for name in names if name.endswith(FUSED_EXPERTS)]
