"""A rank's local tensor as the boxes (:class:`~fabric_hsdp.checkpoint.core.box.Box`) of the *stored* tensor it
holds, for data that is not one DTensor box.

DCP knows a DTensor's local shard as one box of the global tensor. Two cases need more:

* rows regrouped by tensor parallelism (litgpt's ``qkv``, see :mod:`fabric_hsdp.models.fused_rows`): the
  local shard is several boxes of the stored tensor, which keeps the model's own row order;
* split replica reads (:mod:`fabric_hsdp.checkpoint.training.replica_split`): a rank reads only some rows of its shard.

:func:`pieces_of` maps local rows to boxes of the stored tensor, and :class:`StoredBoxes` presents them to DCP
through its checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), so DCP's own planning writes and reads each box, reshards across any layout, and
deduplicates replicas. DCP's default planners look objects up by type, so the planners of
:mod:`fabric_hsdp.checkpoint.core.dcp_planners` call :func:`lookup` for these. The same pieces serve raw loading
(:mod:`fabric_hsdp.checkpoint.training.raw_load`), which reads each box of a consolidated file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object

from fabric_hsdp.checkpoint.core.box import Box
from fabric_hsdp.checkpoint.core.tree import item_at, map_tree, tree_leaves
from fabric_hsdp.versions import compute_local_shape_and_global_offset

if TYPE_CHECKING:
    from fabric_hsdp.models.fused_rows import FusedRows


@dataclass(frozen=True)
class Piece:
    """Local rows ``[start, stop)`` hold the stored tensor's box that begins at ``offsets`` (all columns of it)."""

    start: int
    stop: int
    offsets: tuple[int, ...]

    def box(self, local_shape: Sequence[int]) -> Box:
        """The box of the stored tensor these rows hold, for a local tensor of ``local_shape``."""
        return Box(self.offsets, (self.stop - self.start, *local_shape[1:]) if len(local_shape) else ())


def global_box(tensor: torch.Tensor) -> Box:
    """The box this rank's local shard of ``tensor`` is of the global tensor (all of it if plain)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return Box((0,) * tensor.ndim, tuple(tensor.shape))
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return Box(tuple(offsets), tuple(sizes))


def pieces_of(tensor: torch.Tensor, fused: FusedRows | None, rows: tuple[int, int] | None = None) -> list[Piece]:
    """The boxes of the stored tensor that local rows ``rows`` (all by default) of ``tensor`` hold, in row order.

    ``fused``: how tensor parallelism regrouped the tensor's rows (``None``: the global tensor is the stored one).
    """
    box = global_box(tensor)
    offsets, sizes = box.offsets, box.sizes
    start, stop = rows if rows is not None else (0, sizes[0] if sizes else 1)
    if not offsets:  # a scalar
        return [Piece(0, 1, ())]
    if fused is None:
        return [Piece(start, stop, (offsets[0] + start, *offsets[1:]))]
    return [
        Piece(start + offset, start + offset + length, (stored_row, *offsets[1:]))
        for offset, stored_row, length in fused.stored_pieces(offsets[0] + start, offsets[0] + stop)
    ]


class StoredBoxes:
    """``local`` (a contiguous tensor) presented to DCP as the boxes ``pieces`` of a stored tensor of ``size``.

    Writing, DCP saves each piece as a chunk at its offsets; reading, it fills each piece's rows of ``local`` in
    place, so the DTensor (or tensor) that ``local`` belongs to holds the result.
    """

    def __init__(self, local: torch.Tensor, size: torch.Size, pieces: list[Piece]) -> None:
        if not local.is_contiguous():
            raise ValueError("StoredBoxes needs a contiguous local tensor")
        self.local = local
        self._size = torch.Size(size)
        self.pieces = pieces

    def size(self) -> torch.Size:
        """The stored tensor's shape (DCP compares it with the checkpoint's)."""
        return self._size

    def _sizes(self, piece: Piece) -> torch.Size:
        return torch.Size(piece.box(self.local.shape).sizes)

    def _rows(self, piece: Piece) -> torch.Tensor:
        return self.local[piece.start : piece.stop] if self.local.ndim else self.local

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(piece.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=self._sizes(piece)),
                    properties=properties,
                    size=self._size,
                ),
            )
            for piece in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(piece.offsets), self._sizes(piece)) for piece in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for piece in self.pieces:
            if torch.Size(piece.offsets) == index.offset:
                return self._rows(piece)
        raise ValueError(f"{index.fqn!r} holds no box at {list(index.offset or [])}")

    def copy_to_cpu(self) -> StoredBoxes:
        """The same boxes over a CPU copy of ``local`` (what a background save writes from)."""
        return StoredBoxes(self.local.detach().to("cpu", copy=True), self._size, self.pieces)


def boxes_of(tensor: torch.Tensor, fused: FusedRows | None, rows: tuple[int, int] | None = None) -> StoredBoxes:
    """``tensor``'s local rows ``rows`` (all by default) as the boxes of the stored tensor they hold."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return StoredBoxes(local, tensor.shape, pieces_of(tensor, fused, rows))


def regrouped_boxes(param: str | None, tensor: torch.Tensor, fused: dict[str, FusedRows]) -> StoredBoxes | None:
    """The boxes of a tensor whose rows tensor parallelism regrouped; ``None`` for others (DCP stores them as they
    are). ``param``: the parameter it belongs to (see :func:`dcp_view`)."""
    if param not in fused or tensor.ndim == 0:
        return None
    return boxes_of(tensor, fused[param])


def lookup(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    """What DCP's planners look up for ``index``: a box of a :class:`StoredBoxes`, else DCP's own answer."""
    value = state_dict.get(index.fqn)
    if isinstance(value, StoredBoxes):
        return value.__get_tensor_shard__(index)
    return find_state_dict_object(state_dict, index)


def stored_boxes_in(tree: Any) -> list[tuple[Any, Any, StoredBoxes]]:
    """``(container, key, value)`` of every :class:`StoredBoxes` in nested dicts and lists."""
    return [(item_at(tree, path[:-1]), path[-1], boxes) for path, boxes in tree_leaves(tree, StoredBoxes)]


@dataclass
class Replaced:
    """One entry of a state dict that :func:`dcp_view` replaced: where, the original, and its replacement."""

    container: dict
    key: Any
    original: torch.Tensor
    boxes: StoredBoxes


def put_back(replaced: list[Replaced]) -> None:
    """Put the original tensors back into a DCP view after a load (they hold what was read into their boxes); the
    view then holds everything else the load set, e.g. optimizer ``param_groups``."""
    for entry in replaced:
        entry.container[entry.key] = entry.original


def dcp_view(
    state: dict[str, Any], replace: Callable[[str | None, torch.Tensor], StoredBoxes | None]
) -> tuple[dict[str, Any], list[Replaced]]:
    """A copy of ``state`` (model and optimizer state dicts by key) where ``replace(param_name, tensor)`` says so.

    ``param_name`` is the parameter a tensor belongs to: the key of a model entry, or ``fqn`` of an optimizer's
    ``state[fqn][name]`` (``None`` for others). Containers are copied, tensors are not: the replacements share memory
    with the originals.
    """
    found: list[tuple[tuple, torch.Tensor, StoredBoxes]] = []

    def visit(tensor: torch.Tensor, path: tuple) -> Any:
        if len(path) < 2 or not isinstance(item_at(state, path[:-1]), dict):  # top level, or in a list: as it is
            return tensor
        boxes = replace(_param_of(path), tensor)
        if boxes is None:
            return tensor
        found.append((path, tensor, boxes))
        return boxes

    view = dict(map_tree(state, visit, torch.Tensor))
    return view, [Replaced(item_at(view, path[:-1]), path[-1], tensor, boxes) for path, tensor, boxes in found]


def _param_of(path: tuple) -> str | None:
    """The parameter a tensor belongs to: ``(model, name)`` -> name; ``(optimizer, "state", fqn, stat)`` -> fqn."""
    if len(path) == 4 and path[1] == "state" and isinstance(path[2], str):
        return path[2]
    if len(path) == 2 and isinstance(path[1], str):
        return path[1]
    return None
