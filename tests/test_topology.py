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
    assert "'shard'=2" in text and "'replicate'=2" in text
