"""Tensor parallelism as the third mesh dim: 1 node x 4 ranks (1, 2, 2) and 2 simulated nodes x 2 ranks (2, 1, 2)."""

import pytest
import torch

from tests.helpers.launch import launch
from tests.test_strategy import within_noise

# the example LLaMA, transformers' Llama and litgpt's GPT (both with GQA), and transformers' Llama with tied embeddings
KINDS = ["llama", "hf", "litgpt", "hf-tied"]
LEVERS = {"sequence_parallel": True, "loss_parallel": True}


@pytest.mark.slow
@pytest.mark.timeout(660)  # one launch of 600 s: plain TP and the levers, 4 models
@pytest.mark.parametrize(
    ("nodes", "per_node", "mesh"), [(1, 4, (1, 2, 2)), (2, 2, (2, 1, 2))], ids=["1x4-mesh122", "2x2-mesh212"]
)
def test_training_with_tensor_parallelism_matches_single_process(nodes, per_node, mesh):
    """Plain TP and TP with sequence + loss parallelism, each against the same single-process runs."""
    # the control: the same criterion must fail a planted bug (no gradient reduction across data-parallel ranks)
    options = {
        "kinds": KINDS,
        "accumulate": 2,
        "clip": "norm",
        "activation_checkpointing": True,
        "bugs": ["skip_sync_flush"],
        "variants": {"levers": LEVERS},
    }
    values = (
        launch(
            "tests.helpers.parity:parity",
            dict(options, tensor_parallel_size=2),
            num_nodes=nodes,
            ranks_per_node=per_node,
            timeout=600,
        )
        .check()
        .values
    )
    data_parallel = 2
    for kind in KINDS:
        for rank, rank_values in enumerate(values):  # every rank judges the parameters it gathered
            facts = rank_values[kind]
            assert not within_noise(facts["ours"], facts["floor"]), (kind, rank, facts["ours"], facts["floor"])
            assert facts["forwards_per_micro_batch"] == 2, (kind, facts["forwards_per_micro_batch"])  # recomputed
        facts = values[0][kind]
        levers = facts["variants"]["levers"]
        assert not within_noise(levers, facts["floor"]), (kind, levers, facts["floor"])
        # tensor-parallel peers (consecutive ranks) got the same micro-batches, data-parallel ranks different ones
        samplers = [v[kind]["sampler"] for v in values]
        assert samplers == [{"num_replicas": data_parallel, "rank": rank // 2} for rank in range(4)]
        batches = [v[kind]["batches"] for v in values]
        assert batches[0] == batches[1] and batches[2] == batches[3], kind
        assert batches[0] != batches[2], kind
    (bug, distance), floor = values[0][KINDS[0]]["bugs"].popitem(), values[0][KINDS[0]]["floor"]
    assert within_noise(distance, floor), (bug, distance, floor)


@pytest.mark.slow
def test_init_under_tensor_parallelism():
    """Per-rank seeds: every part of a copy differs, replicated values are equal along their dims; logits exact;
    the gradient norm of the same weights as one process's, reduced in one all-reduce with no DTensor warning."""
    values = launch("tests.scenarios.core:tensor_parallel_init", num_nodes=1, ranks_per_node=4).check().values
    for kind, facts in values[0].items():
        assert facts["mesh_shape"] == (1, 2, 2) and facts["mesh_dim_names"] == ("replicate", "shard", "tensor")
        assert facts["coordinates"] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
        for name, pieces in facts["gathered"].items():
            dims = facts["replicated_dims"][name]
            placements = facts["placements"][name]
            if len(placements) == 2:  # norms, left whole by tensor parallelism: FSDP-only, replicated over "tensor"
                assert placements == ("R", "S(0)") and dims == ["replicate", "tensor"], name
                assert torch.equal(pieces[0], pieces[1]) and torch.equal(pieces[2], pieces[3]), name
            else:  # split by tensor parallelism and FSDP: four different slices
                assert len(placements) == 3 and dims == ["replicate"], (name, placements, dims)
                assert all(not torch.equal(pieces[i], pieces[j]) for i in range(4) for j in range(i)), name
        assert facts["norms_are_ones"] and all(facts["norms_are_ones"].values())
        assert all(facts["buffers_equal"].values()), facts["buffers_equal"]
        # not bit-exact: row-wise layers sum partial products over the tensor-parallel ranks in another order; a
        # misplaced slice would be off by the size of the logits (~1)
        assert facts["max_logit_diff"] < 1e-5, kind
        # DTensor reduces the norm over (shard, tensor) in one all-reduce, on the flattened dim the topology makes,
        # and logs nothing ("While redistributing ... N sequential all_reduce operations ..." without it)
        for rank_values in values:
            norms = rank_values[kind]["gradient_norm"]
            assert norms["logged"] == [], (kind, norms["logged"])
            assert norms["ours"] == pytest.approx(norms["sequential"], rel=1e-6), (kind, norms)
            assert norms["ours"] == pytest.approx(norms["reference"], rel=1e-5), (kind, norms)
    assert values[0]["litgpt"]["fused"] == [f"transformer.h.{i}.attn.qkv.weight" for i in range(2)]
    placements = values[0]["litgpt"]["placements"]
    assert placements["transformer.h.0.attn.qkv.weight"] == ("R", "_S(0, 2)", "S(0)")
    assert placements["transformer.h.0.attn.proj.weight"] == ("R", "S(0)", "S(1)")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"tensor_parallel_size": 3},
            "tensor_parallel_size(3) does not divide ranks_per_node(2): tensor parallelism exchanges activations in"
            " every layer and must stay inside a node. Choose a size that divides ranks_per_node and shard_size(2):"
            " [1, 2] (the model's heads are checked at setup_module).",
        ),
        (
            {"tensor_parallel_size": 2, "heads": 3},
            "ValueError: tensor_parallel_size(2) does not divide config.num_attention_heads(3) of LlamaForCausalLM:"
            " each tensor-parallel rank must hold whole attention heads. Choose a tensor_parallel_size that passes"
            " every check of this model and layout: [1].",
        ),
    ],
    ids=["size-crosses-nodes", "three-heads-over-two"],
)
def test_invalid_tensor_parallel_size_fails_every_rank_fast(args, message):
    result = launch("tests.scenarios.core:bad_tensor_parallel", args, timeout=120, fail_grace=90)
    assert not result.timed_out
    assert result.returncodes == [1, 1, 1, 1]
    for rank in result.ranks:
        assert message in rank.stderr, rank.stderr[-2000:]
        # fast: every rank ended by itself with the error, none was left in a collective for the launcher to kill
        assert "setup ended after" in rank.stdout, rank.stdout


@pytest.mark.slow
@pytest.mark.timeout(560)  # one launch of 500 s
def test_ties_export_layout_dropout_and_checkpoints_across_sequence_and_loss_parallelism(tmp_path):
    """One launch on (1, 2, 2), strategies one after another (see tests/scenarios/tp_levers.py)."""
    values = launch("tests.scenarios.tp_levers:levers", {"out": str(tmp_path)}, timeout=500).check().values
    facts = values[0]
    print({key: value for key, value in facts.items() if key != "memory"})
    # tied embeddings: one parameter split by vocabulary rows, as many in the optimizer as in the model, equal after
    # a step (plain TP and with the levers); parity with one process: hf-tied in the training test above
    for label in ("tied", "tied_levers"):
        for kind, tied in facts[label].items():
            assert tied["same_parameter"] and tied["equal_after_step"], (label, kind, tied)
            assert tied["optimizer_parameters"] == tied["reference_parameters"], (label, kind, tied)
            assert tied["placements"] == ("R", "_S(0, 2)", "S(0)"), (label, kind, tied)
    # torch's export paths give litgpt's [Q; K; V] rows, exactly the single-process state dict, which litgpt loads
    export = facts["export"]
    for path in ("full_state_dict", "state_dict", "dcp", "set_full_state_dict", "dcp_round_trip"):
        assert export[path] == [], (path, export[path])
    assert export["litgpt_logits_equal"]
    # checkpoints saved with sequence + loss parallelism load exactly without them, and the reverse
    for name, result in facts["checkpoints"].items():
        assert result["compared"] > 10 and result["model"] == [] and result["optimizer"] == [], (name, result)
    # dropout, ranks seeded per rank: tensor-parallel peers draw the same masks where they hold the same values
    # (embeddings, residual branches) and their own inside attention (heads); with sequence parallelism each
    # layer works on a sequence shard: own masks there. Recomputation (activation checkpointing) redraws the same.
    dropout = facts["dropout"]
    per_layer_tp, per_layer_sp = [False, True, True], [False, False, False]
    assert dropout["tp"]["peers_equal"] == [True, *per_layer_tp * 2], dropout["tp"]
    assert dropout["sp"]["peers_equal"] == [True, *per_layer_sp * 2], dropout["sp"]
    for label in ("tp", "sp", "tp-ac", "sp-ac"):
        assert dropout[label]["peers_equal"] == dropout[label]["peers_equal_2_3"], dropout[label]
    assert dropout["tp-ac"]["peers_equal"][:7] == dropout["tp"]["peers_equal"]
    assert dropout["sp-ac"]["peers_equal"][:7] == dropout["sp"]["peers_equal"]
    assert dropout["tp-ac"]["calls"] > 7 and dropout["sp-ac"]["calls"] > 7  # the layers' dropouts again in backward
    assert dropout["recompute_unequal"] == {"tp-ac": [], "sp-ac": []}, dropout["recompute_unequal"]
    # memory per rank: sequence parallelism saves fewer activations, loss parallelism holds 1/2 of the logits
    memory = facts["memory"]
    for kind in ("llama", "hf", "litgpt"):
        plain, levers = memory["tp"][kind], memory["levers"][kind]
        assert levers["model"] < 0.9 * plain["model"], (kind, plain, levers)
        assert levers["logits"] * 2 == plain["logits"], (kind, plain, levers)
        assert levers["loss"] < 0.6 * plain["loss"], (kind, plain, levers)
    print({label: memory[label] for label in memory})


def view_warnings(num_nodes: int, devices: int) -> dict:
    """A TP training step of the example LLaMA (its logits: the head's to_local() view); the warnings it raised."""
    import warnings

    from torch.distributed.tensor import DTensor

    from fabric_hsdp.tensor_parallel.view_warning import is_local_logits
    from tests.helpers.training import batch, make_fabric, tiny_llama

    fabric = make_fabric(num_nodes, devices, tensor_parallel_size=2)
    model = fabric.setup_module(tiny_llama())
    tokens, targets = batch(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    weight = next(p for p in model.parameters() if isinstance(p, DTensor))
    local = weight.to_local()
    return {
        "warnings": [str(warning.message) for warning in caught],
        "logits_are_local_logits": is_local_logits(logits),
        "a slice of them is not": is_local_logits(logits[..., :2]),
        "to_local() of a parameter is": is_local_logits(local) if local.requires_grad else None,
    }


@pytest.mark.timeout(240)
def test_the_harmless_view_warning_of_tp_logits_is_not_shown():
    """#34: every TP run printed FSDP2's "returned a view tensor ... can cause backward to fail or produce wrong
    gradients" for the head's to_local() logits, which autograd forbids modifying in place."""
    values = launch("tests.tensor_parallel.test_training:view_warnings", num_nodes=1, ranks_per_node=2, timeout=150)
    for facts in values.check().values:
        assert [text for text in facts["warnings"] if "returned a view tensor" in text] == [], facts["warnings"]
        assert facts["logits_are_local_logits"] is True and facts["a slice of them is not"] is False, facts
