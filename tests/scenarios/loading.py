"""Scenarios for loading consolidated checkpoints (raw, safetensors, HF, DCP) into a meta-initialised HSDP model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.training import SEQ, VOCAB, build, full_state, layer_class, logits_of, make_fabric

TOKENS = torch.arange(2 * SEQ).remainder(VOCAB).view(2, SEQ)


def reference_logits(kind: str, reference: str, dtype: str = "float32") -> torch.Tensor:
    model = build(kind, seed=0)
    model.load_state_dict(torch.load(reference, weights_only=True))
    model = model.to(getattr(torch, dtype))
    with torch.no_grad():
        return logits_of(model, TOKENS).float()


def weights_differing(model: torch.nn.Module, reference: str, dtype: str = "float32") -> list[str]:
    """The names whose full tensor (this rank's replica, gathered over its shard group) is not exactly the
    reference file's in ``dtype``: every loaded weight, every row, not only what some tokens' logits reach."""
    expected = torch.load(reference, weights_only=True)
    actual = full_state(model)
    return sorted(
        name
        for name, tensor in actual.items()
        if name not in expected or not torch.equal(tensor, expected[name].to(getattr(torch, dtype)))
    )


def load_cases(
    num_nodes: int, devices: int, kind: str, cases: list[dict[str, Any]], strategy: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """For each case: meta-init the model, set it up, load the file raw, compare every weight exactly with the
    reference file and the logits with a normal CPU build.

    ``strategy``: more strategy arguments (``timeout_seconds`` becomes ``timeout``); the first result then also says
    which backend and timeout the default process group got.
    """
    from datetime import timedelta

    import torch.distributed as dist

    options = dict(strategy or {})
    if "timeout_seconds" in options:
        options["timeout"] = timedelta(seconds=options.pop("timeout_seconds"))
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class(kind)}, **options)
    group = dist.distributed_c10d._get_default_group()
    process_group = {
        "backend": dist.get_backend(),
        "timeout_seconds": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
    }
    results = []
    for case in cases:
        with fabric.init_module(empty_init=True):
            model = build(kind, seed=123)
        model = model.to(getattr(torch, case.get("model_dtype", "float32")))
        model = fabric.setup_module(model)
        outcome: dict[str, Any] = {"file": Path(case["file"]).name}
        path = case["file"]
        if case.get("missing_on_rank") == fabric.global_rank:
            path = str(Path(path).with_name("does-not-exist.pth"))
        try:
            result = fabric.strategy.load_raw(
                path,
                model,
                strict=case.get("strict", True),
                load_mode=case.get("mode"),
                key_map=case.get("key_map"),
            )
        except Exception as error:
            outcome["error"] = f"{type(error).__name__}: {error}"
            results.append(outcome)
            continue
        with torch.no_grad():
            logits = logits_of(model, TOKENS).float()
        expected = reference_logits(kind, case["reference"], case.get("model_dtype", "float32"))
        outcome.update(
            max_logit_diff=(logits - expected).abs().max().item(),
            weights_differ=weights_differing(model, case["reference"], case.get("model_dtype", "float32")),
            missing=result.missing,
            unexpected=result.unexpected,
            loaded=len(result.loaded),
            param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        )
        results.append(outcome)
    results[0]["process_group"] = process_group
    return results


def fabric_load_raw_state_dict(num_nodes: int, devices: int, file: str, reference: str) -> dict[str, Any]:
    """The user's call from the report: fabric.load(path, {"model": model}) on a flat converted state dict."""
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    with fabric.init_module(empty_init=True):
        model = build("llama", seed=123)
    model = fabric.setup_module(model)
    remainder = fabric.load(file, {"model": model})
    with torch.no_grad():
        logits = logits_of(model, TOKENS).float()
    difference = (logits - reference_logits("llama", reference)).abs().max().item()
    facts = {
        "remainder": remainder,
        "max_logit_diff": difference,
        "weights_differ": weights_differing(model, reference),
    }
    # docs/api.md: Fabric's own load_raw drops the strategy's result; strategy.load_raw returns the LoadResult
    facts["fabric_load_raw_returned"] = fabric.load_raw(file, model)
    result = fabric.strategy.load_raw(file, model)
    facts["strategy_load_raw_returned"] = (type(result).__name__, len(result.loaded), result.missing, result.unexpected)
    return facts
