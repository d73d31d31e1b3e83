"""The raw-vs-wrapped rule (see :mod:`fabric_hsdp.checkpoint.formats.detect`): which tensors of a loaded
checkpoint object are the model's, and what else it holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fabric_hsdp.errors import CheckpointError

MODEL_KEYS = ("model", "state_dict")


def _describe(value: Any) -> str:
    return f"a {type(value).__name__}"


def find_model_tensors(
    obj: Any, file_name: str, is_tensor: Callable[[Any], bool] = lambda v: isinstance(v, torch.Tensor)
) -> tuple[str | None, Mapping[str, Any], dict[str, Any]]:
    """Apply the raw-vs-wrapped rule (see :mod:`fabric_hsdp.checkpoint.formats.detect`) to a loaded checkpoint object.

    Returns:
        ``(model_key, model_tensors, extras)``; ``model_key`` is ``None`` for a raw state dict.

    Raises:
        CheckpointError: if ``obj`` is neither a raw state dict nor a wrapped checkpoint.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"'{file_name}' holds {_describe(obj)}, not a state dict (a dict of tensors) or a checkpoint"
        )
    if not obj:
        raise CheckpointError(f"'{file_name}' holds an empty dict: there are no tensors in it")
    top_tensors = [key for key, value in obj.items() if is_tensor(value)]
    if top_tensors:
        others = [key for key, value in obj.items() if not is_tensor(value)]
        if not others:
            return None, obj, {}
        raise CheckpointError(
            f"'{file_name}' mixes tensors (e.g. {top_tensors[0]!r}) and other values (e.g. {others[0]!r}:"
            f" {_describe(obj[others[0]])}) at the top level: it is neither a state dict nor a checkpoint with a"
            " 'model' entry"
        )
    for model_key in MODEL_KEYS:
        model = obj.get(model_key)
        if isinstance(model, Mapping):
            not_tensors = [key for key, value in model.items() if not is_tensor(value)]
            if not_tensors:
                bad = not_tensors[0]
                raise CheckpointError(
                    f"'{file_name}' has a {model_key!r} entry, but {model_key}[{bad!r}] is {_describe(model[bad])},"
                    f" not a tensor ({len(not_tensors)} such entries); expected a flat dict of tensors"
                )
            return model_key, model, {key: value for key, value in obj.items() if key != model_key}
    keys = ", ".join(repr(key) for key in list(obj)[:8])
    raise CheckpointError(
        f"'{file_name}' holds a dict without tensors at the top level and without a 'model' or 'state_dict' dict"
        f" of tensors (top-level keys: {keys}); cannot tell which tensors are the model's"
    )
