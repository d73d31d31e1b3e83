import re

import pytest

from fabric_hsdp.topology import Topology, validate_shard_size


@pytest.mark.parametrize(
    ("shard_size", "nodes", "per_node", "shape"),
    [
        ("node", 2, 2, (2, 2)),
        ("world", 2, 2, (1, 4)),
        (4, 2, 2, (1, 4)),
        (1, 2, 2, (4, 1)),
        ("node", 4, 8, (4, 8)),
        (16, 4, 8, (2, 16)),
        (4, 2, 8, (4, 4)),
    ],
)
def test_mesh_shape(shard_size, nodes, per_node, shape):
    topology = Topology.resolve(shard_size, nodes, per_node, nodes * per_node)
    assert topology.mesh_shape == shape
    assert topology.replicate_size * topology.shard_size == nodes * per_node


def test_shard_groups_are_consecutive_ranks_of_one_node():
    topology = Topology.resolve("node", 2, 4, 8)
    assert [topology.coordinates(rank) for rank in range(8)] == [(r // 4, r % 4) for r in range(8)]
    # ranks with the same replicate index (one shard group) live on one node: node = rank // ranks_per_node
    for rank in range(8):
        assert topology.coordinates(rank)[0] == rank // 4


def test_not_a_divisor_of_world_size():
    with pytest.raises(ValueError, match=r"shard_size\(3\) does not divide WORLD_SIZE\(4\) = num_nodes\(2\) \*"):
        Topology.resolve(3, 2, 2, 4)


def test_group_would_straddle_nodes():
    with pytest.raises(ValueError, match=r"shard_size\(4\) does not divide ranks_per_node\(6\).*straddle"):
        Topology.resolve(4, 2, 6, 12)


def test_group_covers_a_fraction_of_a_node():
    with pytest.raises(
        ValueError, match=r"shard_size\(12\) is not a multiple of ranks_per_node\(8\).*\[8, 16, 24, 48\]"
    ):
        Topology.resolve(12, 6, 8, 48)


def test_launcher_disagrees_with_fabric_arguments():
    with pytest.raises(ValueError, match=r"num_nodes\(2\) \* ranks_per_node\(2\) != WORLD_SIZE\(8\)"):
        Topology.resolve("node", 2, 2, 8)


@pytest.mark.parametrize("bad", [0, -2, "nodes", 2.0, True])
def test_invalid_shard_size_form(bad):
    with pytest.raises(ValueError, match="is not valid. Use 'node'"):
        validate_shard_size(bad)


def test_describe_names_dims():
    text = Topology.resolve("node", 2, 2, 4).describe()
    assert "HSDP: 2 node(s) x 2 rank(s) per node = 4 ranks; mesh (2, 2)" in text
    assert "'shard'=2" in text and "'replicate'=2 copies exchange only gradient all-reduces" in text
    # plain FSDP: one copy, nothing exchanged between copies (it said "'replicate'=1 copies exchange ...")
    fsdp = Topology.resolve("world", 2, 2, 4).describe()
    assert "'replicate'=1: one copy, no gradient all-reduce between copies" in fsdp and "copies exchange" not in fsdp
    # a 3-D mesh names all three dims
    assert "with dims ('replicate', 'shard', 'tensor')" in Topology.resolve("node", 2, 2, 4, 2).describe()


@pytest.mark.parametrize(
    ("shard_size", "nodes", "per_node", "tp", "shape", "data_parallel"),
    [
        ("node", 1, 4, 2, (1, 2, 2), 2),
        ("node", 2, 2, 2, (2, 1, 2), 2),
        ("node", 4, 8, 2, (4, 4, 2), 16),
        (16, 4, 8, 8, (2, 2, 8), 4),
        ("world", 2, 8, 4, (1, 4, 4), 4),
        ("node", 2, 2, 1, (2, 2), 4),
    ],
)
def test_tensor_parallel_mesh_shape(shard_size, nodes, per_node, tp, shape, data_parallel):
    topology = Topology.resolve(shard_size, nodes, per_node, nodes * per_node, tp)
    assert topology.mesh_shape == shape
    assert topology.mesh_dim_names == (("replicate", "shard", "tensor") if tp > 1 else ("replicate", "shard"))
    assert topology.data_parallel_size == data_parallel


def test_tensor_parallel_peers_are_consecutive_ranks_of_one_node():
    topology = Topology.resolve("node", 2, 4, 8, tensor_parallel_size=2)  # mesh (2, 2, 2)
    assert [topology.coordinates(rank) for rank in range(8)] == [
        (r, s, t) for r in range(2) for s in range(2) for t in range(2)
    ]
    for rank in range(8):  # rank = (r * S + s) * T + t
        r, s, t = topology.coordinates(rank)
        assert rank == (r * 2 + s) * 2 + t
        assert topology.data_parallel_rank(rank) == r * 2 + s
        assert topology.position_in_copy(rank) == s * 2 + t
    assert "HSDP + tensor parallel (2)" in topology.describe()
    assert "each layer split 'tensor'=2 ways by tensor parallelism inside a node and 'shard'=2 ways" in (
        topology.describe()
    )


def test_tensor_parallel_must_stay_inside_a_node_and_divide_the_shard_group():
    with pytest.raises(ValueError, match=r"tensor_parallel_size\(3\) does not divide ranks_per_node\(2\).*\[1, 2\]"):
        Topology.resolve("node", 2, 2, 4, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size\(4\) does not divide shard_size\(2\).*\[1, 2\]"):
        Topology.resolve(2, 2, 4, 8, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0\) is not valid"):
        Topology.resolve("node", 2, 4, 8, tensor_parallel_size=0)


@pytest.mark.parametrize(
    ("shard_size", "num_nodes", "ranks_per_node", "tensor_parallel_size"),
    [(2, 1, 4, 3), (2, 1, 8, 3), (4, 2, 8, 8), (16, 2, 8, 3), ("node", 1, 6, 4)],
)
def test_suggested_tensor_parallel_sizes_pass_every_layout_check(
    shard_size, num_nodes, ranks_per_node, tensor_parallel_size
):
    """A suggestion must work: T=3 on 4 ranks per node with shard_size=2 suggested [1, 2, 4], and 4 then failed."""
    world_size = num_nodes * ranks_per_node
    with pytest.raises(ValueError, match=r"^tensor_parallel_size\(") as error:
        Topology.resolve(shard_size, num_nodes, ranks_per_node, world_size, tensor_parallel_size)
    suggested = [int(size) for size in re.search(r"\[([\d, ]+)\]", str(error.value)).group(1).split(", ")]
    valid = []
    for size in range(1, ranks_per_node + 1):
        try:
            Topology.resolve(shard_size, num_nodes, ranks_per_node, world_size, size)
            valid.append(size)
        except ValueError:
            pass
    assert suggested == valid, str(error.value)


def test_expert_parallel_splits_the_shard_dim_with_the_expert_dim_innermost():
    # 2 nodes x 8 ranks, shard_size 16 (both nodes), EP 4: (replicate, expert_shard, expert) = (1, 4, 4)
    topology = Topology.resolve(16, 2, 8, 16, expert_parallel_size=4)
    assert topology.mesh_dim_names == ("replicate", "expert_shard", "expert")
    assert topology.mesh_shape == (1, 4, 4)
    assert topology.flattened_dims == {"shard": ("expert_shard", "expert")}
    # the expert groups: 4 consecutive ranks, one node each
    assert topology.rank_groups("expert") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert topology.rank_groups("expert_shard") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # the dense parameters' shard dim is the flattened (expert_shard, expert): every rank in rank order
    assert topology.rank_groups("shard") == [list(range(16))]
    assert [topology.position_in_copy(rank) for rank in range(16)] == list(range(16))
    assert topology.data_parallel_size == 16
    assert "expert parallel (4)" in topology.describe()


def test_expert_parallel_size_must_divide_the_shard_group_and_stay_in_a_node():
    with pytest.raises(ValueError, match=r"expert_parallel_size\(3\) does not divide shard_size\(4\).*\[1, 2, 4\]"):
        Topology.resolve("node", 2, 4, 8, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size\(8\) does not divide ranks_per_node\(4\).*inside a"):
        Topology.resolve("world", 2, 4, 8, expert_parallel_size=8)
    with pytest.raises(ValueError, match=r"expert_parallel_size\(2\) with tensor_parallel_size\(2\) is not supported"):
        Topology.resolve("node", 2, 4, 8, tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=0\) is not valid"):
        Topology.resolve("node", 2, 4, 8, expert_parallel_size=0)


def test_context_parallel_splits_the_shard_dim_and_its_ranks_share_a_micro_batch():
    # 2 nodes x 4 ranks, shard_size "node", CP 2: (replicate, data_shard, context) = (2, 2, 2)
    topology = Topology.resolve("node", 2, 4, 8, context_parallel_size=2)
    assert topology.mesh_dim_names == ("replicate", "data_shard", "context")
    assert topology.mesh_shape == (2, 2, 2)
    assert topology.flattened_dims == {"shard": ("data_shard", "context")}
    assert topology.rank_groups("context") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topology.rank_groups("shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # parameters sharded as without CP
    assert topology.data_parallel_size == 4
    assert [topology.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "context parallel (2)" in topology.describe()


def test_context_parallel_size_refusals():
    with pytest.raises(ValueError, match=r"context_parallel_size\(8\) must divide shard_size\(4\) and ranks_per_node"):
        Topology.resolve("node", 2, 4, 8, context_parallel_size=8)
    with pytest.raises(ValueError, match=r"context_parallel_size\(2\) with tensor_parallel_size\(2\) is not supported"):
        Topology.resolve("node", 2, 4, 8, tensor_parallel_size=2, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"context_parallel_size\(2\) with expert_parallel_size\(2\) is not supported"):
        Topology.resolve("node", 2, 4, 8, expert_parallel_size=2, context_parallel_size=2)
