"""HybridFSDPStrategy on 2 simulated nodes x 2 CPU ranks (gloo), in real processes."""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fabric_hsdp import HybridFSDPStrategy
from tests.helpers.launch import launch, launch_cases
from tests.helpers.parity import BUGS, beyond_noise, parity
from tests.helpers.training import batch, build, copy_full_into, layer_class, logits_of, make_fabric

pytestmark = pytest.mark.slow

LAYER_PARAMS = "layers.0.feed_forward.w1.weight"  # [96, 64] in the tiny model


KINDS = ["llama", "litgpt", "hf"]
SHARD_SIZES = [4, "world"]


@pytest.fixture(scope="module")
def placed() -> dict[str, list[dict[str, Any]]]:
    """:func:`placements` of each kind (shard_size="node") and each shard size (llama), per rank, from one launch."""
    cases = {
        **{kind: {"kind": kind} for kind in KINDS},
        **{f"shard_size={size}": {"shard_size": size} for size in SHARD_SIZES},
    }
    return launch_cases(placements, cases, timeout=300)


@pytest.mark.timeout(360)  # the launch of all cases, when this test runs first
@pytest.mark.parametrize("kind", KINDS)
def test_hsdp_mesh_placements_and_meta_init(placed, kind):
    for rank, facts in enumerate(placed[kind]):
        assert facts["mesh_shape"] == (2, 2)
        assert facts["mesh_dim_names"] == ("replicate", "shard")
        assert facts["mesh_coordinate"] == facts["coordinates"] == (rank // 2, rank % 2)
        assert facts["on_meta_before"] and facts["buffers_real_before"]
        assert facts["all_dtensor"] and facts["shards_finite"]
        assert len(facts["norms_are_ones"]) == 5 and all(facts["norms_are_ones"])  # 2 per layer + final norm
        assert set(facts["placements"].values()) == {("R", "S(0)")}
        for name, shape in facts["global_shapes"].items():
            assert facts["local_shapes"][name] == (shape[0] // 2, *shape[1:]), name
        assert facts["devices"] == {"cpu"}
        # RoPE caches (litgpt cos/sin, HF inv_freq, ours) computed in __init__ survive meta init exactly
        assert facts["buffers_equal"] and all(facts["buffers_equal"].values()), facts["buffers_equal"]
        # weights copied in -> logits equal a model built normally
        assert facts["max_logit_diff"] == 0.0
        assert facts["sampler"] == {"num_replicas": 4, "rank": rank}


def test_init_gives_distinct_shards_and_identical_replicas_with_per_rank_seeds():
    for facts in launch(init_consistency).check().values:
        for case, values in facts.items():
            assert values["halves_differ"], (case, facts)
            assert values["replicas_differ"] == [] and values["checked"] == 22, (case, facts)  # 21 parameters, 1 buffer
            # nn.Linear's kaiming-uniform init of a [96, 64] weight: std = 1/sqrt(3 * 64)
            assert values["std"] == pytest.approx(64**-0.5 / 3**0.5, rel=0.1)


@pytest.mark.timeout(360)  # the launch of all cases, when this test runs first
@pytest.mark.parametrize("shard_size", SHARD_SIZES)
def test_full_shard_over_world(placed, shard_size):
    for rank, facts in enumerate(placed[f"shard_size={shard_size}"]):
        assert facts["mesh_shape"] == (1, 4)
        assert facts["mesh_coordinate"] == (0, rank)
        assert facts["local_shapes"][LAYER_PARAMS] == (24, 64)


def test_invalid_shard_size_fails_every_rank_with_the_arithmetic():
    # each rank's own traceback (tests/test_errors.py: without FABRIC_HSDP_DEBUG, rank 0 says it in one line)
    result = launch(bad_shard_size, {"shard_size": 3}, timeout=120, env={"FABRIC_HSDP_DEBUG": "1"})
    assert result.returncodes == [1, 1, 1, 1]
    for rank in result.ranks:
        assert "shard_size(3) does not divide WORLD_SIZE(4) = num_nodes(2) * ranks_per_node(2)" in rank.stderr
        assert "Choose a divisor: [1, 2, 4]" in rank.stderr


TRAINING = {
    "llama-no-reshard": {"kind": "llama", "reshard_after_forward": False},
    "llama-accumulate-clipnorm-ac-and-bugs": {
        "kind": "llama",
        "accumulate": 2,
        "clip": "norm",
        "activation_checkpointing": True,
        "bugs": list(BUGS),
    },
    "litgpt-accumulate-clipnorm-ac": {
        "kind": "litgpt",
        "accumulate": 2,
        "clip": "norm",
        "activation_checkpointing": True,
    },
    "hf-clipvalue-setup-ac": {"kind": "hf", "clip": "value", "setup_together": True, "activation_checkpointing": True},
}


@pytest.fixture(scope="module")
def trained() -> dict[str, list[dict[str, Any]]]:
    """Each training case's parity facts per rank, all from one launch."""
    return launch_cases(parity, TRAINING, timeout=400)


@pytest.mark.timeout(460)  # the launch of all cases, when this test runs first
@pytest.mark.parametrize("case", list(TRAINING))
def test_training_matches_single_process(trained, case):
    options, values = TRAINING[case], trained[case]
    assert [v["sampler"] for v in values] == [{"num_replicas": 4, "rank": rank} for rank in range(4)]
    # every rank's distance: each rank gathers its own replica's parameters (full_tensor() of (Replicate, Shard)
    # gathers over "shard" only), so ranks 2 and 3 judge replica 1
    for rank, facts in enumerate(values):
        assert not beyond_noise(facts["ours"], facts["floor"]), (rank, facts["ours"], facts["floor"])
        # activation checkpointing really recomputes: each layer's forward runs twice per micro-batch, else once
        assert facts["forwards_per_micro_batch"] == (2 if options.get("activation_checkpointing") else 1), facts
        assert facts["resharded_after_forward"] is options.get("reshard_after_forward", True)
        if options["kind"] == "hf":  # transformers' KV cache is off under recompute, as gradient_checkpointing does
            assert facts["use_cache"] is False
    # each planted bug is caught by the same criterion
    for bug, distance in values[0]["bugs"].items():
        assert beyond_noise(distance, values[0]["floor"]), (bug, distance, values[0]["floor"])


MIXED_STEPS = 2  # as before the numerics were judged: the one-process references add ~1 s
MIXED_FACTOR = 3  # how far beyond the half dtype's own rounding (one process) a sharded run may be


@pytest.mark.parametrize(("precision", "half"), [("bf16-mixed", "torch.bfloat16"), ("16-mixed", "torch.float16")])
def test_mixed_precision_computes_in_half_over_fp32_shards_and_reduces_in_fp32(precision, half):
    for facts in launch(mixed_precision, {"precision": precision}).check().values:
        assert facts["precision"] == precision
        assert facts["compute_dtypes"] == [half] * MIXED_STEPS
        # bf16: FSDP2's policy is the mixed precision (no autocast on top, the logits as computed, no fp32 copy);
        # fp16 keeps autocast (fp32 softmax and norms) and Fabric's fp32 outputs
        assert facts["autocast"] == [precision == "16-mixed"] * MIXED_STEPS
        assert facts["output_dtypes"] == [half if precision == "bf16-mixed" else "torch.float32"]
        assert facts["master_dtypes"] == ["torch.float32"]
        assert facts["optimizer_state_dtypes"] == ["torch.float32"]
        # the gradients are reduce-scattered over "shard" and all-reduced over "replicate" in fp32
        assert facts["reduced_dtypes"] == {"reduce_scatter": ["torch.float32"], "all_reduce": ["torch.float32"]}
        # numerics: the global batch's losses and the first step's gradients against the same model and batch in
        # fp32 in one process, within MIXED_FACTOR times the distance of that process computing in the half dtype
        # (the dtype's own rounding, measured in this launch: the floor); the floor itself must be that rounding,
        # within the dtype's eps. Measured here (torch 2.13 CPU), ours / floor: bf16 losses 1.1e-4 / 8.7e-5,
        # gradients 4.26e-3 / 4.28e-3 (0.55 eps); fp16 losses 1.3e-5 / 1.6e-5, gradients 5.32e-4 / 5.33e-4.
        # The replicas' gradients summed, not averaged (plant 46j1): gradients 2.74 (tolerance 0.0128), while its
        # losses, 1.5e-4, stay within theirs (2.6e-4): AdamW hardly sees a gradient's scale.
        eps = torch.finfo(getattr(torch, half.split(".")[-1])).eps
        assert facts["floor"]["gradients"] < eps and facts["floor"]["losses"] < eps / 10, facts["floor"]
        tolerance = {
            "losses": max(MIXED_FACTOR * facts["floor"]["losses"], eps / 30),  # a loss may round alike by chance
            "gradients": MIXED_FACTOR * facts["floor"]["gradients"],
        }
        assert all(facts["ours"][what] <= tolerance[what] for what in tolerance), (facts["ours"], tolerance)
        assert facts["initialized_after_teardown"] is False


def test_one_rank_failing_setup_fails_all_ranks_fast():
    result = launch(
        fail_on_one_rank,
        {"failing_rank": 3},
        timeout=120,
        fail_grace=90,
        env={"FABRIC_HSDP_DEBUG": "1"},
    )  # each rank's own traceback: which error every rank raised
    assert not result.timed_out
    assert result.returncodes == [1, 1, 1, 1]
    assert "ValueError: HybridFSDPStrategy(sharded_modules=...) matched no submodule of Llama" in result.ranks[3].stderr
    for rank in result.ranks[:3]:
        assert "PeerRankError: HybridFSDPStrategy.setup_module failed on rank 3: ValueError" in rank.stderr
    # fast: every rank ended setup by itself with the error (its line printed, exit 1); a rank left waiting in a
    # collective would wait for the 30-minute collective timeout and be killed by the launcher after fail_grace (-9)
    for rank in result.ranks:
        assert "setup ended after" in rank.stdout, rank.stdout


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# The strategy core: topology, placements, meta init, mixed precision, a failure on one rank.


def placements(num_nodes: int, devices: int, shard_size: Any = "node", kind: str = "llama") -> dict[str, Any]:
    """Meta init, then setup: mesh, placements, local shard shapes, devices, buffers and logits vs a CPU build."""
    fabric = make_fabric(num_nodes, devices, shard_size=shard_size, sharded_modules={layer_class(kind)})
    reference = build(kind, seed=0)
    with fabric.init_module(empty_init=True):
        model = build(kind, seed=123)
    on_meta_before = all(p.is_meta for p in model.parameters())
    buffers_real_before = all(not b.is_meta for b in model.buffers())
    model = fabric.setup_module(model)
    shards_finite = all(torch.isfinite(p.to_local()).all().item() for p in model.parameters())
    # initialised by reset_parameters() (or Hugging Face's _init_weights), not left as uninitialised memory
    norms_are_ones = [
        bool((sub.weight.to_local() == 1).all())
        for sub in model.module.modules()
        if "Norm" in type(sub).__name__ and getattr(sub, "weight", None) is not None
    ]
    copy_full_into(model, reference.state_dict())
    mesh = fabric.strategy.device_mesh
    params = dict(model.module.named_parameters())
    reference_buffers = dict(reference.named_buffers())
    facts = {
        "mesh_shape": tuple(mesh.shape),
        "mesh_dim_names": mesh.mesh_dim_names,
        "coordinates": fabric.strategy.topology.coordinates(fabric.global_rank),
        "mesh_coordinate": tuple(mesh.get_coordinate()),
        "on_meta_before": on_meta_before,
        "buffers_real_before": buffers_real_before,
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "placements": {name: tuple(str(x) for x in p.placements) for name, p in params.items()},
        "local_shapes": {name: tuple(p.to_local().shape) for name, p in params.items()},
        "global_shapes": {name: tuple(p.shape) for name, p in params.items()},
        "devices": {str(p.to_local().device) for p in params.values()},
        "shards_finite": shards_finite,
        "norms_are_ones": norms_are_ones,
        "buffers_equal": {
            name: torch.equal(buffer.cpu(), reference_buffers[name]) for name, buffer in model.module.named_buffers()
        },
        "sampler": fabric.strategy.distributed_sampler_kwargs,
    }
    tokens, _ = batch(2)
    with torch.no_grad():
        facts["max_logit_diff"] = (logits_of(model, tokens) - logits_of(reference, tokens)).abs().max().item()
    return facts


def mixed_precision(num_nodes: int, devices: int, precision: str = "bf16-mixed") -> dict[str, Any]:
    """bf16-mixed (or 16-mixed): half-precision parameters in compute, fp32 master shards, fp32 gradient reduction
    (the dtypes FSDP2's reduce-scatter over ``shard`` and all-reduce over ``replicate`` are given); the losses and
    the first step's gradients, and the same in one process in fp32 and in the half dtype, for the test to compare."""
    plugins = []
    if precision == "16-mixed":  # on CPU, Fabric turns "16-mixed" into bf16 unless given the plugin itself
        from lightning.fabric.plugins.precision import MixedPrecision

        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    strategy = HybridFSDPStrategy(sharded_modules={layer_class("llama")})
    fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy,
                      precision=None if plugins else precision, plugins=plugins)  # fmt: skip
    fabric.launch()
    model = fabric.setup_module(build("llama"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    compute_dtypes = []
    linear = model.module.layers[0].attention.wq
    autocast = []

    def record(module: torch.nn.Module, args: Any) -> None:
        compute_dtypes.append(module.weight.dtype)
        autocast.append(torch.is_autocast_enabled("cpu"))

    handle = linear.register_forward_pre_hook(record)
    reduced: dict[str, set[str]] = {"reduce_scatter": set(), "all_reduce": set()}
    # the function FSDP2 calls to reduce-scatter: reduce_scatter_single from torch 2.13, reduce_scatter_tensor before
    scatter_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter, all_reduce = getattr(dist, scatter_name), dist.all_reduce

    def recording_reduce_scatter(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:  # noqa: A002
        reduced["reduce_scatter"].add(str(input.dtype))
        return reduce_scatter(output=output, input=input, **kwargs)

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel() > 1:  # gradients, not a scalar (found-inf flags, losses)
            reduced["all_reduce"].add(str(tensor.dtype))
        return all_reduce(tensor, *args, **kwargs)

    inputs, targets = batch(2, seed=fabric.global_rank)
    losses, output_dtypes, gradients = [], set(), {}
    for step in range(MIXED_STEPS):
        logits = model(inputs)
        output_dtypes.add(str(logits.dtype))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        setattr(dist, scatter_name, recording_reduce_scatter)
        dist.all_reduce = recording_all_reduce
        fabric.backward(loss)
        setattr(dist, scatter_name, reduce_scatter)
        dist.all_reduce = all_reduce
        if step == 0:  # the first step's gradients, unscaled (16-mixed's loss scaler), before the optimizer
            scale = fabric.strategy.precision.scaler.get_scale() if plugins else 1.0
            gradients = {name: p.grad.full_tensor() / scale for name, p in model.module.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())  # the global batch's loss
    handle.remove()
    # the same model and global batch (every rank's rows) in one process: fp32, and the half dtype's rounding alone
    rows = [batch(2, seed=rank) for rank in range(fabric.world_size)]
    global_inputs, global_targets = (torch.cat(parts) for parts in zip(*rows, strict=True))
    fp32 = _one_process(global_inputs, global_targets, None, autocast=False)
    half = torch.float16 if precision == "16-mixed" else torch.bfloat16
    rounded = _one_process(global_inputs, global_targets, half, autocast=precision == "16-mixed")
    fabric.strategy.teardown()
    return {
        "precision": fabric.strategy.precision_name,
        "initialized_after_teardown": dist.is_initialized(),
        "compute_dtypes": [str(d) for d in compute_dtypes],
        "autocast": autocast,
        "output_dtypes": sorted(output_dtypes),
        "master_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "optimizer_state_dtypes": sorted(
            {str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        ),
        "reduced_dtypes": {what: sorted(dtypes) for what, dtypes in reduced.items()},
        "losses": losses,
        # distances from the fp32 run: this run's, and one process's in the half dtype (the floor of that dtype)
        "ours": _mixed_distance(losses, gradients, fp32),
        "floor": _mixed_distance(rounded[0], rounded[1], fp32),
    }


def _one_process(
    inputs: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None, autocast: bool
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``MIXED_STEPS`` of AdamW in one process on the whole batch: the losses and the first step's gradients.
    ``dtype``: forward and backward with the parameters cast to it (FSDP2's ``param_dtype``), fp32 master weights."""
    model = build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, gradients = [], {}
    for step in range(MIXED_STEPS):
        compute = model if dtype is None else copy.deepcopy(model).to(dtype)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=autocast):
            logits = compute(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if compute is not model:
            for master, param in zip(model.parameters(), compute.parameters(), strict=True):
                master.grad = param.grad.float()
        if step == 0:
            gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, gradients


def _mixed_distance(
    losses: list[float], gradients: dict[str, torch.Tensor], reference: tuple[list[float], dict[str, torch.Tensor]]
) -> dict[str, float]:
    """Largest relative loss difference, and the first step's gradients: ``max over tensors ||g - ref||`` over the
    global norm of the reference's."""
    from tests.helpers.parity import gradient_distance

    reference_losses, reference_gradients = reference
    return {
        "losses": max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses, strict=True)),
        "gradients": gradient_distance(gradients, reference_gradients)["value"],
    }


def replicas_differ(module: torch.nn.Module, world_size: int) -> list[str]:
    """Every parameter and buffer whose local shard differs between replicas (ranks r and r + 2 of a 2 x 2 mesh)."""
    differ = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(pieces, local)
        half = world_size // 2
        if not all(torch.equal(pieces[rank], pieces[rank + half]) for rank in range(half)):
            differ.append(name)
    return differ


def init_consistency(num_nodes: int, devices: int) -> dict[str, Any]:
    """Per-rank seeds (as in the user report): shard peers must differ, replicas must hold identical shards."""
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    fabric.seed_everything(100 + fabric.global_rank)
    facts = {}
    for case, empty_init in (("per-rank seeds, empty_init", True), ("per-rank seeds", False), ("one seed", True)):
        # "one seed": identical generators on every rank, and shard peers must still differ
        seed = 7 if case == "one seed" else fabric.global_rank
        with fabric.init_module(empty_init=empty_init):
            model = build("llama", seed=seed)
        model = fabric.setup_module(model)
        weight = model.module.layers[0].feed_forward.w1.weight  # [96, 64]: local shards of 48 rows
        full = weight.full_tensor()
        facts[case] = {
            "halves_differ": not torch.equal(full[:48], full[48:]),
            "replicas_differ": replicas_differ(model.module, fabric.world_size),
            "checked": len(list(model.module.named_parameters())) + len(list(model.module.named_buffers())),
            "std": full.std().item(),
        }
    return facts


def fail_on_one_rank(num_nodes: int, devices: int, failing_rank: int) -> None:
    """One rank passes a sharding policy that matches nothing; every rank must end with an error, fast."""
    rank = int(os.environ["NODE_RANK"]) * devices + int(os.environ["LOCAL_RANK"])
    policy = {torch.nn.GRU} if rank == failing_rank else {layer_class("llama")}
    fabric = make_fabric(num_nodes, devices, sharded_modules=policy)
    started = time.monotonic()
    try:
        fabric.setup_module(build("llama"))
    finally:
        print(f"setup ended after {time.monotonic() - started:.2f}s", flush=True)
    dist.barrier()  # never reached when setup fails somewhere


def bad_shard_size(num_nodes: int, devices: int, shard_size: int) -> None:
    make_fabric(num_nodes, devices, shard_size=shard_size, sharded_modules={layer_class("llama")})
