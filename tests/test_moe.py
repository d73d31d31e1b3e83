"""Training mixture-of-experts models under HSDP (#32 item 2): decoder layers as FSDP units (experts sharded by
expert), the router and its load-balancing loss, parity with one process; tensor parallelism refused clearly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import moe
from tests.helpers.launch import launch, launch_cases
from tests.helpers.parity import Trained, beyond_noise, distance, sampler_rows
from tests.helpers.training import batch, full_state, make_fabric

pytestmark = pytest.mark.slow

LEARNING_RATE = 1e-2
MICRO_BATCH = 2


def train(num_nodes: int, devices: int, kind: str, steps: int = 3) -> dict[str, Any]:
    """Train ``steps`` steps on HSDP with the strategy's default units; distances to one process and the floor."""
    from torch.distributed.fsdp import FSDPModule

    fabric = make_fabric(num_nodes, devices)  # default sharded_modules: the layers of the outermost ModuleLists
    model = fabric.setup_module(moe.build(kind, seed=0))
    units = sorted({type(m).__name__.removeprefix("FSDP") for m in model.module.modules() if isinstance(m, FSDPModule)})
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    replicas = fabric.strategy.distributed_sampler_kwargs["num_replicas"]
    inputs, targets = batch(MICRO_BATCH * replicas)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, targets), batch_size=MICRO_BATCH))
    losses, aux = [], []
    for _ in range(steps):
        (rows_in, rows_out), *rest = list(loader)
        assert not rest
        loss = moe.loss_of(model, rows_in, rows_out)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        if hasattr(model.config, "router_aux_loss_coef"):
            with torch.no_grad():
                aux.append(model(rows_in, output_router_logits=True).aux_loss.item())
    state = full_state(model)
    reference, reorderings = _one_process_orders(kind, inputs, targets, replicas, steps)
    floors = [distance(trained, reference) for trained in reorderings]
    return {
        "ours": distance(Trained(losses, [], state), reference),
        "floor": {what: max(floor[what] for floor in floors) for what in floors[0]},
        "floors": floors,
        "units": units,
        "aux_losses": aux,
        "expert_placements": sorted(
            {str(p.placements) for n, p in model.named_parameters() if "experts" in n and hasattr(p, "placements")}
        ),
    }


def _one_process_orders(
    kind: str, inputs: torch.Tensor, targets: torch.Tensor, replicas: int, steps: int
) -> tuple[Trained, list[Trained]]:
    """One process accumulating the ranks' batches in rank order (the reference) and reordered three ways: reversed,
    rotated by one, neighbours swapped (the same mathematics, other roundings: the floor is the largest of their
    distances, so one lucky rounding does not make it small). Each rank trains one order and all gather them: no more
    work per rank than the two orders each rank trained before."""
    import torch.distributed as dist

    rows = [sampler_rows(len(inputs), replicas, rank) for rank in range(replicas)]
    orders = [rows, rows[::-1], rows[1:] + rows[:1], [rows[index ^ 1] for index in range(len(rows))]]
    mine = [
        moe.train_one_process(kind, inputs, targets, orders[index], steps, LEARNING_RATE)[0]
        for index in range(dist.get_rank(), len(orders), dist.get_world_size())
    ]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    trained = [gathered[index % dist.get_world_size()][index // dist.get_world_size()] for index in range(len(orders))]
    return trained[0], trained[1:]


LAYERS = {"qwen3_moe": "Qwen3MoeDecoderLayer", "mixtral": "MixtralDecoderLayer", "litgpt_moe": "Block"}


@pytest.fixture(scope="module")
def trained_kinds() -> dict[str, list[dict[str, Any]]]:
    """Each kind's facts per rank, all from one launch (each test below reads its kind)."""
    return launch_cases(train, {kind: {"kind": kind} for kind in moe.KINDS}, timeout=480)


@pytest.mark.timeout(540)  # the launch of all kinds, when this test runs first
@pytest.mark.parametrize("kind", moe.KINDS)
def test_three_steps_match_one_process_with_each_rank_routing_its_own_batch(trained_kinds, kind):
    for rank, facts in enumerate(trained_kinds[kind]):
        assert not beyond_noise(facts["ours"], facts["floor"]), (rank, facts["ours"], facts["floor"])
        # each decoder layer is one unit with its experts inside (no expert a unit of its own), plus the
        # embedding, the norm + head and the root
        assert LAYERS[kind] in facts["units"] and "LLaMAMLP" not in facts["units"], facts["units"]
        assert facts["expert_placements"] == ["(Replicate(), Shard(dim=0))"], facts
        if kind != "litgpt_moe":  # the router's load-balancing loss is part of the loss trained
            assert len(facts["aux_losses"]) == 3 and all(value > 0 for value in facts["aux_losses"]), facts


def refuse_tensor_parallel(num_nodes: int, devices: int, kind: str) -> str:
    fabric = make_fabric(num_nodes, devices, tensor_parallel_size=2, sharded_modules={moe.layer_class(kind)})
    try:
        fabric.setup_module(moe.build(kind, seed=0))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_tensor_parallel_auto_plan_is_refused_saying_which_sizes_work():
    values = launch(refuse_tensor_parallel, {"kind": "qwen3_moe"}, timeout=90).check().values
    for message in values:
        assert "no plan for mixture-of-experts layers (model.layers.0.mlp.experts: Qwen3MoeExperts with 4" in message
        assert "tensor_parallel_size=1 works" in message, message
