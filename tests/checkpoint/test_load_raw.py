"""Consolidated checkpoints load into a meta-initialised HSDP model on 2 simulated nodes x 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.launch import launch
from tests.helpers.training import (
    SEQ,
    VOCAB,
    build,
    full_state,
    hf_config,
    layer_class,
    litgpt_config,
    logits_of,
    make_fabric,
)

pytestmark = pytest.mark.slow


def _cases(launched):
    values = launched.check().values
    assert all(len(v) == len(values[0]) for v in values)
    return values


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    from fabric_hsdp.checkpoint import convert_checkpoint

    root = tmp_path_factory.mktemp("llama")
    state = build("llama", seed=0).state_dict()
    torch.save(state, root / "lit-llama.pth")
    save_file(state, root / "model.safetensors")
    bf16 = {k: v.bfloat16() for k, v in state.items()}
    torch.save(bf16, root / "bf16.pth")
    torch.save({k: v.float() for k, v in bf16.items()}, root / "bf16_as_fp32.pth")
    torch.save({f"module.{k}": v for k, v in state.items()}, root / "ddp_wrapped.pth")
    torch.save({f"_orig_mod.{k}": v for k, v in state.items()}, root / "compiled.pth")
    torch.save({f"transformer.{k}": v for k, v in state.items()}, root / "prefixed.pth")
    broken = dict(state)
    del broken["layers.1.feed_forward.w1.weight"]
    broken["layers.9.extra.weight"] = torch.zeros(3)
    broken["norm.weight"] = torch.ones(65)
    torch.save(broken, root / "broken.pth")
    torch_save_to_dcp(root / "lit-llama.pth", root / "torch_dcp")
    convert_checkpoint(root / "lit-llama.pth", root / "converted_dcp")
    return root


@pytest.mark.timeout(360)  # one launch of 300 s
def test_every_format_and_mode_loads_exactly(llama_files):
    root = llama_files
    reference = str(root / "lit-llama.pth")

    def case(file, **options):
        return {"file": str(root / file), "reference": options.pop("reference", reference), **options}

    cases = [
        case("lit-llama.pth"),
        case("lit-llama.pth", mode="turns"),
        case("lit-llama.pth", mode="rank0"),
        case("model.safetensors"),
        case("model.safetensors", mode="rank0"),
        case("torch_dcp"),
        case("converted_dcp"),
        case("bf16.pth", reference=str(root / "bf16_as_fp32.pth")),
        case("lit-llama.pth", model_dtype="bfloat16"),
        case("ddp_wrapped.pth"),
        case("compiled.pth"),
        case("prefixed.pth", key_map={"transformer.": ""}),
    ]
    # the strategy's process_group_backend and timeout reach the default process group
    strategy = {"process_group_backend": "gloo", "timeout_seconds": 321}
    args = {"kind": "llama", "cases": cases, "strategy": strategy}
    values = _cases(launch(load_cases, args, timeout=300))
    for rank_values in values:
        assert rank_values[0].pop("process_group") == {"backend": "gloo", "timeout_seconds": 321.0}
        for spec, outcome in zip(cases, rank_values):
            assert "error" not in outcome, (spec, outcome)
            assert outcome["max_logit_diff"] == 0.0, (spec, outcome)
            assert outcome["weights_differ"] == [], (spec, outcome)
            assert outcome["missing"] == [] and outcome["unexpected"] == [], (spec, outcome)
            assert outcome["loaded"] == 21
            expected_dtype = "torch.bfloat16" if spec.get("model_dtype") == "bfloat16" else "torch.float32"
            assert outcome["param_dtypes"] == [expected_dtype]


def test_key_errors_strict_and_not_strict_and_a_rank_that_cannot_open(llama_files):
    root = llama_files
    base = {"reference": str(root / "lit-llama.pth")}
    cases = [
        {**base, "file": str(root / "broken.pth")},
        {**base, "file": str(root / "prefixed.pth")},
        {**base, "file": str(root / "lit-llama.pth"), "missing_on_rank": 3},
        # load_turn_size=1 (the default): local rank 1 of each node reads in the second of two turns
        {**base, "file": str(root / "lit-llama.pth"), "missing_on_rank": 3, "mode": "turns"},
    ]
    values = _cases(launch(load_cases, {"kind": "llama", "cases": cases}))
    for rank, (broken, prefixed, unreadable, in_turns) in enumerate(values):
        if rank != 3:
            assert "(turn 2 of 2) failed on rank 3: FileNotFoundError" in in_turns["error"], in_turns
        message = broken["error"]
        assert message.startswith("CheckpointError: checkpoint '")
        assert "has no tensor for 'layers.1.feed_forward.w1.weight' (model expects [96, 64] float32)" in message
        assert "'layers.9.extra.weight' ([3] float32)" in message
        assert "'norm.weight' is [65] float32 but the model expects [64] float32" in message
        assert "Pass strict=False to skip them, or key_map= to rename." in message
        assert "key_map={'transformer.': ''} would rename them" in prefixed["error"]
        if rank == 3:
            assert unreadable["error"].startswith("FileNotFoundError") and "does-not-exist.pth" in unreadable["error"]
        else:
            assert unreadable["error"].startswith("PeerRankError: loading '")
            assert "failed on rank 3: FileNotFoundError" in unreadable["error"]
    # strict=False loads what matches; the strategy's load_turn_size=2 lets both local ranks of a node read at once
    cases = [{**base, "file": str(root / "broken.pth"), "strict": False}]
    cases += [{**base, "file": str(root / "lit-llama.pth"), "missing_on_rank": 3, "mode": "turns"}]
    args = {"kind": "llama", "cases": cases, "strategy": {"load_turn_size": 2}}
    for rank, (outcome, in_turns) in enumerate(_cases(launch(load_cases, args))):
        if rank != 3:
            assert "(turn 1 of 1) failed on rank 3: FileNotFoundError" in in_turns["error"], in_turns
        assert outcome["missing"] == ["layers.1.feed_forward.w1.weight"]
        assert outcome["unexpected"] == ["layers.9.extra.weight"]
        assert outcome["loaded"] == 19  # also skips the mis-shaped norm.weight


def test_fabric_load_accepts_a_raw_state_dict_and_a_converted_dcp(llama_files):
    for name in ("lit-llama.pth", "converted_dcp"):
        args = {"file": str(llama_files / name), "reference": str(llama_files / "lit-llama.pth")}
        for facts in launch(fabric_load_raw_state_dict, args).check().values:
            assert facts["remainder"] == {}
            assert facts["max_logit_diff"] == 0.0 and facts["weights_differ"] == []
            assert facts["fabric_load_raw_returned"] is None
            assert facts["strategy_load_raw_returned"] == ("LoadResult", 21, [], [])


def test_transformers_save_pretrained_directories(tmp_path):
    model = build("hf", seed=0)
    torch.save(model.state_dict(), tmp_path / "reference.pth")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    model.save_pretrained(tmp_path / "single")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    (tmp_path / "bin").mkdir()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text(json.dumps(hf_config().to_dict()))
    cases = [
        {"file": str(tmp_path / name), "reference": str(tmp_path / "reference.pth"), "mode": mode}
        for name, mode in [("sharded", None), ("single", "turns"), ("bin", "rank0")]
    ]
    for rank_values in _cases(launch(load_cases, {"kind": "hf", "cases": cases})):
        for outcome in rank_values:
            assert "error" not in outcome, outcome
            assert outcome["max_logit_diff"] == 0.0 and outcome["missing"] == [] and outcome["unexpected"] == []
            assert outcome["weights_differ"] == [], outcome


def test_litgpt_converter_output(tmp_path):
    import litgpt.config
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    config = litgpt_config()
    litgpt.config.name_to_config[config.name] = {
        key: getattr(config, key)
        for key in (
            "name",
            "block_size",
            "vocab_size",
            "padded_vocab_size",
            "n_layer",
            "n_head",
            "n_query_groups",
            "n_embd",
            "rotary_percentage",
            "parallel_residual",
            "bias",
            "norm_class_name",
            "mlp_class_name",
            "intermediate_size",
        )
    }
    build("hf", seed=0).save_pretrained(tmp_path / config.name)
    convert_hf_checkpoint(tmp_path / config.name, model_name=config.name)
    lit_file = tmp_path / config.name / "lit_model.pth"
    cases = [{"file": str(lit_file), "reference": str(lit_file)}, {"file": str(lit_file), "reference": str(lit_file)}]
    cases[1]["mode"] = "rank0"
    for rank_values in _cases(launch(load_cases, {"kind": "litgpt", "cases": cases})):
        for outcome in rank_values:
            assert "error" not in outcome, outcome
            assert outcome["max_logit_diff"] == 0.0 and outcome["missing"] == [] and outcome["unexpected"] == []
            assert outcome["weights_differ"] == [], outcome


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# Loading consolidated checkpoints (raw, safetensors, HF, DCP) into a meta-initialised HSDP model.


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
