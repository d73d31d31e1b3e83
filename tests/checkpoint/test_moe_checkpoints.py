"""Mixture-of-experts checkpoints (#32): hub-layout files (one tensor per expert) load raw into models whose experts
are fused parameters, through transformers' own conversion rules, each rank reading only its experts' rows."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.helpers import moe
from tests.helpers.counters import ReadCounter
from tests.helpers.launch import launch, launch_cases
from tests.helpers.training import full_state, make_fabric

pytestmark = pytest.mark.slow


def load_hub(num_nodes: int, devices: int, kind: str, path: str, modes: list[str | None]) -> list[dict[str, Any]]:
    """Per load mode: meta-init, shard over HSDP, ``load_raw`` the hub-layout file; what was read and how the
    model compares with its library's own load of the same file."""
    from torch.distributed.tensor import DTensor

    fabric = make_fabric(num_nodes, devices, sharded_modules={moe.layer_class(kind)})
    reference = moe.load_reference(kind, path)
    with torch.no_grad():
        expected_logits = moe.logits_of(reference, moe.TOKENS)
    expected_state = reference.state_dict()
    results = []
    for mode in modes:
        with fabric.init_module(empty_init=True):
            model = moe.build(kind, seed=123)
        model = fabric.setup_module(model)
        counter = ReadCounter()
        result = fabric.strategy.load_raw(path, model, load_mode=mode)
        read = counter.bytes
        state = full_state(model)
        local = {name: t.to_local() if isinstance(t, DTensor) else t for name, t in model.module.state_dict().items()}
        with torch.no_grad():
            logits = moe.logits_of(model, moe.TOKENS)
        experts = [name for name in local if "experts" in name]
        results.append(
            {
                "mode": mode,
                "missing": result.missing,
                "unexpected": result.unexpected,
                "max_logit_diff": (logits - expected_logits).abs().max().item(),
                "weights_differ": sorted(n for n, t in expected_state.items() if not torch.equal(state[n], t)),
                "bytes_read": read,
                "own_bytes": sum(t.numel() * t.element_size() for t in local.values()),
                "expert_bytes_local": sum(local[n].numel() * local[n].element_size() for n in experts),
                "expert_bytes_all": sum(math.prod(state[n].shape) * state[n].element_size() for n in experts),
                "model_bytes": sum(t.numel() * t.element_size() for t in state.values()),
                "expert_placements": sorted(
                    {str(getattr(model.module.state_dict()[n], "placements", None)) for n in experts}
                ),
            }
        )
    return results


@pytest.fixture(scope="module")
def hub_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {kind: moe.save_hub(kind, root / kind) for kind in moe.KINDS}


def test_save_pretrained_writes_one_tensor_per_expert(hub_files):
    from fabric_hsdp.checkpoint.formats.detect import open_checkpoint

    with open_checkpoint(hub_files["qwen3_moe"]) as source:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in source
        assert not [key for key in source if key.endswith("gate_up_proj")]
    with open_checkpoint(hub_files["mixtral"]) as source:
        assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in source


HUB_LOADS = [("qwen3_moe", [None, "rank0"]), ("mixtral", [None, "turns"]), ("litgpt_moe", [None])]


@pytest.fixture(scope="module")
def hub_loads(hub_files) -> dict[str, list[list[dict]]]:
    """Each kind's outcomes per rank (one per load mode), all from one launch."""
    cases = {kind: {"kind": kind, "path": str(hub_files[kind]), "modes": modes} for kind, modes in HUB_LOADS}
    return launch_cases(load_hub, cases, timeout=360)


@pytest.mark.timeout(420)  # the launch of all kinds, when this test runs first
@pytest.mark.parametrize(("kind", "modes"), HUB_LOADS)
def test_hub_layout_loads_into_hsdp_with_each_rank_reading_its_experts(hub_loads, kind, modes):
    for rank, per_mode in enumerate(hub_loads[kind]):
        for outcome in per_mode:
            assert outcome["missing"] == [] and outcome["unexpected"] == [], (rank, outcome)
            assert outcome["weights_differ"] == [], (rank, outcome)
            assert outcome["max_logit_diff"] == 0.0, (rank, outcome)
            # experts are sharded by expert: Shard(0) over the shard dim, replicated over the replicas
            assert outcome["expert_placements"] == ["(Replicate(), Shard(dim=0))"], outcome
            # half of each layer's experts live on each rank of a shard group of 2
            assert outcome["expert_bytes_local"] * 2 == outcome["expert_bytes_all"], outcome
            if outcome["mode"] in (None, "turns"):  # each rank reads exactly its own shard's bytes, experts included
                assert outcome["bytes_read"] == outcome["own_bytes"], (rank, outcome)
                assert outcome["bytes_read"] * 2 == outcome["model_bytes"], (rank, outcome)
            elif rank == 0:  # rank0: rank 0 reads every tensor once, for everyone
                assert outcome["bytes_read"] == outcome["model_bytes"], outcome
            else:
                assert outcome["bytes_read"] == 0, (rank, outcome)


def _meta_model(kind: str) -> torch.nn.Module:
    with torch.device("meta"):
        return moe.build(kind)


def test_a_box_cutting_through_the_concatenation_reads_only_its_rows(hub_files):
    from fabric_hsdp.checkpoint.formats.conversions import ConvertedSource, convert_for_model
    from fabric_hsdp.checkpoint.formats.detect import open_checkpoint

    reference = moe.load_reference("qwen3_moe", hub_files["qwen3_moe"]).state_dict()
    name = "model.layers.1.mlp.experts.gate_up_proj"  # [4 experts, gate 32 rows + up 32 rows, 64]
    counter = ReadCounter()
    with open_checkpoint(hub_files["qwen3_moe"]) as stored:
        source = convert_for_model(stored, _meta_model("qwen3_moe"))
        assert isinstance(source, ConvertedSource) and sorted(source.keys()) == sorted(reference)
        box = (slice(1, 3), slice(20, 50), slice(8, 40))  # experts 1-2, gate rows 20-31 and up rows 0-17
        before = counter.bytes
        part = source.read_slice(name, box)
        assert torch.equal(part, reference[name][box])
        assert counter.bytes - before == 2 * 30 * 32 * 4
        down = "model.layers.0.mlp.experts.down_proj"
        assert torch.equal(source.read(down), reference[down])


def test_operations_that_cannot_be_read_lazily_are_refused_by_name(hub_files, monkeypatch):
    from transformers.core_model_loading import MergeModulelist, PermuteForRope, WeightConverter

    from fabric_hsdp.checkpoint.formats import conversions
    from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
    from fabric_hsdp.errors import CheckpointError

    mapping = [
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", operations=[MergeModulelist(0)]),
        WeightConverter("self_attn.q_proj.weight", "self_attn.q_proj.weight", operations=[PermuteForRope()]),
    ]
    monkeypatch.setattr(conversions, "_transformers_mapping", lambda model: mapping)
    with open_checkpoint(hub_files["qwen3_moe"]) as stored, pytest.raises(CheckpointError) as error:
        conversions.convert_for_model(stored, _meta_model("qwen3_moe"))
    assert "with PermuteForRope, which fabric-hsdp cannot apply lazily" in str(error.value)
    assert "'model.layers.0.self_attn.q_proj.weight'" in str(error.value)


def _optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    state = getattr(optimizer, "optimizer", optimizer).state
    return {
        f"{name}.{key}": value.full_tensor() if hasattr(value, "full_tensor") else value
        for name, param in model.named_parameters()
        for key, value in state[param].items()
        if isinstance(value, torch.Tensor) and value.ndim
    }


def train_and_save(num_nodes: int, devices: int, kind: str, path: str, steps: int = 2) -> dict[str, Any]:
    """Train ``steps`` steps on HSDP (each rank its own rows), save sharded; the full model and AdamW state."""
    from tests.helpers.training import batch

    fabric = make_fabric(num_nodes, devices)
    model = fabric.setup_module(moe.build(kind, seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    inputs, targets = batch(2 * fabric.world_size)
    rows = slice(2 * fabric.global_rank, 2 * fabric.global_rank + 2)
    for _ in range(steps):
        fabric.backward(moe.loss_of(model, inputs[rows], targets[rows]))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": steps})
    return {"model": full_state(model), "optimizer": _optimizer_state(model, optimizer)}


def resume(num_nodes: int, devices: int, kind: str, path: str) -> dict[str, Any]:
    fabric = make_fabric(num_nodes, devices)
    with fabric.init_module(empty_init=True):
        model = moe.build(kind, seed=123)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    return {"model": full_state(model), "optimizer": _optimizer_state(model, optimizer), "step": state["step"]}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind", moe.KINDS)
def test_sharded_save_resumes_on_another_node_count_and_exports_to_the_hub_layout(hub_files, tmp_path, kind):
    from fabric_hsdp.checkpoint import convert_checkpoint

    path = str(tmp_path / "sharded")
    saved = launch(train_and_save, {"kind": kind, "path": path}, timeout=180)
    saved = saved.check().values
    resumed = (
        launch(
            resume,
            {"kind": kind, "path": path},
            num_nodes=1,
            ranks_per_node=2,
            timeout=180,
        )
        .check()
        .values
    )
    trained = saved[0]["model"]
    assert any("experts" in name for name in saved[0]["optimizer"])
    for values in resumed:  # 2 nodes x 2 ranks -> 1 node x 2 ranks: every weight and AdamW moment exactly
        assert values["step"] == 2
        assert sorted(values["model"]) == sorted(trained)
        assert [n for n, t in trained.items() if not torch.equal(values["model"][n], t)] == []
        assert sorted(values["optimizer"]) == sorted(saved[0]["optimizer"])
        assert [n for n, t in saved[0]["optimizer"].items() if not torch.equal(values["optimizer"][n], t)] == []

    if kind == "litgpt_moe":  # litgpt's own layout is one module per expert: the export is lit_model.pth
        convert_checkpoint(path, tmp_path / "lit_model.pth", model_only=True)
        model = moe.build(kind, seed=123)
        model.load_state_dict(torch.load(tmp_path / "lit_model.pth", weights_only=True))
        assert [n for n, t in model.state_dict().items() if not torch.equal(t, trained[n])] == []
        return
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    export = tmp_path / "export"
    convert_checkpoint(path, export, to="safetensors", hf_config=hub_files[kind] / "config.json", model_only=True)
    with (
        safe_open(str(export / "model.safetensors"), "pt") as exported,
        safe_open(str(hub_files[kind] / "model.safetensors"), "pt") as hub,
    ):
        assert sorted(exported.keys()) == sorted(hub.keys())  # one tensor per expert, the hub's names
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info  # nothing missing, unexpected, failed
    assert [n for n, t in model.state_dict().items() if not torch.equal(t, trained[n])] == []


def test_a_torch_function_the_expressions_cannot_apply_lazily_is_refused_by_name(hub_files):
    from fabric_hsdp.checkpoint.formats.conversions import convert_for_model
    from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
    from fabric_hsdp.errors import CheckpointError

    with open_checkpoint(hub_files["qwen3_moe"]) as stored:
        source = convert_for_model(stored, _meta_model("qwen3_moe"))
        fused = source.expressions["model.layers.0.mlp.experts.down_proj"]
        with pytest.raises(CheckpointError, match=r"applies torch\.add to stored tensors, which fabric-hsdp cannot"):
            torch.add(fused, 1)
