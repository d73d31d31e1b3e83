"""Loads and checkpoints under expert parallelism (#41): a hub-layout directory loads raw with each rank reading only
its own experts, in every load mode, also where FSDP shards the experts too and a rank's box of experts is not in rank
order; sharded checkpoints resume across expert-parallel sizes, model and AdamW exactly; full exports hold the experts
whole, in the model's own layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import moe
from tests.helpers.counters import ReadCounter
from tests.helpers.launch import launch
from tests.helpers.training import batch, full_state, make_fabric

KIND = "qwen3_moe"  # 4 experts per layer
BODIES = "tests.checkpoint.test_expert_parallel_checkpoints"


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    return moe.save_hub(KIND, tmp_path_factory.mktemp("hub") / KIND)


# (nodes, ranks per node, shard_size): the first expert and the number of experts each rank holds at expert-parallel
# size 2. On 1 x 4 with shard_size="world" FSDP also splits the experts over expert_shard=2: rank 1 holds expert 2
# and rank 2 expert 1, whose boxes are not in rank order.
EXPERTS_BY_RANK = {
    (2, 2, "node"): [(0, 2), (2, 2), (0, 2), (2, 2)],
    (1, 4, "world"): [(0, 1), (2, 1), (1, 1), (3, 1)],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("layout", "modes", "split_replica_reads"),
    [
        ((2, 2, "node"), ["slice", "rank0", "turns", "fabric.load"], False),
        ((1, 4, "world"), ["slice", "rank0", "turns", "fabric.load"], False),
        ((2, 2, "node"), ["slice", "turns"], True),
    ],
    ids=["2x2-node", "1x4-world", "2x2-node-split-replica-reads"],
)
def test_hub_directory_loads_raw_at_expert_parallel_2_each_rank_reading_its_own_experts(
    hub_dir, layout, modes, split_replica_reads
):
    num_nodes, ranks_per_node, shard_size = layout
    args = {"path": str(hub_dir), "shard_size": shard_size, "modes": modes, "split_replica_reads": split_replica_reads}
    result = launch(f"{BODIES}:load_hub", args, num_nodes=num_nodes, ranks_per_node=ranks_per_node, timeout=200)
    values = result.check().values
    for rank, per_mode in enumerate(values):
        for outcome in per_mode:
            mode = outcome["mode"]
            assert outcome["weights_differ"] == [], (rank, mode)  # equal to transformers' own load, every tensor
            assert outcome["expert_rows"] == [EXPERTS_BY_RANK[layout][rank]], (rank, outcome)
            assert outcome["placements"] == ["(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"], outcome
            held = EXPERTS_BY_RANK[layout][rank][1]
            assert outcome["expert_bytes"] == held * outcome["one_expert_bytes"], outcome
            if mode == "rank0":  # rank 0 reads every tensor once, for everyone
                assert outcome["bytes_read"] == (outcome["model_bytes"] if rank == 0 else 0), (rank, outcome)
            elif split_replica_reads:  # each of the 2 replicas reads half of its shard, experts included
                assert outcome["bytes_read"] * 2 == outcome["own_bytes"], (rank, outcome)
            else:  # exactly its own shard's bytes: its experts and no other's
                assert outcome["bytes_read"] == outcome["own_bytes"], (rank, outcome)


def _differences(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are missing from ``actual`` or differ in any element."""
    return sorted(name for name, t in expected.items() if name not in actual or not torch.equal(actual[name], t))


@pytest.fixture(scope="module")
def saved_at_expert_parallel_2(tmp_path_factory) -> dict[str, Any]:
    """One AdamW step at expert-parallel size 2 on 2 x 2, saved sharded and as full files; what that run saw."""
    root = tmp_path_factory.mktemp("ep2")
    args = {"path": str(root / "sharded"), "shard_size": "node", "expert_parallel_size": 2, "full": str(root / "full")}
    values = launch(f"{BODIES}:train_and_save", args, timeout=200).check().values
    return {"root": root, "path": args["path"], "model": values[0]["model"], "optimizer": values[0]["optimizer"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("layout", "expert_parallel_size"),
    [((2, 2, "node"), 1), ((1, 4, "world"), 4)],
    ids=["2x2-expert-parallel-1", "1x4-expert-parallel-4"],
)
def test_sharded_save_at_expert_parallel_2_resumes_at_another_size_model_and_adamw_exactly(
    saved_at_expert_parallel_2, layout, expert_parallel_size
):
    saved = saved_at_expert_parallel_2
    assert {
        "model.layers.0.mlp.experts.gate_up_proj.exp_avg_sq",
        "model.layers.1.mlp.experts.down_proj.exp_avg",
    } <= set(saved["optimizer"])
    num_nodes, ranks_per_node, shard_size = layout
    args = {"path": saved["path"], "shard_size": shard_size, "expert_parallel_size": expert_parallel_size}
    resumed = launch(f"{BODIES}:resume", args, num_nodes=num_nodes, ranks_per_node=ranks_per_node, timeout=200)
    for rank, values in enumerate(resumed.check().values):
        assert values["step"] == 3
        assert sorted(values["model"]) == sorted(saved["model"])
        assert _differences(saved["model"], values["model"]) == [], rank
        assert sorted(values["optimizer"]) == sorted(saved["optimizer"])  # every moment, the experts' included
        assert _differences(saved["optimizer"], values["optimizer"]) == [], rank
        # each rank read its own shards of the model and the moments, experts included, and no other's
        assert values["bytes_read"] == values["state_bytes"], (rank, values["bytes_read"], values["state_bytes"])


@pytest.mark.timeout(240)
def test_sharded_save_at_expert_parallel_1_resumes_at_2_with_split_replica_reads(tmp_path):
    path = str(tmp_path / "sharded")
    args = {"path": path, "shard_size": "node", "expert_parallel_size": 1}
    saved = launch(f"{BODIES}:train_and_save", args, timeout=200).check().values[0]
    args = {"path": path, "shard_size": "node", "expert_parallel_size": 2, "split_replica_reads": True}
    for rank, values in enumerate(launch(f"{BODIES}:resume", args, timeout=200).check().values):
        assert values["step"] == 3 and values["expert_rows"] == [EXPERTS_BY_RANK[2, 2, "node"][rank]]
        assert _differences(saved["model"], values["model"]) == [], rank
        assert sorted(values["optimizer"]) == sorted(saved["optimizer"])
        assert _differences(saved["optimizer"], values["optimizer"]) == [], rank
        # each of the 2 replicas read half of its shards (AdamW's step counts, scalars, whole)
        scalars = values["scalar_bytes"]
        read, held = values["bytes_read"], values["state_bytes"]
        assert (read - scalars) * 2 == held - scalars, (rank, read, held, scalars)


@pytest.mark.timeout(240)
def test_full_exports_of_an_expert_parallel_model_hold_the_experts_whole(saved_at_expert_parallel_2, hub_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fabric_hsdp.checkpoint import convert_checkpoint

    saved, root = saved_at_expert_parallel_2, saved_at_expert_parallel_2["root"]
    full = torch.load(root / "full.pth", weights_only=True)
    assert full["step"] == 3
    assert {name: tuple(t.shape) for name, t in full["model"].items()} == {
        name: tuple(t.shape) for name, t in saved["model"].items()
    }
    assert full["model"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # [E, 2I, H], every expert
    assert _differences(saved["model"], full["model"]) == []
    moments = {f"{fqn}.{key}": t for fqn, entries in full["optimizer"]["state"].items() for key, t in entries.items()}
    assert _differences(saved["optimizer"], moments) == []
    assert _differences(saved["model"], load_file(root / "full.safetensors")) == []

    # the full .pth resumes at expert-parallel size 2 with the experts split over FSDP too, AdamW included
    args = {"path": str(root / "full.pth"), "shard_size": "world", "expert_parallel_size": 2}
    for rank, values in enumerate(launch(f"{BODIES}:resume", args, num_nodes=1, ranks_per_node=4).check().values):
        assert values["step"] == 3, rank
        assert _differences(saved["model"], values["model"]) == [], rank
        assert _differences(saved["optimizer"], values["optimizer"]) == [], rank

    # the sharded checkpoint converts to the hub's layout (one tensor per expert), which transformers loads
    export = root / "export"
    convert_checkpoint(saved["path"], export, to="safetensors", hf_config=hub_dir / "config.json", model_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info
    assert _differences(saved["model"], model.state_dict()) == []


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _expert_facts(model: Any) -> dict[str, Any]:
    """Which experts this rank holds (the first and how many, the same for every fused parameter), their bytes, one
    expert's bytes in all fused parameters, this rank's and the whole model's bytes, and the experts' placements."""
    from fabric_hsdp.versions import compute_local_shape_and_global_offset

    state, full = model.module.state_dict(), full_state(model)  # full_state gathers: every rank calls it
    experts = {name: t for name, t in state.items() if ".experts." in name}
    boxes = [compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements) for t in experts.values()]
    return {
        "expert_rows": sorted({(offsets[0], sizes[0]) for sizes, offsets in boxes}),
        "expert_bytes": _local_bytes(experts.values()),
        "one_expert_bytes": sum(full[name][0].nbytes for name in experts),
        "own_bytes": _local_bytes(state.values()),
        "model_bytes": sum(t.nbytes for t in full.values()),
        "placements": sorted({str(t.placements) for t in experts.values()}),
    }


def load_hub(
    num_nodes: int, devices: int, path: str, shard_size: Any, modes: list[str], split_replica_reads: bool
) -> list[dict[str, Any]]:
    """Per load mode (``"fabric.load"``: ``fabric.load(path, {"model": model})``, the strategy's default mode),
    meta-init at expert-parallel size 2 and load the hub-layout directory; what this rank read, and the tensors that
    differ from transformers' own load."""
    reference = moe.load_reference(KIND, path).state_dict()
    fabric = make_fabric(
        num_nodes, devices, shard_size=shard_size, expert_parallel_size=2, split_replica_reads=split_replica_reads
    )
    results = []
    for mode in modes:
        with fabric.init_module(empty_init=True):
            model = moe.build(KIND, seed=123)
        model = fabric.setup_module(model)
        counter = ReadCounter()
        if mode == "fabric.load":
            fabric.load(path, {"model": model})
        else:
            fabric.strategy.load_raw(path, model, load_mode=mode)
        read = counter.bytes
        state = full_state(model)
        differ = sorted(name for name, t in reference.items() if not torch.equal(state[name], t))
        results.append({"mode": mode, "bytes_read": read, "weights_differ": differ, **_expert_facts(model)})
    return results


def _optimizer_state(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every AdamW moment as a full tensor, by ``<parameter>.<moment>`` (gathered: every rank calls it)."""
    state = optimizer.optimizer.state
    return {
        f"{name}.{key}": (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu().clone()
        for name, param in model.module.named_parameters()
        for key, value in state[param].items()
        if isinstance(value, torch.Tensor) and value.ndim
    }


def train_and_save(
    num_nodes: int, devices: int, path: str, shard_size: Any, expert_parallel_size: int, full: str | None = None
) -> dict[str, Any]:
    """One AdamW step at ``expert_parallel_size`` (each rank its own rows), saved sharded to ``path`` (and by
    ``save_full_checkpoint`` to ``full``'s ``.pth`` and ``.safetensors``); the full model and AdamW state."""
    fabric = make_fabric(num_nodes, devices, shard_size=shard_size, expert_parallel_size=expert_parallel_size)
    model = fabric.setup_module(moe.build(KIND, seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    inputs, targets = batch(2 * fabric.world_size)
    rows = slice(2 * fabric.global_rank, 2 * fabric.global_rank + 2)
    fabric.backward(moe.loss_of(model, inputs[rows], targets[rows]))
    optimizer.step()
    optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    if full is not None:
        fabric.strategy.save_full_checkpoint(f"{full}.pth", {"model": model, "optimizer": optimizer, "step": 3})
        fabric.strategy.save_full_checkpoint(f"{full}.safetensors", {"model": model})
    return {"model": full_state(model), "optimizer": _optimizer_state(model, optimizer)}


def resume(
    num_nodes: int, devices: int, path: str, shard_size: Any, expert_parallel_size: int, split_replica_reads=False
) -> dict[str, Any]:
    """Meta-init at ``expert_parallel_size`` and ``fabric.load`` the checkpoint at ``path``; the full model and AdamW
    state, the bytes this rank read and those of its model and optimizer shards (of which scalars)."""
    fabric = make_fabric(
        num_nodes,
        devices,
        shard_size=shard_size,
        expert_parallel_size=expert_parallel_size,
        split_replica_reads=split_replica_reads,
    )
    with fabric.init_module(empty_init=True):
        model = moe.build(KIND, seed=123)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    counter = ReadCounter()
    fabric.load(path, state)
    read = counter.bytes
    moments = [t for entries in optimizer.optimizer.state.values() for t in entries.values()]
    return {
        "model": full_state(model),
        "optimizer": _optimizer_state(model, optimizer),
        "step": state["step"],
        "bytes_read": read,
        "state_bytes": _local_bytes(model.module.state_dict().values()) + _local_bytes(moments),
        "scalar_bytes": _local_bytes(t for t in moments if not t.ndim),
        **_expert_facts(model),
    }
