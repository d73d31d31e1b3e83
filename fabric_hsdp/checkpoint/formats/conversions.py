"""Checkpoints stored in another layout than the model's, converted lazily by the model family's own rules.

transformers 5 fuses each layer's experts into one parameter per projection (``mlp.experts.gate_up_proj`` of shape
``[experts, 2 * intermediate, hidden]``) while ``save_pretrained`` and the hub keep one tensor per expert
(``mlp.experts.3.gate_proj.weight``); transformers converts on load by its own rules
(``transformers.conversion_mapping``: ``WeightConverter`` with ``MergeModulelist``, ``Concatenate``, ...).

Here those rules run on *lazy expressions* instead of tensors: transformers' own ``WeightConverter.convert`` (and,
for exports, ``revert_weight_conversion``) is called with lazy expressions as leaves
(:mod:`fabric_hsdp.checkpoint.core.lazy_expression`), whose
``__torch_function__`` records ``torch.stack``/``cat``/``chunk``/``transpose`` instead of computing them. The result
says, for every model tensor, which boxes of which stored tensors it is made of, so a rank reads only the part its
shard holds: a ``Shard(0)`` of ``[experts, ...]`` is a range of experts, and a shard of ``gate_up_proj`` that cuts
through the concatenation reads the rows of ``gate_proj`` and ``up_proj`` it covers. An operation that cannot be
read lazily is refused with its name. :class:`ConvertedSource` presents the converted tensors as a
:class:`~fabric_hsdp.checkpoint.formats.source.CheckpointSource`, so matching, slicing and error messages stay those
of every other format.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fabric_hsdp.checkpoint.core.box import Box
from fabric_hsdp.checkpoint.core.lazy_expression import LazyExpression, StoredTensor
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.errors import CheckpointError
from fabric_hsdp.models.transformers import pretrained_model_of

_logger = logging.getLogger(__name__)

# transformers' conversion operations whose effect the expressions below reproduce without reading data
LAZY_OPERATIONS = ("MergeModulelist", "SplitModulelist", "Concatenate", "Chunk", "Transpose", "Force16BytesAlignment")


class ConvertedSource(CheckpointSource):
    """``base`` seen in the model's layout: every tensor is a :class:`LazyExpression` over ``base``'s tensors."""

    def __init__(self, base: CheckpointSource, expressions: dict[str, LazyExpression]) -> None:
        super().__init__(base.path, base.format)
        self.base, self.expressions = base, expressions
        for attribute in ("model_key",):  # what callers may ask of a wrapped checkpoint
            if hasattr(base, attribute):
                setattr(self, attribute, getattr(base, attribute))

    def keys(self) -> list[str]:
        return list(self.expressions)

    def _info(self, name: str) -> TensorInfo:
        expression = self.expressions[name]
        return TensorInfo(name, expression.shape, expression.dtype)

    def _read(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        expression = self.expressions[name]
        if isinstance(expression, StoredTensor):
            return self.base.read(expression.name, out=out)
        tensor = expression.read(expression.whole())
        return tensor if out is None else out.copy_(tensor)

    def _read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        expression = self.expressions[name]
        return expression.read(Box.of_index(index, expression.shape, name))

    def _lazy_extras(self) -> dict[str, Any]:
        return self.base.extras(lazy=True)

    def close(self) -> None:
        self.base.close()


def _refuse_operations(converter: Any, target: str) -> None:
    for operation in getattr(converter, "operations", ()):
        if type(operation).__name__ not in LAZY_OPERATIONS:
            raise CheckpointError(
                f"transformers converts the checkpoint's tensors for {target!r} with {type(operation).__name__},"
                f" which fabric-hsdp cannot apply lazily per shard (it applies {', '.join(LAZY_OPERATIONS)}). Load"
                " the model once with from_pretrained and save it with fabric.save, or save_pretrained it in the"
                " model's own layout."
            )


def _transformers_mapping(model: nn.Module) -> list[Any]:
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


def convert_for_model(source: CheckpointSource, module: nn.Module) -> CheckpointSource:
    """``source`` in ``module``'s layout when ``module``'s family converts checkpoints on load (transformers'
    conversion mapping), else ``source`` itself.

    Raises:
        CheckpointError: a tensor needs an operation that cannot be read lazily (the message names it).
    """
    model = pretrained_model_of(module)
    if model is None:
        return source
    mapping = _transformers_mapping(model)
    if not mapping:
        return source
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    model_keys = dict.fromkeys(model.state_dict(), True)  # transformers asks .get(name) is not None
    prefix = getattr(model, "base_model_prefix", None) or None
    expressions: dict[str, LazyExpression] = {}
    groups: dict[str, Any] = {}
    changed = False
    # as transformers' convert_and_load_state_dict_in_model groups them: in natural order (expert 10 after 9)
    for key in sorted(source.keys(), key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = key, None
        if renamed not in model_keys:  # not the model's: reported under the checkpoint's own name
            renamed, pattern = key, None
        if pattern is None:
            expressions[renamed] = StoredTensor(source, key)
            changed |= renamed != key
            continue
        converter = groups.setdefault(renamed, deepcopy(by_pattern[pattern]))
        converter.add_tensor(renamed, key, pattern, lambda key=key: StoredTensor(source, key))
        changed = True
    if not changed:
        return source
    for target, converter in groups.items():
        _refuse_operations(converter, target)
        converted = converter.convert(target, model=model, config=model.config)
        for name, expression in converted.items():
            expression = expression[0] if isinstance(expression, list) else expression
            if not isinstance(expression, LazyExpression):
                raise CheckpointError(f"transformers' conversion of {target!r} gave a {type(expression).__name__}")
            expressions[name] = expression
    _logger.debug("%s: %d tensors in the model's layout (%d converted)", source.path, len(expressions), len(groups))
    ordered = sorted(expressions, key=lambda name: tuple(dot_natural_key(name)))
    return ConvertedSource(source, {name: expressions[name] for name in ordered})


def hub_layout_tensors(
    source: CheckpointSource, names: dict[str, str], model_type: str, config: Any = None
) -> dict[str, LazyTensor]:
    """The tensors ``names`` (output name -> name in ``source``, in the model's layout, e.g. fused experts) in the
    hub's layout for a transformers ``model_type`` (one tensor per expert): transformers' own reverse conversion, each
    output tensor read lazily as the boxes of ``source``'s tensors it is made of.

    Without a conversion for ``model_type`` the tensors are returned as they are stored.
    """
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion

    mapping = get_checkpoint_conversion_mapping(model_type)
    lazy = source.lazy_tensors()
    if not mapping:
        return {new: lazy[old] for new, old in names.items()}
    for entry in mapping:
        _refuse_operations(entry, model_type)
    leaves = {new: StoredTensor(source, old) for new, old in names.items()}
    reverted = revert_weight_conversion(SimpleNamespace(config=config, _weight_conversions=mapping), leaves)
    out = {}
    for name, expression in reverted.items():
        if not isinstance(expression, LazyExpression):
            raise CheckpointError(f"transformers' reverse conversion of {name!r} gave a {type(expression).__name__}")
        if isinstance(expression, StoredTensor):  # the tensor as it is stored, maybe renamed
            stored = lazy[expression.name]
            out[name] = LazyTensor(name, stored.shape, stored.dtype, stored.read, lambda out, s=stored: s.read(out))
        else:
            out[name] = LazyTensor(name, expression.shape, expression.dtype, _reader(expression))
    return out


def _reader(expression: LazyExpression) -> Callable[[], torch.Tensor]:
    return lambda: expression.read(expression.whole()).contiguous()


def hub_layout_for_config(
    source: CheckpointSource, names: dict[str, str], config_path: Path | None
) -> dict[str, LazyTensor] | None:
    """:func:`hub_layout_tensors` for the ``model_type`` of a transformers ``config.json``; ``None`` without a config,
    a ``model_type``, transformers, or a conversion that changes any name (the tensors are then written as they are)."""
    if config_path is None:
        return None
    model_type = json.loads(Path(config_path).read_text()).get("model_type")
    if not model_type:
        return None
    try:
        import transformers.conversion_mapping  # noqa: F401
    except ImportError:
        return None
    tensors = hub_layout_tensors(source, names, model_type)
    if sorted(tensors) == sorted(names):
        return None
    _logger.info("writing %d model tensors as %d in the hub's layout for %s", len(names), len(tensors), model_type)
    return tensors
