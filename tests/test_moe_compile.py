"""``compile=True`` on a transformers 5 MoE model trained with its router's load-balancing loss.

transformers records the router logits that ``output_router_logits=True`` adds up by forward hooks that read a
context variable; traced in a compiled block they read nothing (``fabric_hsdp.setup.compile.eager_call_class``). Two
SGD steps with the aux loss on 2 simulated nodes x 2 ranks, the blocks compiled, with and without expert
parallelism, against one eager process: the aux loss, the loss and the first step's gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import moe
from tests.helpers.launch import launch
from tests.helpers.parity import gradient_distance, sampler_rows
from tests.helpers.training import batch, make_fabric

MICRO_BATCH = 2
STEPS = 2
LEARNING_RATE = 0.1
# fp32 rounding, relative to the global norm of the gradients, as tests/test_expert_parallel.py's MIN_GRADIENT
MIN_GRADIENT = 1e-6
VARIANTS = {"ep1": {"expert_parallel_size": 1}, "ep2": {"expert_parallel_size": 2}}


def _losses(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss (cross-entropy plus the weighted aux loss, as ``moe.loss_of``) and the aux loss."""
    out = model(inputs, output_router_logits=True)
    cross_entropy = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    return cross_entropy + model.config.router_aux_loss_coef * out.aux_loss, out.aux_loss


def train(num_nodes: int, devices: int, kind: str) -> dict[str, Any]:
    """Each variant's losses, aux losses and first gradients to one eager process averaging the ranks' rows."""
    from tests.test_expert_parallel import _gathered_gradients

    replicas = num_nodes * devices
    inputs, targets = batch(MICRO_BATCH * replicas)
    reference = moe.build(kind, seed=0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LEARNING_RATE)
    expected: dict[str, list[float]] = {"loss": [], "aux": []}
    for step in range(STEPS):
        loss_sum = aux_sum = 0.0
        for rank in range(replicas):
            rows = sampler_rows(len(inputs), replicas, rank)
            loss, aux = _losses(reference, inputs[rows], targets[rows])
            (loss / replicas).backward()
            loss_sum, aux_sum = loss_sum + loss.item() / replicas, aux_sum + aux.item() / replicas
        if step == 0:
            exact = {name: param.grad.clone() for name, param in reference.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        expected["loss"].append(loss_sum)
        expected["aux"].append(aux_sum)
    facts: dict[str, Any] = {"expected": expected}
    for label, options in VARIANTS.items():
        fabric = make_fabric(num_nodes, devices, compile=True, **options)
        model = fabric.setup_module(moe.build(kind, seed=0))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LEARNING_RATE))
        rows = sampler_rows(len(inputs), replicas, fabric.global_rank)
        got: dict[str, Any] = {"loss": [], "aux": []}
        for step in range(STEPS):
            loss, aux = _losses(model, inputs[rows], targets[rows])
            fabric.backward(loss)
            if step == 0:
                got["gradients"] = gradient_distance(_gathered_gradients(model), exact)
            optimizer.step()
            optimizer.zero_grad()
            got["loss"].append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
            got["aux"].append(fabric.all_reduce(aux.detach(), reduce_op="mean").item())
        facts[label] = got
    return facts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_blocks_train_with_the_router_aux_loss_as_one_eager_process():
    values = launch(train, {"kind": "qwen3_moe"}, timeout=240).check().values
    for rank, facts in enumerate(values):
        expected = facts["expected"]
        for label in VARIANTS:
            got = facts[label]
            assert got["aux"] == pytest.approx(expected["aux"], rel=1e-5), (rank, label, got, expected)
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5), (rank, label, got, expected)
            # the worst tensor of the first step's gradients, experts and routers included, relative to the global norm
            assert got["gradients"]["value"] < MIN_GRADIENT, (rank, label, got["gradients"])
