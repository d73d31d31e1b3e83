"""float8 training: torchao's float8 linear layers, converted before tensor parallelism and ``fully_shard``.

``HybridFSDPStrategy(float8=True)`` (or a recipe name: ``"rowwise"``, the default and torchtitan's, or
``"tensorwise"``) swaps the model's ``nn.Linear`` layers for torchao's ``Float8Linear``, which casts inputs and
weights to float8 for the matmuls. The output head and layers with a dim not divisible by 16 (float8 matmuls need
it) stay in high precision. float8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper,
Blackwell): elsewhere the strategy refuses when it is created. torchao is an optional extra:
``pip install fabric-hsdp[float8]``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from fabric_hsdp.logs import info_on_rank_zero, warning_on_rank_zero

_logger = logging.getLogger(__name__)

RECIPES = ("rowwise", "tensorwise")
HEAD_NAMES = ("lm_head", "output")  # litgpt / transformers, torchtitan-style models
MINIMUM_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Float8Spec:
    recipe: str
    emulate: bool = False  # torchao's emulation (float8 casts, high-precision matmuls): for tests on CPU


def validate_float8(float8: bool | str) -> Float8Spec | None:
    """``float8=...`` when the strategy is created: ``None`` when off; raises where float8 cannot run."""
    if float8 is False:
        return None
    recipe = "rowwise" if float8 is True else float8
    if recipe not in RECIPES:
        raise ValueError(f"HybridFSDPStrategy(float8={float8!r}) is not valid: pass True, or one of {list(RECIPES)}.")
    reason = float8_unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"HybridFSDPStrategy(float8={float8!r}) cannot run here: {reason}")
    return Float8Spec(recipe)


def float8_unsupported_reason() -> str | None:
    """Why float8 training cannot run on this machine, in one line; ``None`` when it can."""
    if not torch.cuda.is_available():
        return (
            "float8 matmuls need an NVIDIA GPU of compute capability 8.9+ (L4, L40, RTX 4090, H100, B200) and this"
            " machine has no CUDA device. Drop float8."
        )
    capability = torch.cuda.get_device_capability()
    if capability < MINIMUM_CAPABILITY:
        return (
            f"float8 matmuls need compute capability 8.9+ (L4, L40, RTX 4090, H100, B200); this GPU"
            f" ({torch.cuda.get_device_name()}) is {capability[0]}.{capability[1]}. Drop float8, or use bf16-mixed."
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed: pip install 'fabric-hsdp[float8]' (or pip install torchao)."
    return None


def converts(name: str, module: nn.Module, vocab_sizes: set[int]) -> bool:
    """Whether ``module`` becomes a float8 linear layer: not the output head, both dims divisible by 16."""
    if not isinstance(module, nn.Linear):
        return False
    if name.split(".")[-1] in HEAD_NAMES or module.out_features in vocab_sizes:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(
    model: nn.Module, spec: Float8Spec, *, compiled: bool = True, tensor_parallel: bool = False
) -> list[str]:
    """Swap ``model``'s eligible ``nn.Linear`` layers for torchao's ``Float8Linear`` in place; return their names.

    ``tensorwise`` without tensor parallelism all-gathers the weights in float8 (torchtitan's
    ``enable_fsdp_float8_all_gather``: half the bytes of a bf16 all-gather), with the scales computed for all layers
    at once after each optimizer step (:func:`precompute_scales_after_steps`). Under tensor parallelism the weights
    are gathered in high precision (float8 all-gather would need torchao's float8 tensor-parallel styles).

    Warns where float8 is likely slower than bf16: without ``compile`` (eager float8 casts are separate kernels),
    and for layers below torchao's size thresholds for the recipe (measured by torchao on H100).
    """
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

    vocab_sizes = {module.num_embeddings for module in model.modules() if isinstance(module, nn.Embedding)}
    chosen = [name for name, module in model.named_modules() if converts(name, module, vocab_sizes)]
    fast = _auto_filter_for_recipe(spec.recipe, filter_fqns=[])
    small = [name for name in chosen if not fast(model.get_submodule(name), name)]
    if not compiled:
        warning_on_rank_zero(
            _logger,
            "float8=%r without compile=True: eager float8 is usually slower than bf16. Pass compile=True.",
            spec.recipe,
        )
    if small:
        warning_on_rank_zero(
            _logger,
            "float8 (%s): %d of %d converted linear layers are below torchao's size thresholds for this recipe (e.g."
            " %s), where float8 is usually slower than bf16; it pays from hidden sizes of a few thousand.",
            spec.recipe,
            len(small),
            len(chosen),
            small[0],
        )
    chosen_set = set(chosen)
    config = Float8LinearConfig.from_recipe_name(spec.recipe)
    if spec.emulate:
        config = dataclasses.replace(config, emulate=True)
    if spec.recipe == "tensorwise" and not tensor_parallel:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen_set)
    info_on_rank_zero(_logger, "float8 (%s): %d linear layers converted", spec.recipe, len(chosen))
    return chosen


def precompute_scales_after_steps(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> None:
    """After each step of ``optimizer``, compute the float8 scales of the weights ``modules`` all-gather in float8,
    for all layers in one all-reduce (torchtitan's ``precompute_float8_dynamic_scale_for_fsdp``) instead of one per
    layer in the next forward. A no-op for modules without float8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for module in modules:
            precompute_float8_dynamic_scale_for_fsdp(module)

    optimizer.register_step_post_hook(after_step)
