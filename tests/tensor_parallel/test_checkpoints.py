"""Checkpoints, raw loading and conversion under tensor parallelism (transformers' Llama and litgpt's GPT, both GQA).

Saved on (1, 2, 2) (one node of 4, TP=2, with sequence and loss parallelism) and on plain HSDP 2 x 2; loaded on
another TP size, shard size or node count, with the levers off or on: TP=2 -> TP=1, TP=1 -> TP=2 with sequence and
loss parallelism, (1, 2, 2) -> (2, 1, 2) (with split replica reads, no sequence parallelism), (1, 2, 2) -> HSDP 2 x 2.
Plain TP=2 saves loaded with the levers on: ``test_tensor_parallel.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.helpers.counters import ReadCounter
from tests.helpers.launch import launch
from tests.helpers.training import (
    build,
    full_optimizer_state,
    full_state,
    hf_config,
    litgpt_config,
    logits_of,
    make_fabric,
    setup_training,
    train_steps,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

KINDS = ("hf", "litgpt")


def _assert_exact(facts, kinds=KINDS):
    for kind in kinds:
        assert facts[kind]["model_equal"] and all(facts[kind]["model_equal"].values()), (kind, facts[kind])
        unequal = [name for name, equal in facts[kind]["optimizer_equal"].items() if not equal]
        assert facts[kind]["optimizer_equal"] and not unequal, (kind, unequal)
        assert facts[kind]["scheduler_equal"] and facts[kind]["step"] == 2
        assert facts[kind]["remainder"] == {"note": kind.removesuffix("-full")}


@pytest.fixture(scope="module")
def saved_with_tp(tmp_path_factory):
    """Saved in the background on (1, 2, 2) with sequence and loss parallelism, plus full exports of the same state."""
    out = tmp_path_factory.mktemp("tp2")
    args = {"out": str(out), "tensor_parallel_size": 2, "async_save": True, "full": True}
    args.update(sequence_parallel=True, loss_parallel=True)
    launch(save, args, num_nodes=1, ranks_per_node=4, timeout=300).check()
    return out


@pytest.fixture(scope="module")
def saved_without_tp(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1")
    launch(save, {"out": str(out), "tensor_parallel_size": 1}, timeout=300).check()
    return out


@pytest.mark.parametrize(
    ("nodes", "per_node", "tensor_parallel", "split", "mesh"),
    [(2, 2, 2, True, (2, 1, 2)), (2, 2, 1, False, (2, 2))],
    ids=["tp2-to-mesh212-split-reads", "tp2-to-hsdp2x2"],
)
def test_tensor_parallel_checkpoint_loads_exactly_on_other_layouts(
    saved_with_tp, nodes, per_node, tensor_parallel, split, mesh
):
    args = {"out": str(saved_with_tp), "tensor_parallel_size": tensor_parallel, "split_replica_reads": split}
    result = launch(load, args, num_nodes=nodes, ranks_per_node=per_node, timeout=300)
    for facts in result.check().values:
        assert facts["hf"]["mesh"] == mesh
        _assert_exact(facts)
        # the full checkpoint (.pth with optimizer state) of the same state too: with replicas and TP on (2, 1, 2),
        # litgpt's fused qkv rows regrouped by TP rank, or on plain HSDP 2 x 2
        _assert_exact(facts, kinds=[f"{kind}-full" for kind in KINDS])


def test_checkpoint_without_tensor_parallelism_loads_exactly_with_it(saved_without_tp):
    args = {"out": str(saved_without_tp), "tensor_parallel_size": 2, "sequence_parallel": True, "loss_parallel": True}
    result = launch(load, args, num_nodes=1, ranks_per_node=4, timeout=300)
    for facts in result.check().values:
        assert facts["hf"]["mesh"] == (1, 2, 2)
        _assert_exact(facts)


def test_stored_layout_is_the_models_own(saved_with_tp):
    """torch's own DCP reader sees litgpt's [Q; K; V] rows and transformers' names; full exports hold the same."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for kind in KINDS:
        expected = torch.load(saved_with_tp / f"{kind}-expected.pt", weights_only=False)
        dcp_to_torch_save(saved_with_tp / f"{kind}-sharded", saved_with_tp / f"{kind}-torch.pt")
        stored = torch.load(saved_with_tp / f"{kind}-torch.pt", weights_only=True)
        full = torch.load(saved_with_tp / f"{kind}-full.pth", weights_only=True)
        exported = load_file(saved_with_tp / f"{kind}-model.safetensors")
        for name, tensor in expected["model"].items():
            assert torch.equal(stored["model"][name], tensor), (kind, name)
            assert torch.equal(full["model"][name], tensor), (kind, name)
            assert torch.equal(exported[name], tensor), (kind, name)
        for name, entries in expected["optimizer"].items():
            for key, value in entries.items():
                assert torch.equal(full["optimizer"]["state"][name][key], value), (kind, name, key)
                assert torch.equal(stored["optimizer"]["state"][name][key], value), (kind, name, key)
        assert full["step"] == 2 and full["note"] == kind


def test_converted_tensor_parallel_checkpoint_loads_in_litgpt_and_transformers(saved_with_tp, tmp_path):
    from litgpt.model import GPT
    from transformers import LlamaForCausalLM

    from fabric_hsdp.checkpoint import convert_checkpoint

    convert_checkpoint(saved_with_tp / "litgpt-sharded", tmp_path / "lit_model.pth", model_only=True)
    model = GPT(litgpt_config())
    model.load_state_dict(torch.load(tmp_path / "lit_model.pth", weights_only=True))
    expected = torch.load(saved_with_tp / "litgpt-expected.pt", weights_only=False)["model"]
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in expected.items())

    convert_checkpoint(saved_with_tp / "hf-sharded", tmp_path / "hf", to="safetensors")
    hf_config().save_pretrained(tmp_path / "hf")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    expected = torch.load(saved_with_tp / "hf-expected.pt", weights_only=False)["model"]
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in expected.items())


@pytest.fixture(scope="module")
def consolidated_files(tmp_path_factory):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    root = tmp_path_factory.mktemp("consolidated")
    for kind in KINDS:
        state = build(kind, seed=0).state_dict()
        torch.save(state, root / f"{kind}.pth")
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, root / f"{kind}.safetensors")
        torch.save({"model": state, "step": 3}, root / f"{kind}-fabric.ckpt")
        torch_save_to_dcp(root / f"{kind}.pth", root / f"{kind}-dcp")
    build("hf", seed=0).save_pretrained(root / "hf-dir", max_shard_size="100KB")
    assert json.loads((root / "hf-dir" / "model.safetensors.index.json").read_text())["weight_map"]
    return root


def test_raw_loads_fill_tensor_parallel_shards_reading_only_their_elements(consolidated_files):
    root = consolidated_files

    def case(kind, file, **options):
        return {"kind": kind, "file": str(root / file), "reference": str(root / f"{kind}.pth"), **options}

    cases = []
    for kind in KINDS:
        cases += [
            case(kind, f"{kind}.pth"),
            case(kind, f"{kind}.pth", mode="turns"),
            case(kind, f"{kind}.pth", mode="rank0"),
            case(kind, f"{kind}.safetensors"),
            case(kind, f"{kind}-fabric.ckpt", via_fabric_load=True),
            case(kind, f"{kind}-dcp"),
        ]
    cases.append(case("hf", "hf-dir"))
    # with sequence parallelism: norms are DTensors replicated over the tensor-parallel ranks too
    args = {"cases": cases, "sequence_parallel": True}
    result = launch(load_raw, args, num_nodes=1, ranks_per_node=4, timeout=400)
    values = result.check().values
    for rank_values in values:
        for spec, outcome in zip(cases, rank_values):
            assert outcome["weights_equal"], (spec, outcome["unequal"])
            # not bit-exact: row-wise layers sum partial products over the tensor-parallel ranks in another order
            assert outcome["max_logit_diff"] < 1e-5, (spec, outcome)
    sizes = {kind: sum(t.numel() * t.element_size() for t in build(kind).state_dict().values()) for kind in KINDS}
    for index, spec in enumerate(cases):
        read = [rank_values[index]["bytes_read"] for rank_values in values]
        if spec.get("mode") == "rank0":  # rank 0 reads the file once, the others nothing
            assert read[0] == sizes[spec["kind"]] and read[1:] == [0, 0, 0], (spec, read)
        else:  # every rank reads its own elements only: all four together read the file about once
            assert sum(read) <= 1.2 * sizes[spec["kind"]], (spec, read, sizes)
            assert max(read) <= 0.4 * sizes[spec["kind"]], (spec, read, sizes)


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# Checkpoints under tensor parallelism: sharded saves and loads across layouts, full exports, raw loads.
#
# Every body handles transformers' Llama and litgpt's GPT (both with grouped-query attention) in one launch.
# Expected values are written in the model's own layout (litgpt's ``qkv`` rows in ``[Q; K; V]`` order).


TOKENS = torch.arange(2 * 16).remainder(256).view(2, 16)


def save(
    num_nodes: int,
    devices: int,
    out: str,
    tensor_parallel_size: int,
    async_save: bool = False,
    full: bool = False,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Train 2 steps and save sharded (and, with ``full``, as one .pth and one .safetensors file).

    ``strategy_kwargs``: e.g. ``sequence_parallel=True``."""
    fabric = make_fabric(
        num_nodes, devices, tensor_parallel_size=tensor_parallel_size, async_save=async_save, **strategy_kwargs
    )
    facts = {}
    for kind in KINDS:
        model, optimizer, scheduler = setup_training(fabric, kind, empty_init=False, seed=0)
        train_steps(fabric, model, optimizer, scheduler, steps=2)
        expected = {
            "model": full_state(model),
            "optimizer": full_optimizer_state(model.module, optimizer.optimizer),
            "scheduler": scheduler.state_dict(),
        }
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "note": kind}
        fabric.save(Path(out) / f"{kind}-sharded", state)
        if full:
            fabric.strategy.save_full_checkpoint(Path(out) / f"{kind}-full.pth", state)
            fabric.save(Path(out) / f"{kind}-model.safetensors", {"model": model})
        if fabric.global_rank == 0:
            torch.save(expected, Path(out) / f"{kind}-expected.pt")
        facts[kind] = sorted(name for name, _ in model.module.named_parameters())
    fabric.strategy.wait_for_checkpoint()
    return facts


def load(
    num_nodes: int,
    devices: int,
    out: str,
    tensor_parallel_size: int,
    split_replica_reads: bool = False,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Load each saved checkpoint into a meta-initialised model on this layout; compare exactly with expected.

    Where ``save(full=True)`` also wrote the full checkpoint (``KIND-full.pth``, with optimizer state), it is loaded
    the same way (facts under ``KIND-full``).
    """
    fabric = make_fabric(
        num_nodes,
        devices,
        tensor_parallel_size=tensor_parallel_size,
        split_replica_reads=split_replica_reads,
        **strategy_kwargs,
    )
    facts = {}
    for kind in KINDS:
        for name in (f"{kind}-sharded", f"{kind}-full.pth"):
            if not (Path(out) / name).exists():
                continue
            model, optimizer, scheduler = setup_training(fabric, kind, empty_init=True, seed=99)
            state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
            remainder = fabric.load(Path(out) / name, state)
            expected = torch.load(Path(out) / f"{kind}-expected.pt", weights_only=False)
            actual = full_state(model)
            actual_optimizer = full_optimizer_state(model.module, optimizer.optimizer)
            facts[kind if name.endswith("sharded") else f"{kind}-full"] = {
                "model_equal": {key: torch.equal(actual[key], tensor) for key, tensor in expected["model"].items()},
                "optimizer_equal": {
                    f"{key}.{entry}": torch.equal(actual_optimizer[key][entry], value)
                    for key, entries in expected["optimizer"].items()
                    for entry, value in entries.items()
                },
                "scheduler_equal": scheduler.state_dict() == expected["scheduler"],
                "step": state["step"],
                "remainder": remainder,
                "mesh": tuple(fabric.strategy.device_mesh.shape),
            }
    return facts


def load_raw(
    num_nodes: int, devices: int, cases: list[dict[str, Any]], tensor_parallel_size: int = 2, **strategy_kwargs: Any
) -> list[dict]:
    """Each case: fill a meta-initialised model from a consolidated file; compare the gathered weights exactly.

    Also counts the tensor bytes each rank reads.
    """
    counter = ReadCounter()
    fabric = make_fabric(num_nodes, devices, tensor_parallel_size=tensor_parallel_size, **strategy_kwargs)
    results = []
    for case in cases:
        with fabric.init_module(empty_init=True):
            model = build(case["kind"], seed=123)
        model = fabric.setup_module(model)
        counter.bytes = 0
        if case.get("via_fabric_load"):
            fabric.load(case["file"], {"model": model})
        else:
            fabric.strategy.load_raw(case["file"], model, load_mode=case.get("mode"))
        read = counter.bytes
        expected = torch.load(case["reference"], weights_only=True)
        actual = full_state(model)
        with torch.no_grad():
            reference = build(case["kind"], seed=0)
            reference.load_state_dict(expected)
            difference = (logits_of(model, TOKENS) - logits_of(reference, TOKENS)).abs().max().item()
        dist.barrier()
        results.append(
            {
                "file": Path(case["file"]).name,
                "mode": case.get("mode"),
                "weights_equal": all(torch.equal(actual[name], tensor) for name, tensor in expected.items()),
                "unequal": [name for name, tensor in expected.items() if not torch.equal(actual[name], tensor)],
                "bytes_read": read,
                "max_logit_diff": difference,
            }
        )
    return results
