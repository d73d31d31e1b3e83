"""Matching checkpoint tensor names to model tensor names, shared by the converter and the sharded loader.

A key map renames checkpoint keys before matching: ``None`` (no renaming), a callable ``str -> str | None``
(``None`` drops the key) or prefix rules ``{"transformer.": "model.", "lm_head.": None}`` (longest prefix wins;
``None`` drops). On the command line the rules are strings: ``"OLD=NEW"`` renames a prefix, ``"OLD="`` strips it,
``"!OLD"`` drops keys that start with it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fabric_hsdp.checkpoint.core import mismatch
from fabric_hsdp.checkpoint.core.mismatch import Configs

KeyMap = Callable[[str], str | None]
KeyMapSpec = KeyMap | Mapping[str, str | None] | str | Sequence[str] | None

# Prefixes added by wrappers (DDP/FSDP1 ``module.``, ``torch.compile`` ``_orig_mod.``, Lightning/Fabric ``model.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")
_SHOWN = 3  # how many offending keys a message names before counting the rest


def parse_key_map_rules(rules: str | Sequence[str]) -> dict[str, str | None]:
    """Parse CLI rules (``"OLD=NEW"``, ``"OLD="``, ``"!OLD"``; a string may hold several, comma-separated)."""
    items = rules.split(",") if isinstance(rules, str) else [part for rule in rules for part in rule.split(",")]
    parsed: dict[str, str | None] = {}
    for item in (item.strip() for item in items):
        if not item:
            continue
        if item.startswith("!"):
            parsed[item[1:]] = None
        elif "=" in item:
            old, new = item.split("=", 1)
            parsed[old] = new
        else:
            raise ValueError(
                f"key_map rule {item!r} is not 'OLD=NEW' (rename a prefix), 'OLD=' (strip it) or '!OLD' (drop keys)"
            )
    return parsed


def make_key_map(spec: KeyMapSpec) -> KeyMap:
    """Build the renaming function for ``spec`` (see module docstring); returns ``str -> str | None``."""
    if spec is None:
        return lambda key: key
    if isinstance(spec, str) or (isinstance(spec, Sequence) and all(isinstance(rule, str) for rule in spec)):
        spec = parse_key_map_rules(spec)
    if isinstance(spec, Mapping):
        rules = sorted(spec.items(), key=lambda rule: len(rule[0]), reverse=True)
        for old, new in rules:
            if not isinstance(old, str) or not (new is None or isinstance(new, str)):
                raise TypeError(f"key_map rules map a prefix to a new prefix or None, got {old!r}: {new!r}")

        def rename(key: str) -> str | None:
            for old, new in rules:
                if key.startswith(old):
                    return None if new is None else new + key[len(old) :]
            return key

        return rename
    if callable(spec):
        return spec
    raise TypeError(f"key_map must be None, a callable, a dict of prefix rules or rule strings, got {type(spec)}")


def strip_wrappers(key: str) -> str:
    """Remove leading wrapper prefixes (``module.``, ``_orig_mod.``, ``model.``), repeatedly."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix) and len(key) > len(prefix):
                key, changed = key[len(prefix) :], True
    return key


@dataclass
class KeyMatch:
    """Result of :func:`match_keys`.

    Attributes:
        mapping: model key -> checkpoint key, in model order.
        missing: model keys with no checkpoint tensor.
        unexpected: checkpoint keys no model key uses (keys the key map drops are not listed).
        dropped: checkpoint keys the key map dropped.
    """

    mapping: dict[str, str]
    missing: list[str]
    unexpected: list[str]
    dropped: list[str] = field(default_factory=list)


def apply_key_map(source_keys: Iterable[str], key_map: KeyMapSpec = None) -> tuple[dict[str, str], list[str]]:
    """Rename ``source_keys``; returns ``({new_name: source_key}, dropped)``.

    Raises:
        ValueError: if two checkpoint keys are renamed to the same name.
    """
    rename = make_key_map(key_map)
    renamed: dict[str, str] = {}
    dropped = []
    for key in source_keys:
        new = rename(key)
        if new is None:
            dropped.append(key)
        elif new in renamed:
            raise ValueError(f"key_map renames both {renamed[new]!r} and {key!r} to {new!r}")
        else:
            renamed[new] = key
    return renamed, dropped


def match_keys(
    source_keys: Iterable[str],
    model_keys: Iterable[str],
    key_map: KeyMapSpec = None,
    tied: Mapping[str, str] | None = None,
) -> KeyMatch:
    """Pair model keys with checkpoint keys.

    After ``key_map``, exact names match first. A model key still unmatched is paired with a checkpoint key when
    both are the same name once wrapper prefixes are stripped and no other key strips to that name on either side.
    With ``tied`` (:func:`fabric_hsdp.models.tied.tied_names`), a model key is not missing when another name of the
    same tensor is matched: loading that one fills both (checkpoints store a tied tensor once).
    """
    model_keys = list(model_keys)
    renamed, dropped = apply_key_map(source_keys, key_map)
    mapping = {key: renamed[key] for key in model_keys if key in renamed}
    used = set(mapping.values())
    left_model = [key for key in model_keys if key not in mapping]
    if left_model:
        by_name: dict[str, list[str]] = defaultdict(list)
        for new, source_key in renamed.items():
            if source_key not in used:
                by_name[strip_wrappers(new)].append(source_key)
        model_by_name: dict[str, list[str]] = defaultdict(list)
        for key in left_model:
            model_by_name[strip_wrappers(key)].append(key)
        for name, keys in model_by_name.items():
            if len(keys) == 1 and len(by_name.get(name, ())) == 1:
                mapping[keys[0]] = by_name[name][0]
    mapping = {key: mapping[key] for key in model_keys if key in mapping}
    used = set(mapping.values())
    tied = tied or {}
    loaded = {tied.get(key, key) for key in mapping}
    return KeyMatch(
        mapping=mapping,
        missing=[key for key in model_keys if key not in mapping and tied.get(key, key) not in loaded],
        unexpected=[source_key for source_key in renamed.values() if source_key not in used],
        dropped=dropped,
    )


def _shape_dtype(value: Any) -> tuple[list[int], torch.dtype | None]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype | None):
        return list(value[0]), value[1]
    return list(value.shape), getattr(value, "dtype", None)


def _spec(value: Any) -> str:
    shape, dtype = _shape_dtype(value)
    return f"{shape} {str(dtype).removeprefix('torch.')}" if dtype is not None else str(shape)


def shape_mismatches(
    match: KeyMatch, model_infos: Mapping[str, Any], source_infos: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """``(model_key, source_key)`` pairs whose shapes differ (``infos``: TensorInfo, tensor or (shape, dtype))."""
    return [
        (model_key, source_key)
        for model_key, source_key in match.mapping.items()
        if _shape_dtype(model_infos[model_key])[0] != _shape_dtype(source_infos[source_key])[0]
    ]


def _more(count: int, what: str) -> str:
    return f"; {count} more {what}" if count > 0 else ""


def suggest_prefix_rule(missing: Sequence[str], unexpected: Sequence[str]) -> dict[str, str] | None:
    """A prefix rule that renames unexpected checkpoint keys into missing model keys, if one fixes several."""
    missing_set, best, best_fixed = set(missing), None, 1
    for model_key in missing[:20]:
        for source_key in unexpected:
            model_parts, source_parts = model_key.split("."), source_key.split(".")
            common = 0
            while common < min(len(model_parts), len(source_parts)) and (
                model_parts[-1 - common] == source_parts[-1 - common]
            ):
                common += 1
            if common < 2 or common == len(model_parts) == len(source_parts):
                continue
            old = ".".join(source_parts[: len(source_parts) - common])
            new = ".".join(model_parts[: len(model_parts) - common])
            old, new = old + "." if old else "", new + "." if new else ""
            fixed = sum(1 for key in unexpected if key.startswith(old) and new + key[len(old) :] in missing_set)
            if fixed > best_fixed:
                best, best_fixed = {old: new}, fixed
    return best


def format_key_errors(
    match: KeyMatch,
    model_infos: Mapping[str, Any],
    source_infos: Mapping[str, Any],
    *,
    source_name: str,
    hint: str = "Pass strict=False to skip them, or key_map= to rename.",
    configs: Configs | None = None,
) -> str | None:
    """One message listing missing, unexpected and shape-mismatched tensors, or ``None`` if there are none.

    Args:
        match: the result of :func:`match_keys`.
        model_infos: model key -> TensorInfo, tensor or ``(shape, dtype)``.
        source_infos: checkpoint key -> TensorInfo, tensor or ``(shape, dtype)``.
        source_name: how to name the checkpoint, e.g. ``"lit-llama.pth"``.
        hint: what the caller can do; appended once, unless the reason is known (:func:`.mismatch.reason`:
            another project's names, another model, an adapter-only checkpoint, another config), which replaces it.
        configs: the model's and the checkpoint's configs, where known, to name the reason.
    """
    parts = []
    if match.missing:
        shown = ", ".join(f"{key!r} (model expects {_spec(model_infos[key])})" for key in match.missing[:_SHOWN])
        parts.append(
            f"checkpoint '{source_name}' has no tensor for {shown}{_more(len(match.missing) - _SHOWN, 'missing')}."
        )
    if match.unexpected:
        shown = ", ".join(f"{key!r} ({_spec(source_infos[key])})" for key in match.unexpected[:_SHOWN])
        count = len(match.unexpected)
        parts.append(
            f"checkpoint '{source_name}' has {count} tensor{'s' if count > 1 else ''} the model does not: {shown}"
            f"{_more(count - _SHOWN, 'unexpected')}."
        )
    mismatched = shape_mismatches(match, model_infos, source_infos)
    if mismatched:
        shown = ", ".join(
            f"{source_key!r} is {_spec(source_infos[source_key])} but the model expects "
            f"{_spec(model_infos[model_key])}" + (f" for {model_key!r}" if model_key != source_key else "")
            for model_key, source_key in mismatched[:_SHOWN]
        )
        parts.append(f"In '{source_name}', {shown}{_more(len(mismatched) - _SHOWN, 'shape mismatches')}.")
    if not parts:
        return None
    shapes = [
        (_shape_dtype(model_infos[model_key])[0], _shape_dtype(source_infos[source_key])[0])
        for model_key, source_key in mismatched
    ]
    why = mismatch.reason(match.missing, match.unexpected, shapes, configs)
    if why is not None:
        return " ".join([*parts, why])  # skipping or renaming would train from random weights
    rule = suggest_prefix_rule(match.missing, match.unexpected)
    if rule:
        hint = f"{hint} The names differ by a prefix: key_map={rule!r} would rename them."
    return " ".join([*parts, hint])
