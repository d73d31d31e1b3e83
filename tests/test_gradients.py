"""``fabric.no_backward_sync`` under HSDP: between micro-batches each rank holds sharded gradients, not the whole
model's (the reduce-scatter runs every micro-batch; only the all-reduce across replicas waits)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import launch

pytestmark = pytest.mark.slow


def held_gradient_bytes(num_nodes: int, devices: int) -> dict:
    """One micro-batch's backward inside ``no_backward_sync``: the bytes of gradient FSDP2 holds on this rank."""
    from torch.distributed.fsdp import FSDPModule

    from tests.helpers.training import batch, build, layer_class, make_fabric

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    model = fabric.setup_module(build("llama"))
    inputs, targets = batch(2, seed=fabric.global_rank)
    with fabric.no_backward_sync(model, enabled=True):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        fabric.backward(loss)
    unsharded = sharded = 0
    groups = {}  # torch's internals: what FSDP2 keeps between backwards, once per unit (a unit may span modules)
    for unit in model.module.modules():
        if isinstance(unit, FSDPModule) and unit._get_fsdp_state()._fsdp_param_group is not None:
            group = unit._get_fsdp_state()._fsdp_param_group
            groups[id(group)] = group
    for group in groups.values():
        for param in group.fsdp_params:
            for grad in (param.unsharded_accumulated_grad, param._unsharded_param.grad):
                unsharded += grad.numel() * grad.element_size() if grad is not None else 0
        partial = group._partial_reduce_output  # reduce-scattered, waiting for the all-reduce across replicas
        sharded += partial.numel() * partial.element_size() if partial is not None else 0
        for param in group.fsdp_params:
            grad = param.sharded_param.grad
            sharded += grad.to_local().numel() * grad.element_size() if grad is not None else 0
    model_bytes = sum(p.numel() * 4 for p in model.parameters())  # fp32, the reduce dtype here
    return {"unsharded": unsharded, "sharded": sharded, "model_bytes": model_bytes}


def test_accumulating_micro_batches_holds_only_this_ranks_shard_of_the_gradients():
    values = launch("tests.test_gradients:held_gradient_bytes").check().values
    for facts in values:
        assert facts["unsharded"] == 0, facts  # Lightning's FSDP2 control: the whole model's gradients, every rank
        # each of the 2 ranks of a shard group holds its half (plus FSDP's padding of uneven rows)
        assert 0.5 * facts["model_bytes"] <= facts["sharded"] <= 0.55 * facts["model_bytes"], facts
