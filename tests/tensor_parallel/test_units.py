"""Tensor-parallel plans and fused rows, without processes."""

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fabric_hsdp.tensor_parallel import FusedColwise, FusedRows, validate_plan
from fabric_hsdp.tensor_parallel.plans import auto_plan
from fabric_hsdp.tensor_parallel.styles import to_style
from tests.helpers.training import build


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
    assert isinstance(qkv, FusedColwise) and qkv.blocks == (64, 32, 32) and qkv.block_heads == (4, 2, 2)
    assert lit.heads == {"config.n_head": 4, "config.n_query_groups": 2}
    assert auto_plan(build("llama")).styles["layers.*.attention.wo"] == "rowwise"
    with pytest.raises(ValueError, match=r'tensor_parallel_plan="auto" knows no plan for Sequential .*\{"layers'):
        auto_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_an_uneven_split_by_any_plan_is_refused():
    """What a plan (a callable one too, which is not checked before it runs) split is checked after it ran."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fabric_hsdp.tensor_parallel import _check_even_splits, apply_tensor_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port to race for
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        plan = lambda module, tensor_mesh: parallelize_module(module, tensor_mesh, {"1": ColwiseParallel()})  # noqa
        apply_tensor_parallel(model, plan, init_device_mesh("cpu", (1,)))  # one rank: everything divides
        # the same split over two ranks (checked without a second process): 3 rows do not divide by 2
        with pytest.raises(ValueError, match=r"split 1.weight \[3, 6\] along dim 0 into 2 parts, but 3 does not"):
            _check_even_splits(model, 2)
    finally:
        dist.destroy_process_group()


class _Mesh:
    """Stands in for a tensor-parallel mesh of ``size`` ranks where only the size is read (checks before changes)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_too_few_key_value_heads_are_refused_with_the_sizes_that_pass_every_check():
    from fabric_hsdp.tensor_parallel import apply_tensor_parallel

    # litgpt: 4 query heads, 2 key/value groups; a node of 8 could take T = 1, 2, 4, 8, but only 1 and 2 split whole
    # key/value heads (and every other split dim)
    with pytest.raises(ValueError) as error:
        apply_tensor_parallel(build("litgpt"), "auto", _Mesh(4), largest_size=8)
    assert str(error.value) == (
        "tensor_parallel_size(4) does not divide config.n_query_groups(2) of GPT: each tensor-parallel rank must hold"
        " whole attention heads. Fewer key/value heads than tensor-parallel ranks (Megatron replicates them) is not"
        " supported. Choose a tensor_parallel_size that passes every check of this model and layout: [1, 2]."
    )
    # transformers' Llama at T=8: the query heads fail first; still only sizes that pass every check
    with pytest.raises(ValueError, match=r"does not divide config.num_attention_heads\(4\) .*layout: \[1, 2\]\.$"):
        apply_tensor_parallel(build("hf"), "auto", _Mesh(8), largest_size=8)


def test_sequence_and_loss_parallelism_need_tensor_parallelism_and_a_plan_to_change():
    from fabric_hsdp.tensor_parallel import apply_tensor_parallel, validate_levers

    with pytest.raises(ValueError, match=r"sequence_parallel=True\) splits over the tensor-parallel ranks, but"):
        validate_levers(True, False, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_plan is a callable, which applies its own"):
        apply_tensor_parallel(build("llama"), lambda model, mesh: None, _Mesh(2), loss_parallel=True)


def test_fused_rows_state_dict_shows_the_stored_order_and_loads_it():
    from fabric_hsdp.tensor_parallel import held_row_order
    from fabric_hsdp.tensor_parallel.fused_rows import add_state_dict_hooks

    fused = FusedRows(blocks=(4, 2, 2), parts=2)
    module = torch.nn.Linear(1, 8, bias=False)
    with torch.no_grad():
        module.weight.copy_(fused.to_module_order(torch.arange(8.0)).view(8, 1))  # as tensor parallelism holds it
    add_state_dict_hooks(module, fused)
    assert module.state_dict()["weight"].flatten().tolist() == list(range(8))  # litgpt's [Q; K; V]
    with held_row_order():  # this package's checkpoint code sees the rows as they are
        assert module.state_dict()["weight"].flatten().tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    module.load_state_dict({"weight": torch.arange(8.0).view(8, 1) + 10})
    assert module.weight.flatten().tolist() == [10, 11, 14, 16, 12, 13, 15, 17]


def test_tied_weights_split_differently_are_refused():
    """The example model with its head tied to the embedding; a plan splitting only the head would untie them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fabric_hsdp.models.tied import tied_groups
    from fabric_hsdp.tensor_parallel import apply_tensor_parallel

    assert tied_groups(build("hf-tied")) == [("model.embed_tokens.weight", "lm_head.weight")]
    assert tied_groups(build("hf")) == []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port to race for
    try:
        model = build("llama-tied")
        apply_tensor_parallel(model, "auto", init_device_mesh("cpu", (1,)))  # both split by rows: kept tied
        assert model.output.weight is model.tok_embeddings.weight
        with pytest.raises(ValueError) as error:
            apply_tensor_parallel(
                build("llama-tied"), {"output": "colwise_gather_output"}, init_device_mesh("cpu", (1,))
            )
        assert str(error.value).startswith(
            "tok_embeddings.weight and output.weight are one tied parameter, but tensor_parallel_plan splits its"
            " holders differently (tok_embeddings.weight whole, output.weight (S(0))), which would untie"
            " them and train two copies. Split every holder along the same dim (an embedding with"
            " 'embedding_rowwise'"
        )
    finally:
        dist.destroy_process_group()
