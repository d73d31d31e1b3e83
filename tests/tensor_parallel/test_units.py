"""Tensor-parallel plans and fused rows, without processes."""

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fabric_hsdp.tensor_parallel import FusedColwise, FusedRows, validate_plan
from fabric_hsdp.tensor_parallel.plans import auto_plan
from fabric_hsdp.tensor_parallel.styles import to_style
from tests.scenarios.common import build


def test_fused_rows_give_each_rank_its_heads_of_each_block():
    # litgpt qkv with 4 query heads and 2 groups of head size 1: stored rows [q0 q1 q2 q3 | k0 k1 | v0 v1]
    fused = FusedRows(blocks=(4, 2, 2), parts=2)
    stored = torch.arange(8)
    module = fused.to_module_order(stored)
    assert module.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]  # rank 0: q0 q1 k0 v0, rank 1: q2 q3 k1 v1
    assert torch.equal(fused.to_stored_order(module), stored)
    assert fused.runs() == [(0, 0, 2), (2, 4, 1), (3, 6, 1), (4, 2, 2), (6, 5, 1), (7, 7, 1)]
    # module rows 1..5 come from stored rows 1, 4, 6, 2, 3
    assert fused.stored_pieces(1, 6) == [(0, 1, 1), (1, 4, 1), (2, 6, 1), (3, 2, 2)]
    with pytest.raises(ValueError, match=r"do not all divide into 2 parts: \[3, 3\]"):
        FusedRows(blocks=(4, 3, 3), parts=2)


def test_transformers_style_names_become_torch_styles():
    assert type(to_style("colwise", "x")) is ColwiseParallel
    assert type(to_style("rowwise", "x")) is RowwiseParallel
    assert to_style("colwise_gather_output", "x").output_layouts[0].is_replicate()
    assert isinstance(to_style("packed_colwise", "x"), FusedColwise)
    with pytest.raises(ValueError, match=r"tensor_parallel_plan\['layers.\*.mlp'\] = 'local_colwise' is not a"):
        validate_plan({"layers.*.mlp": "local_colwise"})
    with pytest.raises(ValueError, match="tensor_parallel_plan=42\\) is not valid"):
        validate_plan(42)


def test_auto_plans_cover_transformers_litgpt_and_the_example():
    hf = auto_plan(build("hf"))
    assert hf.styles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert hf.styles["lm_head"] == "colwise_gather_output"
    assert hf.heads == {"config.num_attention_heads": 4, "config.num_key_value_heads": 2}
    lit = auto_plan(build("litgpt"))
    qkv = lit.styles["transformer.h.*.attn.qkv"]
    assert isinstance(qkv, FusedColwise) and qkv.blocks == (64, 32, 32) and qkv.block_units == (4, 2, 2)
    assert lit.heads == {"config.n_head": 4, "config.n_query_groups": 2}
    assert auto_plan(build("llama")).styles["layers.*.attention.wo"] == "rowwise"
    with pytest.raises(ValueError, match=r'tensor_parallel_plan="auto" knows no plan for Sequential .*\{"layers'):
        auto_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_an_uneven_split_by_any_plan_is_refused(monkeypatch):
    """What a plan (a callable one too, which is not checked before it runs) split is checked after it ran."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fabric_hsdp.tensor_parallel import _check_even_splits, apply_tensor_parallel
    from tests.helpers.launch import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        plan = lambda module, tensor_mesh: parallelize_module(module, tensor_mesh, {"1": ColwiseParallel()})  # noqa
        apply_tensor_parallel(model, plan, init_device_mesh("cpu", (1,)))  # one rank: everything divides
        # the same split over two ranks (checked without a second process): 3 rows do not divide by 2
        with pytest.raises(ValueError, match=r"split 1.weight \[3, 6\] along dim 0 into 2 parts, but 3 does not"):
            _check_even_splits(model, 2)
    finally:
        dist.destroy_process_group()
