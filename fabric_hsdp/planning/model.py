"""What the planner knows about a model: its parameters' shapes, which FSDP unit holds each, and the transformer dims.

The same description comes from a model object (the strategy's ``shard_size="auto"``, usually on the meta device),
from a config (built on the meta device by transformers or litgpt), or from a checkpoint's header. FSDP units follow
the strategy's default: every layer of an ``nn.ModuleList`` is one unit (the name's first numbered component, e.g.
``model.layers.3``), everything else belongs to the root unit.

Tensor parallelism: for a model object, the split dims come from the plan the strategy would apply
(:mod:`~fabric_hsdp.planning.tensor_plan`). For shapes without a model (a checkpoint), they are guessed by name
after the Megatron plan: the attention and MLP input projections split by output rows (column-wise), their output
projections by input columns (row-wise), the token embedding and the output head by vocabulary rows; norms (and
row-wise biases) replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fabric_hsdp.models.experts import EXPERTS_NAMES, TOP_K_NAMES, active_parameters

_UNIT = re.compile(r"^(.*?\.\d+)\.")
# module names (the component before ".weight"/".bias") -> how tensor parallelism splits them
_COLUMN_WISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv", "w1", "w3", "qkv", "fc_1"}
_COLUMN_WISE |= {"fc_2", "lm_head", "output"}
_ROW_WISE = {"o_proj", "down_proj", "wo", "w2", "proj"}
_EMBEDDING = {"embed_tokens", "tok_embeddings", "wte"}
# config attribute names of transformers, litgpt and this repository's examples, in that order
_CONFIG_NAMES = {
    "hidden_size": ("hidden_size", "n_embd", "dim", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "n_heads"),
    "num_kv_heads": ("num_key_value_heads", "n_query_groups", "n_kv_heads"),
    "head_dim": ("head_dim", "head_size"),
    "intermediate_size": ("intermediate_size", "hidden_dim", "ffn_dim", "n_inner"),
    "vocab_size": ("padded_vocab_size", "vocab_size"),
    "num_experts": EXPERTS_NAMES,
    "experts_per_token": TOP_K_NAMES,
    # an expert's MLP width: Qwen3-MoE's and litgpt's own name; Mixtral's experts use intermediate_size
    "expert_intermediate_size": ("moe_intermediate_size",),
}


def tensor_parallel_dim(name: str, ndim: int) -> int | None:
    """The dim tensor parallelism splits in parameter ``name``; ``None``: replicated over the tensor-parallel group."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, leaf = parts[-2], parts[-1]
    if module in _COLUMN_WISE or module in _EMBEDDING:
        return 0
    if module in _ROW_WISE and leaf == "weight" and ndim == 2:
        return 1
    return None


@dataclass(frozen=True)
class ParameterShape:
    """One parameter: its name, its full shape, the FSDP unit it belongs to ('' = root), its TP split dim and whether
    it trains."""

    name: str
    shape: tuple[int, ...]
    unit: str
    tensor_parallel_dim: int | None
    trainable: bool = True  # False: frozen (a LoRA model's base): no gradient, no optimizer state

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TransformerDims:
    """The sizes the activation and tensor-parallel estimates need. Heads are ``None`` when unknown."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    # mixture of experts: experts per MoE layer, the top-k each token is routed to, an expert's MLP width, and how
    # many of the layers have experts (Qwen3-MoE's mlp_only_layers keep a dense MLP); None for a dense model
    num_experts: int | None = None
    experts_per_token: int | None = None
    expert_intermediate_size: int | None = None
    expert_layers: int | None = None

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection; the hidden size when the heads are unknown (an upper bound)."""
        if self.num_kv_heads and self.head_dim:
            return self.num_kv_heads * self.head_dim
        return self.hidden_size


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it: parameter shapes grouped into FSDP units, plus its transformer dims."""

    description: str
    parameters: tuple[ParameterShape, ...]
    dims: TransformerDims
    # head counts tensor parallelism must divide (its plan's, else the config's), and where the split dims came from
    tensor_parallel_heads: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    tensor_parallel_source: str = "guessed from parameter names"
    active_parameters: int | None = field(default=None, compare=False)  # per token, for mixture-of-experts models
    adapters: str | None = None  # LoRA adapters added by the planner (planning/lora.py), e.g. "LoRA r=16 on ..."
    # what the planner derives from the shapes, per layout (many layouts share them; layers repeat)
    cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @property
    def num_parameters(self) -> int:
        return sum(parameter.numel for parameter in self.parameters)

    def units(self) -> dict[str, list[ParameterShape]]:
        """Parameters by FSDP unit, the root unit ('') first."""
        if "units" not in self.cache:
            units: dict[str, list[ParameterShape]] = {"": []}
            for parameter in self.parameters:
                units.setdefault(parameter.unit, []).append(parameter)
            self.cache["units"] = units
        return self.cache["units"]

    def tensor_parallel_problem(self, tensor_parallel_size: int) -> str | None:
        """Why the model cannot be split ``tensor_parallel_size`` ways (None if it can)."""
        if tensor_parallel_size == 1:
            return None
        if self.adapters:  # as the strategy refuses them (adapters/init.py)
            return (
                f"tensor_parallel_size({tensor_parallel_size}): HybridFSDPStrategy does not support LoRA models under"
                f" tensor parallelism yet ({self.adapters}); FSDP/HSDP shards the base and the adapters"
            )
        if self.dims.num_experts:  # the strategy refuses "auto"; how a plan of your own splits experts is unknown
            return (
                f"tensor_parallel_size({tensor_parallel_size}): tensor_parallel_plan='auto' has no plan for"
                f" mixture-of-experts layers ({self.dims.num_experts} experts in {self.dims.expert_layers} layers);"
                " their experts are sharded by FSDP over the shard dim"
            )
        for what, count in self.tensor_parallel_heads.items():
            if count % tensor_parallel_size:
                return f"tensor_parallel_size({tensor_parallel_size}) does not divide {what}({count})"
        for parameter in self.parameters:
            dim = parameter.tensor_parallel_dim
            if dim is not None and parameter.shape[dim] % tensor_parallel_size:
                return (
                    f"tensor_parallel_size({tensor_parallel_size}) does not divide dim {dim} of"
                    f" '{parameter.name}' {list(parameter.shape)}"
                )
        return None

    def summary(self) -> str:
        """One line: parameter count and dims."""
        dims = self.dims
        heads = "" if dims.num_heads is None else f", {dims.num_heads} heads ({dims.num_kv_heads} key/value)"
        trainable = sum(parameter.numel for parameter in self.parameters if parameter.trainable)
        frozen = "" if trainable == self.num_parameters else f", {_count(trainable)} trainable"
        return (
            f"{self.description}: {_count(self.num_parameters)} parameters{self._active()}{frozen} ({dims.num_layers}"
            f" layers, hidden {dims.hidden_size}{heads}, {self._mlp()}, vocabulary {dims.vocab_size})"
        )

    def _mlp(self) -> str:
        dims = self.dims
        if not dims.num_experts:
            return f"intermediate {dims.intermediate_size}"
        return (
            f"{dims.expert_layers} MoE layers of {dims.num_experts} experts, top-{dims.experts_per_token},"
            f" expert intermediate {dims.expert_intermediate_size}"
        )

    def _active(self) -> str:
        return "" if self.active_parameters is None else f", {_count(self.active_parameters)} active per token"


def _count(number: int) -> str:
    return f"{number / 1e9:.2f} B" if number >= 1e9 else f"{number / 1e6:.2f} M"


def is_token_embedding(name: str) -> bool:
    """Whether ``name`` is a token embedding's parameter (litgpt's ``wte``, transformers' ``embed_tokens``, ...)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("embed_tokens", "tok_embeddings", "wte", "embeddings", "embed")


def model_shape(
    named_shapes: Iterable[tuple[str, Iterable[int]]],
    description: str,
    config: Any = None,
    tensor_parallel_plan: tuple[dict[str, int | None], dict[str, int]] | None = None,
    frozen: Iterable[str] = (),
) -> ModelShape:
    """Describe a model from its parameters' names and shapes, and optionally its config and tensor-parallel plan.

    Args:
        named_shapes: ``(name, shape)`` of every parameter (no buffers).
        description: What the model is and where it came from, for messages.
        config: An object or mapping with transformers', litgpt's or the examples' attribute names
            (``hidden_size``/``n_embd``/``dim``, ...). Dims it lacks are inferred from the shapes.
        tensor_parallel_plan: ``(split dim per parameter name, head counts)`` from the plan the strategy would apply
            (``tensor_plan.plan_split_dims``); None: guess the split dims by name, take the heads from the dims.
        frozen: Names of the parameters that do not train (``requires_grad=False``: a LoRA model's base).
    """
    split_dims, plan_heads = tensor_parallel_plan if tensor_parallel_plan is not None else ({}, None)
    frozen = set(frozen)
    parameters = []
    for name, shape in named_shapes:
        shape = tuple(int(size) for size in shape)
        match = _UNIT.match(name)
        split = split_dims.get(name) if tensor_parallel_plan is not None else tensor_parallel_dim(name, len(shape))
        parameters.append(ParameterShape(name, shape, match.group(1) if match else "", split, name not in frozen))
    if not parameters:
        raise ValueError(f"{description} has no parameters to plan for.")
    inferred = _infer_dims(parameters)
    known = {key: value for key, value in _config_dims(config).items() if value}
    dims = replace(inferred, **known)
    if dims.head_dim is None and dims.num_heads:
        dims = replace(dims, head_dim=dims.hidden_size // dims.num_heads)
    if dims.num_kv_heads is None and dims.num_heads:
        dims = replace(dims, num_kv_heads=dims.num_heads)
    dims = _expert_dims(dims, parameters)
    active = active_parameters([(p.name, p.shape) for p in parameters], config)
    if plan_heads is not None:
        return ModelShape(description, tuple(parameters), dims, plan_heads, "the model's tensor-parallel plan", active)
    heads = {"num_attention_heads": dims.num_heads, "num_key_value_heads": dims.num_kv_heads}
    return ModelShape(
        description, tuple(parameters), dims, {k: v for k, v in heads.items() if v}, active_parameters=active
    )


def model_shape_of_module(
    module: Any, description: str | None = None, tensor_parallel_plan: Any = "auto"
) -> ModelShape:
    """Describe an ``nn.Module`` (real or on the meta device) from its parameters and its ``config`` attribute.

    Args:
        tensor_parallel_plan: The strategy's ``tensor_parallel_plan`` (``"auto"``, a dict, or a callable); the split
            dims come from it when it is not a callable and ``"auto"`` knows the model, else from the names.
    """
    from fabric_hsdp.planning.tensor_plan import plan_split_dims

    named = [(name, tuple(parameter.shape)) for name, parameter in module.named_parameters()]
    frozen = [name for name, parameter in module.named_parameters() if not parameter.requires_grad]
    plan = plan_split_dims(module, tensor_parallel_plan)
    return model_shape(named, description or type(module).__name__, getattr(module, "config", None), plan, frozen)


def _config_dims(config: Any) -> dict[str, int]:
    if config is None:
        return {}
    found = {}
    for key, names in _CONFIG_NAMES.items():
        for name in names:
            value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found[key] = value
                break
    return found


def _expert_dims(dims: TransformerDims, parameters: list[ParameterShape]) -> TransformerDims:
    """A model with routed experts (its config names experts and a top-k, its layers hold ``.experts.``
    parameters): the layers that hold them, and the expert width (Mixtral's config calls it intermediate_size)."""
    expert_layers = len({p.unit for p in parameters if ".experts." in p.name})
    if not (dims.num_experts and dims.experts_per_token and expert_layers):
        return replace(dims, num_experts=None, experts_per_token=None, expert_intermediate_size=None)
    width = dims.expert_intermediate_size or dims.intermediate_size
    return replace(dims, expert_intermediate_size=width, expert_layers=expert_layers)


def _infer_dims(parameters: list[ParameterShape]) -> TransformerDims:
    """Dims from shapes alone: the largest root matrix is the embedding (vocab x hidden); the MLP's down projection
    (hidden x intermediate) gives the intermediate size. Heads stay unknown."""
    matrices = [p for p in parameters if len(p.shape) == 2]
    root_matrices = [p for p in matrices if not p.unit] or matrices
    layers = sorted({p.unit for p in parameters if p.unit})
    if not root_matrices:
        hidden = max(p.shape[0] for p in parameters)
        return TransformerDims(hidden, len(layers), 4 * hidden, 0)
    vocab, hidden = max((p.shape for p in root_matrices), key=lambda shape: shape[0])
    first_layer = [p for p in matrices if layers and p.unit == layers[0]]
    down = [p.shape[1] for p in first_layer if p.shape[0] == hidden and p.shape[1] != hidden]
    other = [size for p in first_layer for size in p.shape if size != hidden]
    intermediate = max(down or other or [4 * hidden])
    return TransformerDims(hidden_size=hidden, num_layers=len(layers), intermediate_size=intermediate, vocab_size=vocab)
