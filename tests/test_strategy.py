"""HybridFSDPStrategy on 2 simulated nodes x 2 CPU ranks (gloo), in real processes."""

import pytest

from tests.helpers.launch import launch
from tests.helpers.parity import BUGS

pytestmark = pytest.mark.slow

LAYER_PARAMS = "layers.0.feed_forward.w1.weight"  # [96, 64] in the tiny model


@pytest.mark.parametrize("kind", ["llama", "litgpt", "hf"])
def test_hsdp_mesh_placements_and_meta_init(kind):
    values = launch("tests.scenarios.core:placements", {"kind": kind}).check().values
    for rank, facts in enumerate(values):
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
    for facts in launch("tests.scenarios.core:init_consistency").check().values:
        for case, values in facts.items():
            assert values["halves_differ"], (case, facts)
            assert values["replicas_differ"] == [] and values["checked"] == 22, (case, facts)  # 21 parameters, 1 buffer
            # nn.Linear's kaiming-uniform init of a [96, 64] weight: std = 1/sqrt(3 * 64)
            assert values["std"] == pytest.approx(64**-0.5 / 3**0.5, rel=0.1)


@pytest.mark.parametrize("shard_size", [4, "world"])
def test_full_shard_over_world(shard_size):
    values = launch("tests.scenarios.core:placements", {"shard_size": shard_size}).check().values
    for rank, facts in enumerate(values):
        assert facts["mesh_shape"] == (1, 4)
        assert facts["mesh_coordinate"] == (0, rank)
        assert facts["local_shapes"][LAYER_PARAMS] == (24, 64)


def test_invalid_shard_size_fails_every_rank_with_the_arithmetic():
    # each rank's own traceback (tests/test_errors.py: without FABRIC_HSDP_DEBUG, rank 0 says it in one line)
    result = launch(
        "tests.scenarios.core:bad_shard_size", {"shard_size": 3}, timeout=120, env={"FABRIC_HSDP_DEBUG": "1"}
    )
    assert result.returncodes == [1, 1, 1, 1]
    for rank in result.ranks:
        assert "shard_size(3) does not divide WORLD_SIZE(4) = num_nodes(2) * ranks_per_node(2)" in rank.stderr
        assert "Choose a divisor: [1, 2, 4]" in rank.stderr


# A sharded run differs from one process by rounding. It may differ by at most NOISE_FACTOR times the distance between
# two single-process runs that differ only in summation order (full batch vs the same rows as accumulated
# micro-batches, in two orders), measured in the same launch on the same machine, and never by more than CAPS.
# MIN_TOLERANCE, for when the single-process runs happen to round alike: ~16 fp32 ulps (6e-8 each) for losses and
# parameters; a gradient norm sums the squares of ~1e5 elements, whose rounding grows like sqrt(1e5) ulps.
NOISE_FACTOR = 10
MIN_TOLERANCE = {"losses": 1e-6, "norms": 2e-5, "parameters": 1e-6}
CAPS = {"losses": 1e-4, "norms": 1e-4, "parameters": 1e-3}


def within_noise(distance: dict[str, float], floor: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The measures (losses, norms, parameters) that exceed their tolerance, as (distance, tolerance)."""
    tolerances = {what: min(cap, max(NOISE_FACTOR * floor[what], MIN_TOLERANCE[what])) for what, cap in CAPS.items()}
    return {what: (distance[what], tolerances[what]) for what in CAPS if distance[what] > tolerances[what]}


@pytest.mark.parametrize(
    "options",
    [
        {"kind": "llama", "reshard_after_forward": False},
        {"kind": "llama", "accumulate": 2, "clip": "norm", "activation_checkpointing": True, "bugs": list(BUGS)},
        {"kind": "litgpt", "accumulate": 2, "clip": "norm", "activation_checkpointing": True},
        {"kind": "hf", "clip": "value", "setup_together": True, "activation_checkpointing": True},
    ],
    ids=[
        "llama-no-reshard",
        "llama-accumulate-clipnorm-ac-and-bugs",
        "litgpt-accumulate-clipnorm-ac",
        "hf-clipvalue-setup-ac",
    ],
)
def test_training_matches_single_process(options):
    values = launch("tests.helpers.parity:parity", options).check().values
    assert [v["sampler"] for v in values] == [{"num_replicas": 4, "rank": rank} for rank in range(4)]
    # every rank's distance: each rank gathers its own replica's parameters (full_tensor() of (Replicate, Shard)
    # gathers over "shard" only), so ranks 2 and 3 judge replica 1
    for rank, facts in enumerate(values):
        assert not within_noise(facts["ours"], facts["floor"]), (rank, facts["ours"], facts["floor"])
        # activation checkpointing really recomputes: each layer's forward runs twice per micro-batch, else once
        assert facts["forwards_per_micro_batch"] == (2 if options.get("activation_checkpointing") else 1), facts
        assert facts["resharded_after_forward"] is options.get("reshard_after_forward", True)
        if options["kind"] == "hf":  # transformers' KV cache is off under recompute, as gradient_checkpointing does
            assert facts["use_cache"] is False
    # each planted bug is caught by the same criterion
    for bug, distance in values[0]["bugs"].items():
        assert within_noise(distance, values[0]["floor"]), (bug, distance, values[0]["floor"])


@pytest.mark.parametrize(("precision", "half"), [("bf16-mixed", "torch.bfloat16"), ("16-mixed", "torch.float16")])
def test_mixed_precision_computes_in_half_over_fp32_shards_and_reduces_in_fp32(precision, half):
    for facts in launch("tests.scenarios.core:mixed_precision", {"precision": precision}).check().values:
        assert facts["precision"] == precision
        assert facts["compute_dtypes"] == [half, half]
        # bf16: FSDP2's policy is the mixed precision (no autocast on top, the logits as computed, no fp32 copy);
        # fp16 keeps autocast (fp32 softmax and norms) and Fabric's fp32 outputs
        assert facts["autocast"] == [precision == "16-mixed"] * 2
        assert facts["output_dtypes"] == [half if precision == "bf16-mixed" else "torch.float32"]
        assert facts["master_dtypes"] == ["torch.float32"]
        assert facts["optimizer_state_dtypes"] == ["torch.float32"]
        # the gradients are reduce-scattered over "shard" and all-reduced over "replicate" in fp32
        assert facts["reduced_dtypes"] == {"reduce_scatter": ["torch.float32"], "all_reduce": ["torch.float32"]}
        assert all(0 < loss < 10 for loss in facts["losses"])
        assert facts["initialized_after_teardown"] is False


def test_one_rank_failing_setup_fails_all_ranks_fast():
    result = launch(
        "tests.scenarios.core:fail_on_one_rank",
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
