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
    values = launch(held_gradient_bytes).check().values
    for facts in values:
        assert facts["unsharded"] == 0, facts  # Lightning's FSDP2 control: the whole model's gradients, every rank
        # each of the 2 ranks of a shard group holds its half (plus FSDP's padding of uneven rows)
        assert 0.5 * facts["model_bytes"] <= facts["sharded"] <= 0.55 * facts["model_bytes"], facts


def gathers_while_accumulating(num_nodes: int, devices: int, accumulate: int, layout: dict) -> dict:
    """One optimizer step of ``accumulate`` micro-batches, with and without ``keep_gathered_while_accumulating``
    (:func:`_one_step`); then parity with one process (3 steps) with the option on. ``layout``: more strategy
    arguments (the shard group, tensor parallelism)."""
    from tests.helpers.parity import _parity
    from tests.helpers.training import layer_class, make_fabric

    facts = {}
    for keep in (False, True):
        fabric = make_fabric(
            num_nodes, devices, sharded_modules={layer_class("llama")}, keep_gathered_while_accumulating=keep, **layout
        )
        facts[keep] = _one_step(fabric, accumulate)
    options = dict(steps=3, accumulate=accumulate, clip=None, setup_together=False, bugs=[])
    facts["parity"] = _parity(fabric, "llama", **options)  # the last fabric: keep_gathered_while_accumulating=True
    return facts


def _one_step(fabric, accumulate: int) -> dict:
    """FSDP2's all-gathers in each micro-batch's forward and backward, whether each forward found the first layer
    gathered, and whether the step ended with every unit sharded."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from tests.helpers.training import batch, build, layer_class

    model = fabric.setup_module(build("llama"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    first = next(sub for sub in model.module.modules() if isinstance(sub, layer_class("llama")))
    found_gathered: list[bool] = []
    # prepended: runs before FSDP2's own pre-forward hook gathers the layer
    hook = first.register_forward_pre_hook(
        lambda module, args: found_gathered.append(module._get_fsdp_state()._fsdp_param_group.is_unsharded),
        prepend=True,
    )
    gathers, per_micro_batch = [0], []
    all_gather = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        gathers[0] += 1
        return all_gather(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        for micro in range(accumulate):
            inputs, targets = batch(2, seed=10 * fabric.global_rank + micro)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                before = gathers[0]
                loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                in_forward = gathers[0] - before
                fabric.backward(loss / accumulate)
                per_micro_batch.append((in_forward, gathers[0] - before - in_forward))
        optimizer.step()
        optimizer.zero_grad()
    finally:
        _fsdp_param_group.foreach_all_gather = all_gather
        hook.remove()
    groups = [
        unit._get_fsdp_state()._fsdp_param_group for unit in model.module.modules() if isinstance(unit, FSDPModule)
    ]
    return {
        "gathers": per_micro_batch,
        "found_gathered": found_gathered,
        "sharded_at_the_end": all(not group.is_unsharded for group in groups if group is not None),
    }


@pytest.mark.parametrize(
    "layout",
    [{}, {"shard_size": "world", "tensor_parallel_size": 2}],
    ids=["hsdp-2x2", "fsdp-over-nodes-tp2"],
)
def test_kept_gathered_weights_are_gathered_once_per_step_and_train_as_one_process(layout):
    from tests.helpers.parity import beyond_noise

    accumulate = 3
    arguments = {"accumulate": accumulate, "layout": layout}
    values = launch(gathers_while_accumulating, arguments).check().values
    for facts in values:
        resharded, kept = facts[False], facts[True]
        # FSDP2's default: every micro-batch gathers the units in its forward, and the layers (resharded after
        # forward) again in its backward
        (forward, backward), *later = resharded["gathers"]
        assert forward > 0 and backward > 0 and later == [(forward, backward)] * (accumulate - 1), resharded
        assert resharded["found_gathered"] == [False] * accumulate
        # kept gathered: the first forward's gathers are the step's only ones, whatever the accumulation; every
        # later micro-batch finds the layers gathered
        assert kept["gathers"] == [(forward, 0)] + [(0, 0)] * (accumulate - 1), kept
        assert kept["found_gathered"] == [False] + [True] * (accumulate - 1)
        # the last backward (outside no_backward_sync) reshards: the optimizer stepped sharded parameters
        assert resharded["sharded_at_the_end"] and kept["sharded_at_the_end"]
        assert not beyond_noise(facts["parity"]["ours"], facts["parity"]["floor"]), facts["parity"]


def test_kept_gathered_weights_refuse_resharding_after_forward():
    from fabric_hsdp import HybridFSDPStrategy

    with pytest.raises(ValueError, match=r"keep_gathered_while_accumulating=True, reshard_after_forward=True\) asks"):
        HybridFSDPStrategy(keep_gathered_while_accumulating=True, reshard_after_forward=True)
    with pytest.raises(ValueError, match=r"keep_gathered_while_accumulating='yes'\) is not valid"):
        HybridFSDPStrategy(keep_gathered_while_accumulating="yes")
    strategy = HybridFSDPStrategy(keep_gathered_while_accumulating=True)
    assert strategy._levers.reshard_after_forward is False and strategy._backward_sync_control.keep_gathered
