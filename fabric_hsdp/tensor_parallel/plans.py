"""``tensor_parallel_plan="auto"``: the plan for the model families this package knows.

* transformers models carry their plan: ``config.base_model_tp_plan`` (under the base model's prefix, e.g.
  ``model.``) and the model's ``_tp_plan`` (``lm_head``). Attention infers its local head count from the projection
  output (``view(..., -1, head_dim)``), so nothing else changes.
* litgpt's ``GPT``: the fused ``attn.qkv`` is split head by head (:class:`FusedColwise` with the Q, K and V blocks),
  ``attn.proj`` and ``mlp.proj`` row-wise, ``mlp.fc_1``/``fc_2`` (or ``mlp.fc``) column-wise, ``lm_head`` column-wise
  with gathered logits, ``transformer.wte`` row-wise. Its attention reads the head counts from its config, so each
  attention module gets a copy of the config with the local counts.
* Any other model with a ``_tp_plan`` attribute in transformers' form, like ``examples/tiny_llama.Llama``.

Besides the styles, a plan names the head counts that must divide by the tensor-parallel size: a projection whose
rows divide but whose heads do not (3 heads of 16 over 2 ranks) would split a head.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.models.experts import refuse_tensor_parallel
from fabric_hsdp.tensor_parallel.styles import FusedColwise

_logger = logging.getLogger(__name__)

DICT_FORM = (
    'tensor_parallel_plan={"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise",'
    ' "output": "colwise_gather_output", ...} (module-name patterns with * -> a torch ParallelStyle or one of'
    " transformers' style names), or a callable (model, tensor_mesh) -> None"
)


@dataclass
class ModelPlan:
    """A model's tensor-parallel plan: styles by module-name pattern, and the head counts it splits."""

    styles: dict[str, Any]
    heads: dict[str, int] = field(default_factory=dict)  # "config.n_head" -> 4
    local_head_counts: Any = None  # (model, tensor_parallel_size) -> None, for models that read counts from config
    # under sequence parallelism, the embedding itself ends in Shard(1) (else the first layer splits its input)
    split_embedding_output: bool = True


def auto_plan(model: nn.Module) -> ModelPlan:
    """The plan for ``model``'s family (see module docstring).

    Raises:
        ValueError: ``model`` is of no family this package knows; the message shows the dict form.
    """
    refuse_tensor_parallel(model)
    if _is_litgpt_gpt(model):
        return _litgpt_plan(model)
    if _hf_plan_entries(model):
        return _hf_plan(model)
    plan = getattr(model, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return ModelPlan(styles=dict(plan), heads=_config_heads(getattr(model, "config", None)))
    raise ValueError(
        f'tensor_parallel_plan="auto" knows no plan for {type(model).__name__} (it covers transformers models with'
        " a tp plan, litgpt's GPT and models with a `_tp_plan` attribute). Pass the plan yourself: " + DICT_FORM + "."
    )


def _config_heads(config: Any) -> dict[str, int]:
    names = ("num_attention_heads", "num_key_value_heads", "n_head", "n_query_groups", "n_heads", "n_kv_heads")
    return {f"config.{name}": getattr(config, name) for name in names if isinstance(getattr(config, name, None), int)}


def _hf_plan_entries(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    entries: dict[str, Any] = {}
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for pattern, style in base.items():
        entries[f"{prefix}.{pattern}" if has_base else pattern] = style
    for plan in (getattr(type(model), "_tp_plan", None), getattr(model, "_tp_plan", None)):
        entries.update(plan or {})
    return entries if base else {}


def _hf_plan(model: nn.Module) -> ModelPlan:
    styles = _hf_plan_entries(model)
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None and embedding is not None and output.weight is embedding.weight:
        # a tied head splits the shared [vocab, dim] weight by rows: the embedding must split the same rows
        names = {id(module): name for name, module in model.named_modules()}
        if any(pattern.split(".")[-1] == names.get(id(output), "").split(".")[-1] for pattern in styles):
            styles.setdefault(names[id(embedding)], "embedding_rowwise")
            info_on_rank_zero(
                _logger,
                "tensor parallel: the output head shares %s's weight: both split by vocabulary rows",
                names[id(embedding)],
            )
    # transformers computes positions and masks from the embedding's output: under sequence parallelism it stays
    # whole and the first layer splits it
    return ModelPlan(styles=styles, heads=_config_heads(model.config), split_embedding_output=False)


def _is_litgpt_gpt(model: nn.Module) -> bool:
    return type(model).__name__ == "GPT" and type(model).__module__.startswith("litgpt")


def _litgpt_plan(model: nn.Module) -> ModelPlan:
    config = model.config
    if getattr(config, "norm_qk", False) and getattr(config, "norm_qk_type", "default") == "olmo2":
        raise ValueError(
            "litgpt models with norm_qk_type='olmo2' normalise over all heads at once, which tensor parallelism"
            f" would split; pass your own plan: {DICT_FORM}."
        )
    mlp = type(model.transformer.h[0].mlp).__name__
    if mlp in ("LLaMAMLP", "GemmaMLP"):
        mlp_styles = {"mlp.fc_1": ColwiseParallel(), "mlp.fc_2": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    elif mlp == "GptNeoxMLP":
        mlp_styles = {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    else:
        raise ValueError(
            f'tensor_parallel_plan="auto" has no plan for litgpt\'s {mlp} (it covers LLaMAMLP, GemmaMLP and'
            f" GptNeoxMLP); pass your own plan: {DICT_FORM}."
        )
    head_size, heads, groups = config.head_size, config.n_head, config.n_query_groups
    qkv = FusedColwise(
        blocks=(heads * head_size, groups * head_size, groups * head_size),
        block_names=("query heads", "key groups", "value groups"),
        block_heads=(heads, groups, groups),
    )
    styles: dict[str, Any] = {"transformer.h.*.attn.qkv": qkv, "transformer.h.*.attn.proj": RowwiseParallel()}
    styles.update({f"transformer.h.*.{name}": style for name, style in mlp_styles.items()})
    if model.lm_head.weight is model.transformer.wte.weight:
        info_on_rank_zero(_logger, "tensor parallel: lm_head shares transformer.wte's weight: both split by rows")
    styles["transformer.wte"] = RowwiseParallel(input_layouts=Replicate())
    styles["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return ModelPlan(
        styles=styles,
        heads={"config.n_head": heads, "config.n_query_groups": groups},
        local_head_counts=_litgpt_local_heads,
    )


def _litgpt_local_heads(model: nn.Module, tensor_parallel_size: int) -> None:
    """litgpt's attention views q/k/v with ``config.n_head``/``n_query_groups``: give it the local counts."""
    local = copy.copy(model.config)
    local.n_head = model.config.n_head // tensor_parallel_size
    local.n_query_groups = model.config.n_query_groups // tensor_parallel_size
    for block in model.transformer.h:
        block.attn.config = local
