"""shard_size="auto" without processes: the budget checks and the choice (the launched test is in test_measured)."""

import pytest
import torch

from examples.tiny_llama import Llama, LlamaConfig
from fabric_hsdp import HybridFSDPStrategy
from fabric_hsdp.planning import NoLayoutFitsError, Training, Workload, memory_per_device, model_shape_of_module
from fabric_hsdp.planning.auto import auto_topology
from fabric_hsdp.planning.step import with_headroom
from fabric_hsdp.processes.run_topology import check_memory_budget


def test_cpu_needs_an_explicit_budget():
    with pytest.raises(ValueError, match=r"shard_size='auto'\) on cpu needs the memory each rank may use: pass"):
        check_memory_budget("auto", None, "cpu")
    assert check_memory_budget("auto", None, "cuda") is None  # measured with torch.cuda.mem_get_info
    assert check_memory_budget("auto", "2GiB", "cpu") == 2 * 2**30


def test_a_budget_needs_shard_size_auto():
    with pytest.raises(ValueError, match=r"memory_budget='8GB'\) is only used with shard_size='auto'"):
        HybridFSDPStrategy(shard_size="node", memory_budget="8GB")
    with pytest.raises(ValueError, match="memory_budget='lots' is not a size"):
        HybridFSDPStrategy(shard_size="auto", memory_budget="lots")


def test_auto_takes_the_recommended_layout_and_says_when_nothing_fits():
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=16))
    shape, training = model_shape_of_module(model), Training("32-true", Workload(2, 8))
    # what must fit: the activation estimate with its headroom (issue #34)
    node, world = (with_headroom(memory_per_device(shape, training, shard, 1)).total for shard in (2, 4))
    kwargs = dict(num_nodes=2, ranks_per_node=2, tensor_parallel_size=1, tensor_parallel_plan="auto")
    # context_parallel_size=1: without it the planner splits the sequences where nothing else fits (#42)
    kwargs.update(training=Training("32-true", Workload(2, 8)), backend="gloo", context_parallel_size=1)
    topology, plan = auto_topology(model, int(node / 0.9) + 1, **kwargs)
    assert topology.mesh_shape == (2, 2) and plan.recommended.layout.shard_size == 2
    topology, _ = auto_topology(model, int(world / 0.9) + 1, **kwargs)
    assert topology.mesh_shape == (1, 4)
    with pytest.raises(NoLayoutFitsError, match="the smallest total is"):
        auto_topology(model, int(world / 0.9) - 1, **kwargs)


def test_auto_keeps_the_strategys_tensor_parallel_size_and_plan():
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=16))
    kwargs = dict(num_nodes=2, ranks_per_node=2, tensor_parallel_size=2, training=Training("32-true", Workload(2, 8)))
    kwargs.update(backend="gloo")
    topology, plan = auto_topology(model, 10**9, tensor_parallel_plan="auto", **kwargs)
    assert topology.tensor_parallel_size == 2 and topology.mesh_shape == (2, 1, 2)
    assert {row.layout.tensor_parallel_size for row in plan.rows} == {2}
    assert plan.model.tensor_parallel_source == "the model's tensor-parallel plan"
    # a plan that leaves the output head whole: the head is no longer split, so a device holds more
    whole_head = {key: value for key, value in Llama._tp_plan.items() if key != "output"}
    _, partial = auto_topology(model, 10**9, tensor_parallel_plan=whole_head, **kwargs)
    assert partial.recommended.memory.parameters > plan.recommended.memory.parameters
