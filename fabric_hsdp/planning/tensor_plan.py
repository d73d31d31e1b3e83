"""Which dim tensor parallelism splits in each parameter: read from the plan the strategy would apply.

``HybridFSDPStrategy(tensor_parallel_plan=...)`` takes ``"auto"`` (the model's own plan: transformers' tp plans,
litgpt's GPT, a ``_tp_plan`` attribute), a dict of module-name patterns to styles, or a callable. For the first two
the planner asks :mod:`fabric_hsdp.tensor_parallel` for the same styles and maps each to the dim it splits, so the
plan's memory and its list of valid tensor-parallel sizes match what the strategy will do. A callable, or a model
``"auto"`` knows no plan for, leaves the planner to guess by parameter names (``model.tensor_parallel_dim``).
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any


def plan_split_dims(module: Any, plan: Any = "auto") -> tuple[dict[str, int | None], dict[str, int]] | None:
    """``({parameter name: split dim or None}, {head count name: count})`` under ``plan``, or None if unknown.

    The head counts are those the plan requires to divide by the tensor-parallel size (e.g. ``config.n_head``).
    """
    if callable(plan) or not (plan == "auto" or isinstance(plan, dict)):
        return None
    from fabric_hsdp.tensor_parallel.plans import ModelPlan, auto_plan
    from fabric_hsdp.tensor_parallel.styles import split_dim, to_style

    try:
        model_plan = auto_plan(module) if plan == "auto" else ModelPlan(styles=plan)
    except ValueError:  # "auto" knows no plan for this model
        return None
    modules = [(name, child) for name, child in module.named_modules() if name]
    dims: dict[str, int | None] = {}
    for pattern, value in model_plan.styles.items():
        style, parts = to_style(value, pattern), pattern.split(".")
        for name, child in modules:
            if len(name.split(".")) != len(parts) or not all(map(fnmatch, name.split("."), parts)):
                continue
            split = split_dim(style, type(child).__name__)
            weight_dim = None if split is None else split[0]
            for leaf, parameter in child.named_parameters(recurse=False):
                if leaf == "weight":
                    dims[f"{name}.{leaf}"] = weight_dim
                elif leaf == "bias":  # a bias follows the output rows: split with column-wise, whole with row-wise
                    dims[f"{name}.{leaf}"] = 0 if weight_dim == 0 and len(parameter.shape) == 1 else None
    return dims, dict(model_plan.heads)
