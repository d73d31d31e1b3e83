"""Expert parallelism (#41): each MoE layer's experts split over the expert dim, tokens exchanged all-to-all.

Tiny transformers MoE models (4 experts, top-2) on 2 simulated nodes x 2 ranks with ``expert_parallel_size=2``:
three steps of two accumulated micro-batches with activation checkpointing and gradient clipping, against one
process accumulating the same micro-batches (and against expert_parallel_size=1), by the suite's noise rule, the
first step's gradients (the experts' included) too. Routing forced to one rank's experts shows a rank that receives
no row still takes part in every collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import moe
from tests.helpers.counters import OpCounter
from tests.helpers.launch import launch, launch_cases
from tests.helpers.parity import Trained, beyond_noise, distance, gradient_distance, sampler_rows
from tests.helpers.training import batch, full_state, make_fabric

LEARNING_RATE = 1e-2
MICRO_BATCH = 2
ACCUMULATE = 2
MAX_NORM = 0.5
STEPS = 3
# the sharded run's first-step gradients may differ from one process's by this many times the distance between two
# one-process runs that differ only in the order of the micro-batches, and at least by MIN_GRADIENT (fp32 rounding)
GRADIENT_NOISE_FACTOR, MIN_GRADIENT = 10, 1e-6


def _gathered_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad).detach().clone()
        for name, param in model.module.named_parameters()
    }


def _train_sharded(fabric: Any, kind: str, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Train STEPS steps of ACCUMULATE micro-batches; the trained state, first gradients and the all-to-alls that
    one micro-batch's backward ran."""
    model = fabric.setup_module(moe.build(kind, seed=0))
    # foreach (CUDA's default) over parameters of two meshes: the dense (replicate, shard) and the experts' 3-D one
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=True))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, targets), batch_size=MICRO_BATCH))
    losses, norms, gradients = [], [], {}
    for step in range(STEPS):
        micro_batches = list(loader)
        assert len(micro_batches) == ACCUMULATE
        step_loss = torch.zeros(())
        for index, (rows_in, rows_out) in enumerate(micro_batches):
            with fabric.no_backward_sync(model, enabled=index < ACCUMULATE - 1):
                loss = moe.loss_of(model, rows_in, rows_out)
                fabric.backward(loss / ACCUMULATE)
            step_loss += loss.detach() / ACCUMULATE
        if step == 0:
            gradients = _gathered_gradients(model)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(step_loss, reduce_op="mean").item())
    loss = moe.loss_of(model, *micro_batches[0])
    with OpCounter() as counter:
        fabric.backward(loss)
    optimizer.zero_grad()
    trained = Trained(losses, norms, full_state(model))
    return {"trained": trained, "gradients": gradients, "all_to_alls_in_backward": counter.counts["all_to_all_single"]}


VARIANTS = {
    "ep2 full": {"expert_parallel_size": 2, "activation_checkpointing_mode": "full"},
    "ep2 selective": {"expert_parallel_size": 2, "activation_checkpointing_mode": "selective"},
    "ep1 full": {"expert_parallel_size": 1, "activation_checkpointing_mode": "full"},
}


def train(num_nodes: int, devices: int, kind: str) -> dict[str, Any]:
    """Each variant against one process; the floor: one process with the micro-batches in reverse order."""
    layers = {moe.layer_class(kind)}
    fabrics = {
        label: make_fabric(num_nodes, devices, activation_checkpointing=layers, **options)
        for label, options in VARIANTS.items()
    }
    replicas = fabrics["ep2 full"].strategy.distributed_sampler_kwargs["num_replicas"]
    inputs, targets = batch(MICRO_BATCH * ACCUMULATE * replicas)
    micro_batches = [
        rows[start : start + MICRO_BATCH]
        for rank in range(replicas)
        for rows in [sampler_rows(len(inputs), replicas, rank)]
        for start in range(0, len(rows), MICRO_BATCH)
    ]
    options = {"steps": STEPS, "learning_rate": LEARNING_RATE, "max_norm": MAX_NORM}
    reference, exact = moe.train_one_process(kind, inputs, targets, micro_batches, **options)
    reversed_order, reversed_gradients = moe.train_one_process(kind, inputs, targets, micro_batches[::-1], **options)
    gradient_floor = gradient_distance(reversed_gradients, exact)["value"]
    facts: dict[str, Any] = {"floor": distance(reversed_order, reference), "gradient_floor": gradient_floor}
    for label, fabric in fabrics.items():
        run = _train_sharded(fabric, kind, inputs, targets)
        facts[label] = {
            "distance": distance(run["trained"], reference),
            "gradients": gradient_distance(run["gradients"], exact),
            "all_to_alls_in_backward": run["all_to_alls_in_backward"],
        }
    return facts


@pytest.fixture(scope="module")
def trained_kinds() -> dict[str, list[dict[str, Any]]]:
    """Each kind's facts per rank, all from one launch (each test below reads its kind)."""
    return launch_cases(train, {kind: {"kind": kind} for kind in moe.FUSED_KINDS}, timeout=480)


@pytest.mark.slow
@pytest.mark.timeout(540)  # the launch of all kinds, when this test runs first
@pytest.mark.parametrize("kind", moe.FUSED_KINDS)
def test_three_steps_with_accumulation_and_recompute_match_one_process(trained_kinds, kind):
    for rank, facts in enumerate(trained_kinds[kind]):
        gradient_tolerance = max(GRADIENT_NOISE_FACTOR * facts["gradient_floor"], MIN_GRADIENT)
        for label in VARIANTS:
            run = facts[label]
            assert not beyond_noise(run["distance"], facts["floor"]), (rank, label, run, facts["floor"])
            # the worst tensor of the first step's gradients, experts included, relative to the global norm
            assert run["gradients"]["value"] <= gradient_tolerance, (rank, label, run["gradients"], gradient_tolerance)
        # backward of one micro-batch, per MoE layer: the two row exchanges mirrored (2), plus under full recompute
        # the forward's three again (counts, rows there, rows back); selective keeps the forward's outputs
        assert facts["ep2 full"]["all_to_alls_in_backward"] == 2 * 5, facts
        assert facts["ep2 selective"]["all_to_alls_in_backward"] == 2 * 2, facts
        assert facts["ep1 full"]["all_to_alls_in_backward"] == 0, facts


@contextmanager
def _routing_to_first_experts(model: torch.nn.Module) -> Iterator[None]:
    """Every token routed to experts 0 and 1 (rank 0's of the expert group), the routing weights kept."""

    def force(module: torch.nn.Module, args: Any, output: tuple) -> tuple:
        logits, weights, index = output
        return logits, weights, torch.stack([torch.zeros_like(index[:, 0]), torch.ones_like(index[:, 1])], dim=-1)

    routers = [sub for name, sub in model.named_modules() if name.endswith("mlp.gate")]
    handles = [router.register_forward_hook(force) for router in routers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _built(kind: str, experts_implementation: str) -> torch.nn.Module:
    model = moe.build(kind, seed=0)
    model.config._experts_implementation = experts_implementation  # what from_pretrained(experts_implementation=) sets
    return model


def one_rank_gets_every_token(num_nodes: int, devices: int, kind: str, implementation: str) -> dict[str, Any]:
    """One step with every token routed to the first rank's experts: the second rank receives no row."""
    fabric = make_fabric(num_nodes, devices, expert_parallel_size=2)
    model = fabric.setup_module(_built(kind, implementation))
    replicas = fabric.strategy.distributed_sampler_kwargs["num_replicas"]
    inputs, targets = batch(MICRO_BATCH * replicas)
    rows = sampler_rows(len(inputs), replicas, fabric.global_rank)
    with _routing_to_first_experts(model):
        fabric.backward(moe.loss_of(model, inputs[rows], targets[rows]))
    gradients = _gathered_gradients(model)
    reference = _built(kind, implementation)
    with _routing_to_first_experts(reference):
        for rank in range(replicas):
            rows = sampler_rows(len(inputs), replicas, rank)
            (moe.loss_of(reference, inputs[rows], targets[rows]) / replicas).backward()
    exact = {name: param.grad for name, param in reference.named_parameters() if param.grad is not None}
    unused = sorted(name for name, param in reference.named_parameters() if param.grad is None)
    return {"gradients": gradient_distance(gradients, exact), "unused": unused}


# transformers' experts forwards: eager loops over the experts that got rows (none: no use of the weights), grouped_mm
# multiplies by all of them
IMPLEMENTATIONS = ["eager", "grouped_mm"]


@pytest.fixture(scope="module")
def routed_to_one_rank() -> dict[str, list[dict[str, Any]]]:
    """Each experts implementation's facts per rank, both from one launch."""
    cases = {name: {"kind": "qwen3_moe", "implementation": name} for name in IMPLEMENTATIONS}
    return launch_cases(one_rank_gets_every_token, cases, timeout=150)


@pytest.mark.timeout(180)  # the launch of both, when this test runs first
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_rank_whose_experts_get_no_token_takes_part_and_gets_zero_gradients(routed_to_one_rank, implementation):
    for facts in routed_to_one_rank[implementation]:
        assert facts["gradients"]["value"] < 1e-6, facts


def _two_experts(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = moe.config(kind)
    config.num_experts = 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def rows_of_each_expert(num_nodes: int, devices: int, kind: str) -> dict[str, Any]:
    """2 experts at expert_parallel_size=2 over 4 ranks of one node: expert shards of 2 ranks, one expert each, so
    FSDP splits each expert's rows; sharded_modules names the experts class too (they are a unit already)."""
    experts_class = type(_two_experts(kind).model.layers[0].mlp.experts)
    sharded = {moe.layer_class(kind), experts_class}
    fabric = make_fabric(num_nodes, devices, shard_size="world", expert_parallel_size=2, sharded_modules=sharded)
    model = fabric.setup_module(_two_experts(kind))
    inputs, targets = batch(MICRO_BATCH * fabric.world_size)
    rows = sampler_rows(len(inputs), fabric.world_size, fabric.global_rank)
    fabric.backward(moe.loss_of(model, inputs[rows], targets[rows]))
    gradients = _gathered_gradients(model)
    reference = _two_experts(kind)
    for rank in range(fabric.world_size):
        rows = sampler_rows(len(inputs), fabric.world_size, rank)
        (moe.loss_of(reference, inputs[rows], targets[rows]) / fabric.world_size).backward()
    exact = {name: param.grad for name, param in reference.named_parameters()}
    experts = model.module.model.layers[0].mlp.experts
    return {
        "gradients": gradient_distance(gradients, exact),
        "placements": str(experts.gate_up_proj.placements),
        "local": list(experts.gate_up_proj.to_local().shape),
    }


@pytest.mark.timeout(120)
def test_experts_split_by_rows_where_expert_shards_outnumber_a_ranks_experts():
    launched = launch(rows_of_each_expert, {"kind": "qwen3_moe"}, num_nodes=1,
                      ranks_per_node=4, timeout=90)  # fmt: skip
    for facts in launched.check().values:
        assert facts["gradients"]["value"] < 1e-6, facts
        # one expert of [2, 64, 64] per expert rank, its 64 rows halved over the expert shard: [1, 32, 64]
        assert facts["placements"] == "(Replicate(), Shard(dim=1), Shard(dim=0))", facts
        assert facts["local"] == [1, 32, 64], facts


def _cross_entropy(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(moe.logits_of(model, inputs).float().flatten(0, 1), targets.flatten())


def first_gradients(num_nodes: int, devices: int, kind: str, variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One micro-batch per rank under each variant's strategy arguments: the first step's gradients and loss
    (cross-entropy), to the one-process fp32 model's."""
    replicas = num_nodes * devices
    inputs, targets = batch(MICRO_BATCH * replicas)
    reference = moe.build(kind, seed=0)
    reference_loss = 0.0
    for rank in range(replicas):
        rows = sampler_rows(len(inputs), replicas, rank)
        loss = _cross_entropy(reference, inputs[rows], targets[rows]) / replicas
        loss.backward()
        reference_loss += loss.item()
    exact = {name: param.grad for name, param in reference.named_parameters()}
    facts = {}
    for label, options in variants.items():
        fabric = make_fabric(num_nodes, devices, **options)
        model = fabric.setup_module(moe.build(kind, seed=0))
        rows = sampler_rows(len(inputs), replicas, fabric.global_rank)
        loss = _cross_entropy(model, inputs[rows], targets[rows])
        fabric.backward(loss)
        mean = fabric.all_reduce(loss.detach().float(), reduce_op="mean").item()
        facts[label] = {
            "gradients": gradient_distance(_gathered_gradients(model), exact),
            "loss": abs(mean - reference_loss) / reference_loss,
            "experts_class": type(model.module.model.layers[0].mlp.experts).__name__,
        }
    return facts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_blocks_and_bf16_mixed_under_expert_parallelism():
    variants = {
        "ep2 compiled": {"expert_parallel_size": 2, "compile": True},
        "ep2 bf16": {"expert_parallel_size": 2, "precision": "bf16-mixed"},
        "ep1 bf16": {"expert_parallel_size": 1, "precision": "bf16-mixed"},
    }
    args = {"kind": "qwen3_moe", "variants": variants}
    for facts in launch(first_gradients, args, timeout=240).check().values:
        # each block compiled, the experts' exchange left eager inside it: fp32 gradients as one process's
        assert facts["ep2 compiled"]["experts_class"] == "FSDPExpertParallelQwen3MoeExperts", facts
        assert facts["ep2 compiled"]["gradients"]["value"] < MIN_GRADIENT, facts
        # bf16 compute against fp32: no further from it than FSDP alone in bf16 (measured in this launch; the
        # routing weights multiply in fp32 under EP, in bf16 in the model's own forward)
        floor = facts["ep1 bf16"]["gradients"]["value"]
        assert facts["ep2 bf16"]["gradients"]["value"] <= 1.5 * floor, facts
        assert facts["ep2 bf16"]["loss"] <= 1e-3, facts


class _Mesh:
    """As much of a DeviceMesh as the refusals read: its size (they run before any collective)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_refusals_name_the_layer_and_what_works():
    from fabric_hsdp.expert_parallel import apply_expert_parallel
    from tests.helpers.training import tiny_hf_llama

    with pytest.raises(ValueError, match=r"expert_parallel_size=2\) splits mixture-of-experts layers, but"
                       r" LlamaForCausalLM has no module named 'experts'"):  # fmt: skip
        apply_expert_parallel(tiny_hf_llama(), _Mesh(2))
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.experts \(ModuleList\) holds its experts as a list of"
                       r" modules .* expert_parallel_size=1 works"):  # fmt: skip
        apply_expert_parallel(moe.build("litgpt_moe"), _Mesh(2))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(Qwen3MoeExperts\) holds 4 experts, which do"
                       r" not divide by expert_parallel_size\(3\)"):  # fmt: skip
        apply_expert_parallel(moe.build("qwen3_moe"), _Mesh(3))

    class Experts(torch.nn.Module):  # fused, but rows already dispatched to it (Llama 4's TextExperts' forward)
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 4))

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states

    layer = torch.nn.Module()
    layer.experts = Experts()
    unknown = r"experts \(Experts\) is not an experts module expert parallelism knows: its forward takes"
    with pytest.raises(ValueError, match=unknown + r" \('hidden_states',\), not the \(hidden_states, top_k_index"):
        apply_expert_parallel(layer, _Mesh(2))


def test_lora_on_the_experts_is_refused_with_the_reason():
    from peft import LoraConfig, get_peft_model

    from fabric_hsdp.expert_parallel import apply_expert_parallel

    # peft's LoRA on the fused expert parameters (target_parameters), beside the attention's
    config = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    model = get_peft_model(moe.build("qwen3_moe"), config)
    with pytest.raises(ValueError, match=r"experts .* carries LoRA adapters.* target_modules without the experts"):
        apply_expert_parallel(model, _Mesh(2))
    # adapters on the attention only: the experts split
    attention_only = get_peft_model(moe.build("qwen3_moe"), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(AttributeError):  # past the checks: the stand-in mesh has no ranks to split over
        apply_expert_parallel(attention_only, _Mesh(2))
