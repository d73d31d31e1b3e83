"""The cluster a dry run pretends to be: its size, the rank this process plays, and the launcher variables for it."""

from __future__ import annotations

from dataclasses import dataclass

ALL_KINDS = "all-kinds"


@dataclass(frozen=True)
class DryRunWorld:
    """``num_nodes`` x ``devices_per_node`` ranks, of which this process is ``rank`` (node by node, as torchrun)."""

    num_nodes: int
    devices_per_node: int
    rank: int

    def __post_init__(self) -> None:
        for name in ("num_nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} {value!r} must be a positive integer.")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"--rank {self.rank} is outside the world: {self.num_nodes} node(s) x {self.devices_per_node}"
                f" device(s) = {self.world_size} ranks, numbered 0..{self.world_size - 1}. Pass a rank in that range"
                f" or --rank {ALL_KINDS}."
            )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def node_rank(self) -> int:
        return self.rank // self.devices_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.devices_per_node

    def launcher_variables(self) -> dict[str, str]:
        """What torchrun would set for this rank (Lightning then reads it with ``TorchElasticEnvironment``)."""
        return {
            "TORCHELASTIC_RUN_ID": "fabric-hsdp-dryrun",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",  # never connected to: the fake process group has no store traffic
            "WORLD_SIZE": str(self.world_size),
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.devices_per_node),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
        }

    def describe(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size} ({self.num_nodes} node(s) x {self.devices_per_node}):"
            f" node {self.node_rank}, local rank {self.local_rank}"
        )


def parse_rank(text: str) -> int | str:
    """``--rank``'s value: a rank number, or ``all-kinds``."""
    if text == ALL_KINDS:
        return ALL_KINDS
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--rank {text!r} must be a rank number (0, 77, ...) or {ALL_KINDS}.") from None


def rank_kinds(mesh_shape: tuple[int, ...], devices_per_node: int) -> dict[int, str]:
    """One rank per distinct role in a mesh (row-major over its dims, as ``Topology`` numbers ranks): each
    combination of first/last coordinate along every dim, plus the first and last rank of a node. Rank -> label."""
    import itertools
    import math

    world = math.prod(mesh_shape)
    kinds: dict[int, list[str]] = {}
    for corner in itertools.product(*[sorted({0, size - 1}) for size in mesh_shape]):
        rank = 0
        for coordinate, size in zip(corner, mesh_shape, strict=True):
            rank = rank * size + coordinate
        kinds.setdefault(rank, []).append(f"mesh corner {corner}")
    for rank, label in ((0, "first of a node"), (min(devices_per_node, world) - 1, "last of a node")):
        kinds.setdefault(rank, []).append(label)
    return {rank: "; ".join(labels) for rank, labels in sorted(kinds.items())}
