"""The levers in launched runs with tensor parallelism: (1, 2, 2) on 1 node x 4 ranks and (2, 1, 2) on 2 x 2."""

import pytest

from tests.helpers.launch import launch
from tests.test_strategy import within_noise

pytestmark = pytest.mark.slow

KINDS = ["litgpt", "hf"]  # litgpt's GPT (fused qkv) and transformers' Llama, both with grouped-query attention
MESHES = [(1, 4, (1, 2, 2)), (2, 2, (2, 1, 2))]
CONFIGS = {"selective": {"ac": "selective"}}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("nodes", "per_node", "mesh"), MESHES, ids=["1x4-mesh122", "2x2-mesh212"])
def test_levers_train_like_one_process_and_checkpoint_like_plain(nodes, per_node, mesh):
    args = {"kinds": KINDS, "configs": CONFIGS, "recompute": [None, "full", "selective", 2]}
    if mesh[0] > 1:
        args["bugs"] = ["no_replicate_allreduce"]  # the criterion's control: replicas that never sync must fail it
    values = launch("tests.scenarios.levers:levers", args, num_nodes=nodes, ranks_per_node=per_node, timeout=840)
    values = values.check().values
    facts = values[0]
    for label, result in facts["parity"].items():
        assert not within_noise(result["ours"], result["floor"]), (label, result["ours"], result["floor"])
        for bug, distance in result["bugs"].items():
            assert within_noise(distance, result["floor"]), (label, bug, distance, result["floor"])
    if mesh[0] > 1:
        assert all(result["bugs"] for label, result in facts["parity"].items() if label.startswith("selective/"))
    for label, result in facts["checkpoint"].items():
        assert result["orig_mod_names"] == [] and result["same_names"], (label, result)
        assert result["differ"] == {} and result["optimizer_steps"] == [1], (label, result)
    # under FSDP + TP, activation checkpointing recomputes what its mode says (ops run in one backward, per rank)
    for rank_facts in values:
        for kind, counts in rank_facts["recompute"].items():
            none, full, selective, second = (counts[mode] for mode in ("None", "full", "selective", "2"))
            assert none["silu"] == 0 and full["silu"] == selective["silu"] == 2 and second["silu"] == 1, kind
            assert full["mm"] > second["mm"] > none["mm"] == selective["mm"], (kind, counts)
