"""The topology of a job: its degrees, their validation, the named ``DeviceMesh`` and its sub-meshes by purpose.

A world of ``num_nodes x ranks_per_node`` ranks is laid out node by node (Lightning's ``global_rank = node_rank *
ranks_per_node + local_rank``). ``shard_size`` ranks hold one copy of the model together (a node, part of one, or
several whole nodes); ``replicate_size = world / shard_size`` copies exist. With tensor parallelism of degree ``T``
each copy is split ``T`` ways by tensor parallelism and ``S = shard_size / T`` ways by FSDP:

* ``T == 1``: a 2-D mesh ``(replicate, shard)`` of shape ``(R, shard_size)``.
* ``T > 1``: a 3-D mesh ``(replicate, shard, tensor)`` of shape ``(R, S, T)``, tensor innermost: rank ``(r * S + s) *
  T + t``, so tensor-parallel peers are consecutive ranks of one node and their traffic never leaves it.
* Expert parallelism of degree ``N`` (``T == 1``): the shard dim split into ``(expert_shard, expert)`` of shape
  ``(R, shard_size / N, N)``, expert innermost (consecutive ranks of one node), and flattened back into ``shard``
  for every dense parameter: shard index ``f * N + e`` is the rank's place in its copy as without experts, so dense
  sharding and every checkpoint stay as they are. A layer's experts are split ``N`` ways over ``expert`` and sharded
  by FSDP over ``(replicate, expert_shard)``.
* Context parallelism of degree ``C`` (``T == 1``, no experts split): the shard dim split the same way into
  ``(data_shard, context)`` of shape ``(R, shard_size / C, C)``, context innermost, flattened back into ``shard``:
  parameters are sharded as without it (torchtitan folds its ``cp`` dim into FSDP's), and the ``C`` ranks of a
  context group split each sequence among them, so they take the same micro-batch.

Parameters, gradients and optimizer state are sharded along ``shard`` (and ``tensor``); only the gradient all-reduce
of each shard travels along ``replicate``. Every rank of a tensor-parallel group computes on the same micro-batch:
the data-parallel ranks are the ``R * S`` (replicate, shard) coordinates.

:class:`Topology` holds the degrees and can be built without processes (unit tests, the planner);
:meth:`Topology.build_mesh` makes the :class:`ParallelMesh`, the only object that knows the mesh's dim order: other
modules ask it for the sub-mesh they need by purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

REPLICATE_DIM = "replicate"
SHARD_DIM = "shard"
TENSOR_DIM = "tensor"
EXPERT_SHARD_DIM = "expert_shard"
EXPERT_DIM = "expert"
DATA_SHARD_DIM = "data_shard"
CONTEXT_DIM = "context"
# (shard, tensor) as one dim: the ranks that hold one copy of the model (see Topology.build_mesh)
SHARD_TENSOR_DIM = "shard_tensor"

ShardSize = Literal["node", "world"] | int


def validate_shard_size(shard_size: ShardSize) -> ShardSize:
    """Check the form of ``shard_size`` before any process exists (the arithmetic is checked in ``resolve``)."""
    if shard_size in ("node", "world"):
        return shard_size
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(
            f"HybridFSDPStrategy(shard_size={shard_size!r}) is not valid. Use 'node' (shard within each node, replicate"
            " across nodes), 'world' (plain FSDP over all ranks), or a positive number of ranks per shard group,"
            " e.g. shard_size=16 to shard over two 8-GPU nodes."
        )
    return shard_size


def validate_tensor_parallel_size(tensor_parallel_size: int) -> int:
    """Check the form of ``tensor_parallel_size`` before any process exists."""
    return _positive_size("tensor_parallel_size", tensor_parallel_size, "tensor", "split each layer")


def validate_context_parallel_size(context_parallel_size: int) -> int:
    """Check the form of ``context_parallel_size`` before any process exists."""
    return _positive_size("context_parallel_size", context_parallel_size, "context", "split each sequence")


def validate_expert_parallel_size(expert_parallel_size: int) -> int:
    """Check the form of ``expert_parallel_size`` before any process exists."""
    return _positive_size("expert_parallel_size", expert_parallel_size, "expert", "split each layer's experts")


def _positive_size(argument: str, size: int, lever: str, what: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"HybridFSDPStrategy({argument}={size!r}) is not valid: pass a positive number of ranks that {what}, a"
            f" divisor of the devices per node (1 turns {lever} parallelism off)."
        )
    return size


@dataclass(frozen=True)
class Topology:
    """Degrees of the mesh, validated against the cluster they run on.

    Attributes:
        num_nodes: Nodes in the job.
        ranks_per_node: Processes (devices) per node.
        shard_size: Ranks that hold one copy of the model together (``tensor_parallel_size`` of them split each
            layer by tensor parallelism, the rest by FSDP).
        tensor_parallel_size: Ranks that split each layer (1: no tensor parallelism).
        expert_parallel_size: Ranks that split each layer's experts among them, exchanging tokens (1: none).
        context_parallel_size: Ranks that split each sequence among them (1: none).
    """

    num_nodes: int
    ranks_per_node: int
    shard_size: int
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def replicate_size(self) -> int:
        """Copies of the model (``R``)."""
        return self.world_size // self.shard_size

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards each tensor-parallel slice over (``S = shard_size / T``)."""
        return self.shard_size // self.tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that compute on different data; tensor-parallel and context-parallel peers share a micro-batch."""
        return self.world_size // (self.tensor_parallel_size * self.context_parallel_size)

    @property
    def expert_shard_size(self) -> int:
        """Ranks FSDP shards each expert-parallel slice of the experts over, in one copy (``shard_size / N``)."""
        return self.shard_size // self.expert_parallel_size

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        if self.expert_parallel_size > 1:
            return (REPLICATE_DIM, EXPERT_SHARD_DIM, EXPERT_DIM)
        if self.context_parallel_size > 1:
            return (REPLICATE_DIM, DATA_SHARD_DIM, CONTEXT_DIM)
        if self.tensor_parallel_size == 1:
            return (REPLICATE_DIM, SHARD_DIM)
        return (REPLICATE_DIM, SHARD_DIM, TENSOR_DIM)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.expert_parallel_size > 1:
            return (self.replicate_size, self.expert_shard_size, self.expert_parallel_size)
        if self.context_parallel_size > 1:
            return (self.replicate_size, self.shard_size // self.context_parallel_size, self.context_parallel_size)
        if self.tensor_parallel_size == 1:
            return (self.replicate_size, self.shard_size)
        return (self.replicate_size, self.fsdp_size, self.tensor_parallel_size)

    @property
    def flattened_dims(self) -> dict[str, tuple[str, ...]]:
        """The dims made of others (``shard`` of ``(expert_shard, expert)`` under expert parallelism, ``shard_tensor``
        of ``(shard, tensor)`` under tensor parallelism), by name."""
        if self.expert_parallel_size > 1:
            return {SHARD_DIM: (EXPERT_SHARD_DIM, EXPERT_DIM)}
        if self.context_parallel_size > 1:
            return {SHARD_DIM: (DATA_SHARD_DIM, CONTEXT_DIM)}
        if self.tensor_parallel_size > 1:
            return {SHARD_TENSOR_DIM: (SHARD_DIM, TENSOR_DIM)}
        return {}

    @classmethod
    def resolve(
        cls,
        shard_size: ShardSize,
        num_nodes: int,
        ranks_per_node: int,
        world_size: int,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
    ) -> Topology:
        """Turn ``shard_size`` ('node', 'world' or a number) and the tensor-parallel size into a validated topology.

        Raises:
            ValueError: The sizes don't multiply out, a shard group would straddle nodes unevenly, or tensor
                parallelism would cross a node or not fit the shard group, or expert parallelism would cross a node,
                not divide the shard group or come with tensor parallelism. The message shows the arithmetic and
                the values that would work.
        """
        shard_size = validate_shard_size(shard_size)
        tensor_parallel_size = validate_tensor_parallel_size(tensor_parallel_size)
        if num_nodes * ranks_per_node != world_size:
            raise ValueError(
                f"num_nodes({num_nodes}) * ranks_per_node({ranks_per_node}) != WORLD_SIZE({world_size}). Pass"
                " Fabric(num_nodes=..., devices=...) matching what the launcher started (e.g. `fabric run"
                " --num-nodes N --devices M`, or SLURM's --nodes and --ntasks-per-node)."
            )
        if shard_size == "node":
            size = ranks_per_node
        elif shard_size == "world":
            size = world_size
        else:
            size = shard_size
        if world_size % size != 0:
            raise ValueError(
                f"shard_size({size}) does not divide WORLD_SIZE({world_size}) = num_nodes({num_nodes}) *"
                f" ranks_per_node({ranks_per_node}): replicate_size would be {world_size / size:g}. Choose a divisor:"
                f" {_divisors(world_size)}."
            )
        if size < ranks_per_node and ranks_per_node % size != 0:
            raise ValueError(
                f"shard_size({size}) does not divide ranks_per_node({ranks_per_node}), so a shard group would straddle"
                f" two nodes. Choose a divisor of ranks_per_node ({_divisors(ranks_per_node)}) or a multiple of it."
            )
        if size > ranks_per_node and size % ranks_per_node != 0:
            raise ValueError(
                f"shard_size({size}) is not a multiple of ranks_per_node({ranks_per_node}), so a shard group would"
                f" cover a fraction of a node. Choose a multiple of {ranks_per_node} that divides WORLD_SIZE"
                f"({world_size}): {[d for d in _divisors(world_size) if d % ranks_per_node == 0]}."
            )
        # the sizes that pass both checks below; the model's heads and split dims are checked at setup_module
        layout_sizes = _divisors(math.gcd(ranks_per_node, size))
        if ranks_per_node % tensor_parallel_size != 0:
            raise ValueError(
                f"tensor_parallel_size({tensor_parallel_size}) does not divide ranks_per_node({ranks_per_node}): tensor"
                " parallelism exchanges activations in every layer and must stay inside a node. Choose a size that"
                f" divides ranks_per_node and shard_size({size}): {layout_sizes} (the model's heads are checked"
                " at setup_module)."
            )
        if size % tensor_parallel_size != 0:
            raise ValueError(
                f"tensor_parallel_size({tensor_parallel_size}) does not divide shard_size({size}): the ranks that hold"
                f" one copy of the model are split into FSDP x tensor-parallel groups. Choose a divisor of {size}:"
                f" {layout_sizes} (the model's heads are checked at setup_module), or a larger shard_size."
            )
        _check_expert_parallel(validate_expert_parallel_size(expert_parallel_size), ranks_per_node, size)
        if expert_parallel_size > 1 and tensor_parallel_size > 1:
            raise ValueError(
                f"expert_parallel_size({expert_parallel_size}) with tensor_parallel_size({tensor_parallel_size}) is"
                " not supported: the tokens each tensor-parallel group shares would have to be split among its ranks"
                " before the experts' exchange. Use one of them: expert_parallel_size for a mixture-of-experts model,"
                " tensor_parallel_size for a dense one."
            )
        _check_context_parallel(
            validate_context_parallel_size(context_parallel_size), ranks_per_node, size, tensor_parallel_size,
            expert_parallel_size,
        )  # fmt: skip
        return cls(num_nodes, ranks_per_node, size, tensor_parallel_size, expert_parallel_size, context_parallel_size)

    def coordinates(self, global_rank: int) -> tuple[int, ...]:
        """This rank's coordinates in the mesh, one per dim of :attr:`mesh_dim_names`."""
        replica, position = divmod(global_rank, self.shard_size)
        if self.expert_parallel_size > 1:
            return (replica, *divmod(position, self.expert_parallel_size))
        if self.context_parallel_size > 1:
            return (replica, *divmod(position, self.context_parallel_size))
        if self.tensor_parallel_size == 1:
            return (replica, position)
        return (replica, *divmod(position, self.tensor_parallel_size))

    def rank_groups(self, dim: str) -> list[list[int]]:
        """The rank groups along mesh dim ``dim`` (``"replicate"``, ``"shard"`` = FSDP, ``"tensor"``, ``"expert"``,
        ``"expert_shard"``), each in rank order: the ranks whose :meth:`coordinates` differ in ``dim`` only (in the
        dims it is made of, for a flattened one). A dim the mesh lacks has every rank in a group of its own."""
        known = (REPLICATE_DIM, SHARD_DIM, TENSOR_DIM, EXPERT_SHARD_DIM, EXPERT_DIM, DATA_SHARD_DIM, CONTEXT_DIM)
        if dim not in known:
            raise ValueError(f"mesh dim {dim!r} is not one of {', '.join(map(repr, known))}")
        parts = self.flattened_dims.get(dim, (dim,))
        if not set(parts) <= set(self.mesh_dim_names):
            return [[rank] for rank in range(self.world_size)]
        kept = [index for index, name in enumerate(self.mesh_dim_names) if name not in parts]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coordinates = self.coordinates(rank)
            groups.setdefault(tuple(coordinates[index] for index in kept), []).append(rank)
        return list(groups.values())

    def position_in_copy(self, global_rank: int) -> int:
        """Which part of one model copy this rank holds (``shard * T + tensor``), in ``0 .. shard_size - 1``."""
        return global_rank % self.shard_size

    def data_parallel_rank(self, global_rank: int) -> int:
        """This rank's index among the ``data_parallel_size`` ranks that compute on different data."""
        return global_rank // (self.tensor_parallel_size * self.context_parallel_size)

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The named mesh over all ranks (needs the default process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        from fabric_hsdp.versions import flatten_mesh

        device_mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        # Under TP, a DTensor split by FSDP and TP is partial over (shard, tensor) when reduced whole (the gradient
        # norm): DTensor uses one all-reduce over both dims only if this flattened dim exists, else it runs one per
        # dim and logs "While redistributing ... flatten mesh dimensions ["shard", "tensor"]" (as torchtitan's
        # flattened data-parallel dims). Under EP, the dense parameters' shard dim is (expert_shard, expert).
        for name, parts in self.flattened_dims.items():
            flatten_mesh(device_mesh[parts], name)
        return ParallelMesh(self, device_mesh)

    def describe(self) -> str:
        """One paragraph for the log: nodes, ranks per node, mesh shape and what each dim means."""
        if self.replicate_size == 1:
            kind = "FSDP over all ranks (no replication)"
        elif self.shard_size == 1:
            kind = "pure replication (DDP-like; nothing is sharded)"
        else:
            kind = "HSDP"
        if self.tensor_parallel_size > 1:
            kind += f" + tensor parallel ({self.tensor_parallel_size})"
        if self.expert_parallel_size > 1:
            kind += f" + expert parallel ({self.expert_parallel_size})"
        if self.context_parallel_size > 1:
            kind += f" + context parallel ({self.context_parallel_size})"
        nodes_per_group = max(1, self.shard_size // self.ranks_per_node)
        span = f"{nodes_per_group} node(s)" if self.shard_size >= self.ranks_per_node else "part of one node"
        text = (
            f"{kind}: {self.num_nodes} node(s) x {self.ranks_per_node} rank(s) per node = {self.world_size} ranks;"
            f" mesh {self.mesh_shape} with dims {self.mesh_dim_names}: "
        )
        if self.expert_parallel_size > 1:
            text += (
                f"'{SHARD_DIM}'={self.shard_size} ranks hold one sharded copy of the model ({span}); each layer's"
                f" experts split '{EXPERT_DIM}'={self.expert_parallel_size} ways (tokens exchanged all-to-all) and"
                f" '{EXPERT_SHARD_DIM}'={self.expert_shard_size} ways by FSDP"
            )
        elif self.context_parallel_size > 1:
            text += (
                f"'{SHARD_DIM}'={self.shard_size} ranks hold one sharded copy of the model ({span}); each sequence"
                f" split '{CONTEXT_DIM}'={self.context_parallel_size} ways (keys and values all-gathered)"
            )
        elif self.tensor_parallel_size == 1:
            text += f"'{SHARD_DIM}'={self.shard_size} ranks hold one sharded copy of the model ({span})"
        else:
            text += (
                f"{self.shard_size} ranks hold one copy of the model ({span}), each layer split"
                f" '{TENSOR_DIM}'={self.tensor_parallel_size} ways by tensor parallelism inside a node and"
                f" '{SHARD_DIM}'={self.fsdp_size} ways by FSDP"
            )
        if self.replicate_size == 1:  # nothing to exchange between copies: there is one
            replicas = f", '{REPLICATE_DIM}'=1: one copy, no gradient all-reduce between copies"
        else:
            replicas = (
                f", '{REPLICATE_DIM}'={self.replicate_size} copies exchange only gradient all-reduces of their shards"
            )
        return text + f"{replicas}; {self.data_parallel_size} data-parallel ranks."


class ParallelMesh:
    """The job's ``DeviceMesh`` and its sub-meshes by purpose. Consumers ask for what they need, never by position.

    Attributes:
        topology: The degrees the mesh was built from.
        device_mesh: The whole named mesh (2-D, or 3-D with tensor parallelism).
    """

    def __init__(self, topology: Topology, device_mesh: DeviceMesh) -> None:
        self.topology = topology
        self.device_mesh = device_mesh

    @property
    def fsdp(self) -> DeviceMesh:
        """The 2-D ``(replicate, shard)`` mesh ``fully_shard`` shards over (HSDP)."""
        from fabric_hsdp.versions import slice_with_flattened

        if self.device_mesh.mesh_dim_names == (REPLICATE_DIM, SHARD_DIM):
            return self.device_mesh
        return slice_with_flattened(self.device_mesh, (REPLICATE_DIM, SHARD_DIM))

    @property
    def expert(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's expert-parallel group (the ranks that exchange tokens); ``None`` without
        expert parallelism."""
        if self.topology.expert_parallel_size == 1:
            return None
        return self.device_mesh[EXPERT_DIM]

    @property
    def context(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's context-parallel group (the ranks that split one sequence); ``None`` without
        context parallelism."""
        if self.topology.context_parallel_size == 1:
            return None
        return self.device_mesh[CONTEXT_DIM]

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """The 2-D ``(replicate, expert_shard)`` mesh the experts' FSDP unit shards over; ``None`` without expert
        parallelism."""
        if self.topology.expert_parallel_size == 1:
            return None
        return self.device_mesh[REPLICATE_DIM, EXPERT_SHARD_DIM]

    @property
    def tensor(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's tensor-parallel group; ``None`` without tensor parallelism."""
        if self.topology.tensor_parallel_size == 1:
            return None
        return self.device_mesh[TENSOR_DIM]

    @property
    def replicate(self) -> DeviceMesh:
        """The 1-D mesh of the ranks that hold the same part of the model in other copies."""
        return self.device_mesh[REPLICATE_DIM]

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self.topology.mesh_dim_names

    def size(self, dim_name: str) -> int:
        """How many ranks one named dim spans (a flattened one: the product of its parts)."""
        sizes = dict(zip(self.dim_names, self.topology.mesh_shape, strict=True))
        return math.prod(sizes[part] for part in self.topology.flattened_dims.get(dim_name, (dim_name,)))

    def group(self, dim_name: str) -> dist.ProcessGroup:
        """The process group of this rank along one named dim (a flattened one through a slice of the mesh)."""
        from fabric_hsdp.versions import slice_with_flattened

        if dim_name in self.dim_names:
            return self.device_mesh.get_group(dim_name)  # ~1 us; a slice takes ~100 us (make_replicas_identical
            # asks once per tensor and dim)
        return slice_with_flattened(self.device_mesh, (dim_name,)).get_group()

    def replicated_dims(self, tensor: Any) -> list[str]:
        """The dims along which ``tensor`` holds the same values on every rank.

        A plain tensor is replicated everywhere. A DTensor is replicated along the dims of the job's mesh that its
        own mesh lacks (FSDP-only parameters under tensor parallelism live on the 2-D sub-mesh) and along those where
        its placement is ``Replicate()``; a dense parameter sharded over the flattened ``shard`` of expert
        parallelism is sharded over both its parts.
        """
        from torch.distributed.tensor import DTensor, Replicate

        if not isinstance(tensor, DTensor):
            return list(self.dim_names)
        split = set()
        for name, placement in zip(tensor.device_mesh.mesh_dim_names or (), tensor.placements):
            if not isinstance(placement, Replicate):
                split.update(self.topology.flattened_dims.get(name, (name,)))
        return [name for name in self.dim_names if name not in split]


def _check_expert_parallel(expert_parallel_size: int, ranks_per_node: int, shard_size: int) -> None:
    if expert_parallel_size == 1:
        return
    fitting = _divisors(math.gcd(ranks_per_node, shard_size))
    if shard_size % expert_parallel_size != 0:
        raise ValueError(
            f"expert_parallel_size({expert_parallel_size}) does not divide shard_size({shard_size}): the ranks that"
            " hold one copy of the model are split into expert-shard x expert groups. Choose a divisor of"
            f" {shard_size} that divides ranks_per_node({ranks_per_node}): {fitting} (the experts per layer are"
            " checked at setup_module)."
        )
    if ranks_per_node % expert_parallel_size != 0:
        raise ValueError(
            f"expert_parallel_size({expert_parallel_size}) does not divide ranks_per_node({ranks_per_node}): the"
            " ranks of an expert-parallel group exchange every MoE layer's tokens all-to-all, forward and backward,"
            f" and must stay inside a node. Choose {fitting} (the experts per layer are checked at setup_module)."
        )


def _check_context_parallel(size: int, ranks_per_node: int, shard_size: int, tensor: int, expert: int) -> None:
    if size == 1:
        return
    if tensor > 1 or expert > 1:
        other = f"tensor_parallel_size({tensor})" if tensor > 1 else f"expert_parallel_size({expert})"
        raise ValueError(
            f"context_parallel_size({size}) with {other} is not supported yet: each splits the shard group its own"
            " way. Use context parallelism alone with FSDP/HSDP."
        )
    fitting = _divisors(math.gcd(ranks_per_node, shard_size))
    if shard_size % size != 0 or ranks_per_node % size != 0:
        raise ValueError(
            f"context_parallel_size({size}) must divide shard_size({shard_size}) and ranks_per_node({ranks_per_node}):"
            " the ranks that split a sequence gather its keys and values in every layer, inside one node and one"
            f" copy of the model. Choose {fitting}."
        )


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
