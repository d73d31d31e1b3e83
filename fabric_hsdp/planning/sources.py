"""Where a model's shapes come from: a transformers config, a litgpt config, or a checkpoint's header.

``load_model_shape(source)`` tries, in this order:

1. A directory with ``config.json``, or a ``config.json`` file: a transformers config. With transformers installed,
   the model is built on the meta device (exact shapes, any architecture it knows, nothing allocated). Without it,
   Llama-family configs (``llama``, ``mistral``, ``qwen2``) are read by a built-in reader that writes the same
   parameter names and shapes; other model types need transformers, or the checkpoint next to the config.
2. A directory with ``model_config.yaml``, or a ``.yaml`` file: a litgpt config (needs litgpt), built on meta.
3. Any checkpoint ``open_checkpoint`` reads (torch file, safetensors, Hugging Face or DCP directory): names and
   shapes from its header; no tensor data is read. Dims come from the shapes (heads unknown).
4. A name that is not a path: a litgpt config name (``Llama-2-7b-hf``), which needs litgpt.

The built-in reader exists because transformers and litgpt are not dependencies of fabric-hsdp (only of its tests),
and planning a Llama-family model should not need either.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fabric_hsdp.planning.model import ModelShape, model_shape, model_shape_of_module, tensor_parallel_dim

_BUILT_IN_TYPES = ("llama", "mistral", "qwen2")
# defaults of transformers' config classes for the keys the built-in reader uses
_TIED_DEFAULT = {"llama": False, "mistral": False, "qwen2": False}
_SKIP_SUFFIXES = ("inv_freq", ".cos", ".sin", "mask_cache", "masked_bias")


def load_model_shape(source: str | os.PathLike) -> ModelShape:
    """The shapes of the model at (or named by) ``source``; see the module docstring for what is tried.

    Raises:
        FileNotFoundError: ``source`` looks like a path that does not exist.
        ValueError: Nothing could read ``source``; the message names every reader tried and why it did not apply.
        ImportError: The source needs transformers or litgpt, which is not installed (the message says which).
    """
    path = Path(source)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _from_transformers_config(path / "config.json")
        if (path / "model_config.yaml").is_file():
            return _from_litgpt(path / "model_config.yaml")
        return _from_checkpoint(path, tried=["config.json (none)", "model_config.yaml (none)"])
    if path.is_file():
        if path.suffix in (".yaml", ".yml"):
            return _from_litgpt(path)
        if path.suffix == ".json":
            return _from_transformers_config(path)
        return _from_checkpoint(path, tried=[])
    if os.sep in str(source) or path.suffix:
        raise FileNotFoundError(f"model source '{source}' does not exist (no such file or directory).")
    return _from_litgpt_name(str(source))


def _from_transformers_config(config_file: Path) -> ModelShape:
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"'{config_file}' is not a JSON config: {error}") from error
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"'{config_file}' has no 'model_type': it is not a transformers config.json.")
    model_type = config["model_type"]
    if _installed("transformers"):
        return _built_with_transformers(config_file)
    if model_type in _BUILT_IN_TYPES:
        names = list(_llama_family_shapes(config))
        return model_shape(names, f"{model_type} from {config_file}", config, _llama_family_plan(names, config))
    weights = config_file.parent
    tried = [f"transformers (not installed; needed for model_type '{model_type}')"]
    tried.append(f"the built-in reader (only {', '.join(_BUILT_IN_TYPES)})")
    try:
        return _from_checkpoint(weights, tried=tried)
    except ValueError as error:
        raise ImportError(
            f"{error} Install transformers (pip install transformers) to plan from '{config_file}'."
        ) from error


def _built_with_transformers(config_file: Path) -> ModelShape:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_file.parent) if config_file.name == "config.json" else config_file)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM (e.g. an encoder): the bare model
            model = AutoModel.from_config(config)
    return model_shape_of_module(model, f"{type(model).__name__} from {config_file}")


def _from_litgpt(config_file: Path) -> ModelShape:
    _require("litgpt", f"'{config_file}' is a litgpt config")
    from litgpt import Config

    return _built_with_litgpt(Config.from_file(config_file), f"litgpt {config_file}")


def _from_litgpt_name(name: str) -> ModelShape:
    tried = [f"a file or directory '{name}' (none)"]
    if not _installed("litgpt"):
        raise ImportError(
            f"cannot read model source '{name}': tried {tried[0]}; as a litgpt config name it needs litgpt, which is"
            " not installed (pip install litgpt). Or pass a config.json, a model_config.yaml or a checkpoint."
        )
    from litgpt import Config

    try:
        config = Config.from_name(name)
    except ValueError as error:
        raise ValueError(
            f"cannot read model source '{name}': tried {tried[0]} and a litgpt config name ({error}). Pass a"
            " transformers config.json (or its directory), a litgpt model_config.yaml or name, or a checkpoint."
        ) from error
    return _built_with_litgpt(config, f"litgpt {name}")


def _built_with_litgpt(config: Any, description: str) -> ModelShape:
    import torch
    from litgpt.model import GPT

    with torch.device("meta"):
        model = GPT(config)
    return model_shape_of_module(model, description)


def _from_checkpoint(path: Path, tried: list[str]) -> ModelShape:
    from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
    from fabric_hsdp.checkpoint.formats.source import ACCEPTED_FORMATS

    try:
        source = open_checkpoint(path)
    except (ValueError, FileNotFoundError, OSError) as error:
        tried = [*tried, f"a checkpoint ({error})"]
        raise ValueError(
            f"cannot read model source '{path}': tried {'; '.join(tried)}. Pass a transformers config.json (or its"
            f" directory), a litgpt model_config.yaml or config name, or a checkpoint: {ACCEPTED_FORMATS}."
        ) from error
    with source:
        named = []
        for name in source:
            info = source.tensor_info(name)
            if info.dtype.is_floating_point and not name.endswith(_SKIP_SUFFIXES):
                named.append((name, tuple(info.shape)))
        config = _config_next_to(path)
        return model_shape(named, f"{source.format} checkpoint {path}", config)


def _config_next_to(path: Path) -> dict[str, Any] | None:
    directory = path if path.is_dir() else path.parent
    for name in ("config.json", "model_config.json"):
        candidate = directory / name
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                return None
    return None


def _llama_family_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of transformers' ``LlamaForCausalLM`` (and Mistral, Qwen2) from ``config.json``."""
    model_type = config["model_type"]
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention_bias = bool(config.get("attention_bias", model_type == "qwen2"))
    mlp_bias = bool(config.get("mlp_bias", False))
    yield "model.embed_tokens.weight", (vocab, hidden)
    for index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{index}"
        for name, rows in (
            ("q_proj", heads * head_dim),
            ("k_proj", kv_heads * head_dim),
            ("v_proj", kv_heads * head_dim),
        ):
            yield f"{prefix}.self_attn.{name}.weight", (rows, hidden)
            if attention_bias:
                yield f"{prefix}.self_attn.{name}.bias", (rows,)
        yield f"{prefix}.self_attn.o_proj.weight", (hidden, heads * head_dim)
        if attention_bias and model_type != "qwen2":
            yield f"{prefix}.self_attn.o_proj.bias", (hidden,)
        for name, shape in (
            ("gate_proj", (inner, hidden)),
            ("up_proj", (inner, hidden)),
            ("down_proj", (hidden, inner)),
        ):
            yield f"{prefix}.mlp.{name}.weight", shape
            if mlp_bias:
                yield f"{prefix}.mlp.{name}.bias", (shape[0],)
        yield f"{prefix}.input_layernorm.weight", (hidden,)
        yield f"{prefix}.post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    if not config.get("tie_word_embeddings", _TIED_DEFAULT[model_type]):
        yield "lm_head.weight", (vocab, hidden)


def _llama_family_plan(
    names: list[tuple[str, tuple[int, ...]]], config: dict[str, Any]
) -> tuple[dict[str, int | None], dict[str, int]]:
    """What transformers' tp plan for these models splits: the attention and MLP projections, the output head (not
    the embedding), and the head counts that must divide."""
    split = {name: tensor_parallel_dim(name, len(shape)) for name, shape in names}
    split["model.embed_tokens.weight"] = None
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    return split, {"config.num_attention_heads": heads, "config.num_key_value_heads": kv_heads}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _require(module: str, why: str) -> None:
    if not _installed(module):
        raise ImportError(f"{why}, which needs {module}; it is not installed (pip install {module}).")
