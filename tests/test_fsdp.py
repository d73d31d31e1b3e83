import pytest
import torch

from fabric_hsdp.setup.fsdp import offload_policy


def test_cpu_offload_on_a_cpu_device_is_refused_with_the_fix():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    with pytest.raises(ValueError, match=r"cpu_offload=True\) moves the shards .* Drop cpu_offload, or run on GPUs"):
        offload_policy(True, torch.device("cpu"))
    assert isinstance(offload_policy(True, torch.device("cuda", 0)), CPUOffloadPolicy)
    assert type(offload_policy(False, torch.device("cpu"))) is OffloadPolicy


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"])
def test_fsdp_policy_and_planner_read_one_precision_table(precision):
    """What FSDP2 gathers and reduces in is what the planner counts bytes for (one table behind both)."""
    from fabric_hsdp.planning.memory import Training
    from fabric_hsdp.setup.fsdp import mixed_precision_policy

    policy, training = mixed_precision_policy(precision), Training(precision)
    model_dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
    state = model_dtype.get(precision, torch.float32)  # "true" precisions build the model in their dtype
    compute, reduce = policy.param_dtype or state, policy.reduce_dtype or state
    assert (training.state_bytes, training.compute_bytes, training.reduce_bytes) == (
        state.itemsize,
        compute.itemsize,
        reduce.itemsize,
    )
    if precision.endswith("-mixed"):
        assert compute == {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
        assert reduce == torch.float32


def test_an_unknown_precision_is_refused_naming_the_ones_that_work():
    from fabric_hsdp.setup.fsdp import mixed_precision_policy

    with pytest.raises(ValueError, match=r"precision='8-true'\)\. Choose one of: 32-true, bf16-mixed, 16-mixed"):
        mixed_precision_policy("8-true")


def forward_without_gradients_first(num_nodes: int, devices: int, reshard_after_forward: bool | None) -> dict:
    """A loss under ``torch.no_grad()`` right after ``setup_module``, then the optimizer from ``model.parameters()``
    and two training steps; also a no-grad forward between steps."""
    from torch.distributed.tensor import DTensor

    from tests.helpers.training import batch, build, layer_class, make_fabric

    fabric = make_fabric(
        num_nodes, devices, sharded_modules={layer_class("llama")}, reshard_after_forward=reshard_after_forward
    )
    model = fabric.setup_module(build("llama"))
    inputs, targets = batch(2, seed=fabric.global_rank)
    with torch.no_grad():
        model(inputs)  # e.g. the loss before training, or generate()
    plain_after_eval = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():
            model(inputs)
    plain_after_steps = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    return {"plain_after_eval": plain_after_eval, "plain_after_steps": plain_after_steps, "losses": losses}


RESHARD_AFTER_FORWARD = [None, False]


@pytest.fixture(scope="module")
def forwards_without_gradients() -> dict[str, list[dict]]:
    """Each ``reshard_after_forward``'s facts per rank, both from one launch."""
    from tests.helpers.launch import launch_cases

    cases = {str(value): {"reshard_after_forward": value} for value in RESHARD_AFTER_FORWARD}
    return launch_cases(forward_without_gradients_first, cases, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("reshard_after_forward", RESHARD_AFTER_FORWARD)
def test_a_forward_without_gradients_leaves_the_model_sharded(forwards_without_gradients, reshard_after_forward):
    """#35 item 4: the root unit (and units that keep parameters after forward) stayed gathered after a no-grad
    forward, so an optimizer made then held unsharded tensors and setup_optimizers refused it."""
    for facts in forwards_without_gradients[str(reshard_after_forward)]:
        assert facts["plain_after_eval"] == [] and facts["plain_after_steps"] == [], facts
        assert facts["losses"][1] < facts["losses"][0]


def units_and_gathered_bytes(num_nodes: int, devices: int, kind: str) -> dict:
    """The FSDP units of the model, and the parameter bytes left gathered after a forward (before its backward)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from tests.helpers.training import batch, build, layer_class, logits_of, make_fabric

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class(kind)})
    model = fabric.setup_module(build(kind))
    units = [name for name, sub in model.module.named_modules() if isinstance(sub, FSDPModule)]
    inputs, _ = batch(2)
    logits = logits_of(model, inputs)
    named = model.module.named_parameters()
    gathered = {name: p.numel() * p.element_size() for name, p in named if not isinstance(p, DTensor)}
    logits.float().sum().backward()
    return {"units": units, "gathered": gathered}


UNITS = {  # (FSDP2 marks both modules of the norm + head unit)
    "llama": (["", "tok_embeddings", "layers.0", "layers.1", "norm", "output"], ["norm.weight", "output.weight"]),
    "litgpt": (
        ["", "lm_head", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f"],
        ["lm_head.weight", "transformer.ln_f.weight"],
    ),
    "hf": (
        ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
        ["lm_head.weight", "model.norm.weight"],
    ),
}


@pytest.fixture(scope="module")
def units_of_each_kind() -> dict[str, list[dict]]:
    """Each kind's units and gathered bytes per rank (1 node x 2 ranks), all from one launch."""
    from tests.helpers.launch import launch_cases

    cases = {kind: {"kind": kind} for kind in sorted(UNITS)}
    return launch_cases(units_and_gathered_bytes, cases, num_nodes=1, ranks_per_node=2, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(UNITS))
def test_embedding_and_head_are_units_of_their_own_so_the_embedding_is_freed_after_its_forward(
    units_of_each_kind, kind
):
    """#35 item 7: in the root unit the embedding, final norm and head stayed gathered through the whole step."""
    units, gathered = UNITS[kind]
    for facts in units_of_each_kind[kind]:
        assert facts["units"] == units
        # after the forward only the last unit (final norm + head, which the backward starts with) is gathered
        assert sorted(facts["gathered"]) == gathered, facts["gathered"]
