"""Staging for background saves: plan first, then copy to CPU only the chunks this rank writes, into kept buffers.

Under HSDP with ``R`` replicas DCP's planner writes each replicated shard once, from one of its ``R`` holders, so a
rank writes about ``1/R`` of its state. Copying the whole state to CPU before the write (what DCP's and Lightning's
async saves do) holds ``(R - 1)/R`` of it in host memory for nothing, and allocating fresh memory at every save
costs a page fault per 4 KiB. :class:`Stager` instead

1. runs DCP's local planning and its deduplication (``dedup_save_plans``, on the plans all-gathered over the
   background group), so every rank knows which chunks it will write, before copying anything;
2. copies only those chunks into one host block of their exact size, kept from one save to the next (on CUDA:
   pageable memory registered with ``cudaHostRegister``, as DCP's ``_create_cpu_state_dict`` does, rather than a
   pinned block per tensor from the caching host allocator, which rounds each up to a power of two and keeps it), and
   presents them to DCP as :class:`~fabric_hsdp.checkpoint.core.boxes.StoredBoxes` (the boxes of the stored tensors
   they hold), leaving out everything this rank does not write. DCP's planning inside the write then finds each
   chunk on one rank only, so the checkpoint is the same as a blocking save's. Each chunk (and each piece of one)
   reaches DCP as a tensor whose storage is its own bytes of the block (:func:`own_storage`): DCP's writer clones a
   tensor whose storage is larger and keeps the clones until the file is closed;
3. on CUDA, issues the copies on a side stream, each after the compute stream's work so far, non-blocking, straight
   from views of the live shards into their rows of the buffer (no temporary made on the compute stream); the compute
   stream waits for them only before the next optimizer step, the first in-place update of what they read (as
   torchtitan waits for staging before ``optimizers.step()``), so the next forward and backward overlap them; the
   writing thread sets the rank's device and synchronises on the copies' event before it reads the buffers.

Extra host memory during a background save is then about ``1/R`` of the rank's state (plus the file writer's two
16 MiB buffers and small non-tensor entries; the process's peak, measured from before the first save: 0.52 of the
state at R = 2, ``tests/checkpoint/test_staging.py``), and ``fabric.save`` returns once the copies are issued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fabric_hsdp.checkpoint.core.boxes import Piece, StoredBoxes, pieces_of
from fabric_hsdp.checkpoint.core.dcp_planners import SavePlanner
from fabric_hsdp.checkpoint.core.tree import map_tree, tree_leaves
from fabric_hsdp.versions import dedup_save_plans, flatten_state_dict, unflatten_state_dict


@dataclass
class Staged:
    """What a background save writes: ``state`` (this rank's chunks only), ``ready()`` to call before reading it."""

    state: dict[str, Any]
    ready: Callable[[], None]
    nbytes: int  # bytes of tensor data staged on this rank


class Stager:
    """A strategy's staging buffers for background saves, kept from one save to the next."""

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None  # one host allocation holding every staged chunk
        self._block_registered = False  # page-locked with cudaHostRegister
        self._layout: dict[tuple, tuple[torch.Size, torch.dtype]] = {}  # the chunks in it, in order
        self._buffers: dict[tuple, torch.Tensor] = {}  # each chunk's view of the block
        self._stream: Any = None
        self._pending: list[Any] = []  # CUDA events of copies the next optimizer step must wait for
        self._step_hook: Any = None

    def stage(self, state: dict[str, Any], group: Any) -> Staged:
        """Copy the chunks of ``state`` (model and optimizer state dicts) that this rank writes; see the module doc.

        A collective over ``group`` (the background saves' gloo group). The buffers of the previous save are
        reused: call it only once that save has been written.
        """
        return self.copy(state, self.plan(state, group))

    def plan(self, state: dict[str, Any], group: Any) -> dict[str, set]:
        """Which chunks of ``state`` this rank writes: DCP's dedup of every rank's plan (a collective over ``group``).

        Returns:
            The flattened key of each entry this rank writes -> the offsets of its chunks (``None`` for non-tensors).
        """
        planner = SavePlanner()
        planner.set_up_planner(state, is_coordinator=dist.get_rank(group) == 0)
        plans: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(plans, planner.create_local_plan(), group=group)
        written: dict[str, set] = {}
        for item in dedup_save_plans(plans)[dist.get_rank(group)].items:
            offset = tuple(item.index.offset) if item.index.offset is not None else None
            written.setdefault(item.index.fqn, set()).add(offset)
        return written

    def copy(self, state: dict[str, Any], written: dict[str, set]) -> Staged:
        """Copy the chunks of ``state`` that :meth:`plan` says this rank writes (no collective)."""
        flat, mappings = flatten_state_dict(state)
        left_out = [fqn for fqn, value in flat.items() if fqn not in written and isinstance(value, _TENSORS)]
        if any(not isinstance(key, str) for fqn in left_out for key in mappings[fqn]):
            return self._stage_all(state)  # a tensor in a list: leaving it out would shift the list's indices
        layout = _Shapes()
        _walk(flat, written, layout)  # the chunks' shapes first: one block of their exact size
        copies = _Copies(self, self._views(layout))
        staged = _walk(flat, written, copies)
        return Staged(unflatten_state_dict(staged, mappings), copies.finish(), copies.nbytes)

    def _views(self, layout: _Shapes) -> dict[tuple, torch.Tensor]:
        """Each chunk's buffer: a view of the block, the previous save's block when the chunks are the same."""
        if self._block is None or layout.chunks != self._layout or layout.pinned != self._block_registered:
            self._release_block()
            offsets, size = {}, 0
            for key, (shape, dtype) in layout.chunks.items():
                offsets[key] = size
                size += -(-shape.numel() * dtype.itemsize // _ALIGNMENT) * _ALIGNMENT
            block = torch.empty(size, dtype=torch.uint8)
            if layout.pinned:
                _register(block)
            self._block, self._block_registered, self._layout = block, layout.pinned, layout.chunks
            self._buffers = {}
            for key, (shape, dtype) in layout.chunks.items():
                memory = block[offsets[key] : offsets[key] + shape.numel() * dtype.itemsize]
                self._buffers[key] = own_storage(memory, dtype, shape)
        return self._buffers

    def wait_before_next_step(self, event: Any) -> None:
        """The next optimizer step (any optimizer: the first in-place update of the shards) runs after ``event``."""
        self._pending.append(event)
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for event in self._pending:
            event.wait()  # the current stream waits; the host does not
        self._pending.clear()
        self._step_hook.remove()
        self._step_hook = None

    def _stage_all(self, state: dict[str, Any]) -> Staged:
        copies = copy_to_cpu(state)
        return Staged(copies, lambda: None, _tensor_bytes(copies))

    def close(self) -> None:
        """Free the block and the stream (the last save was written: its writer waited for the copies)."""
        if self._step_hook is not None:
            self._step_hook.remove()
        self._step_hook, self._pending = None, []
        self._release_block()
        self._stream = None

    def _release_block(self) -> None:
        if self._block_registered:
            torch.cuda.cudart().cudaHostUnregister(self._block.data_ptr())
        self._block, self._block_registered, self._layout, self._buffers = None, False, {}, {}

    def _copy_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


_TENSORS = (torch.Tensor, StoredBoxes)
_ALIGNMENT = 64  # bytes: every chunk of the block starts at a multiple (any dtype's view is aligned)


def _walk(flat: dict[str, Any], written: dict[str, set], chunks: _Chunks) -> dict[str, Any]:
    """The staged entries: each entry this rank writes handed to ``chunks``; non-tensors kept everywhere (not copied;
    DCP's own dedup picks their writer again); tensors another rank writes left out."""
    staged = {}
    for fqn, value in flat.items():
        if fqn in written or not isinstance(value, _TENSORS):
            staged[fqn] = chunks.stage(fqn, value, written.get(fqn, set()))
    return staged


class _Chunks:
    """One staging's walk over an entry: the chunks this rank writes, each handed to :meth:`_copy` with the views of
    the live state it is made of."""

    def stage(self, fqn: str, value: Any, offsets: set) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(value, StoredBoxes):
            return self._boxes(fqn, value.local, value.size(), value.pieces, offsets)
        if isinstance(value, DTensor):
            if value.ndim == 0:
                return self._boxes(fqn, value.to_local(), value.shape, [Piece(0, 1, ())], offsets)
            return self._boxes(fqn, value.to_local(), value.shape, pieces_of(value, None), offsets)
        if isinstance(value, torch.Tensor):
            return self._copy((fqn,), value.detach())
        return value  # a non-tensor entry (DCP pickles it): state dicts hold fresh values, not live references

    def _boxes(self, fqn: str, local: torch.Tensor, size: Any, pieces: list[Piece], offsets: set) -> Any:
        mine = [piece for piece in pieces if tuple(piece.offsets) in offsets]
        if local.ndim == 0:
            return StoredBoxes(self._copy((fqn, ()), local.detach()), size, mine)
        rows, kept = 0, []
        for piece in mine:  # the rows this rank writes, packed into one buffer
            kept.append(Piece(rows, rows + piece.stop - piece.start, piece.offsets))
            rows += piece.stop - piece.start
        key = (fqn, *(tuple(piece.offsets) for piece in mine))
        # each piece straight into its rows of the buffer: a joined temporary (torch.cat) would be made on the
        # compute stream after the copy stream's wait, and the copy could read it before it is written
        sources = [local.detach()[piece.start : piece.stop] for piece in mine]
        return _StagedBoxes(self._copy(key, sources, (rows, *local.shape[1:])), size, kept)

    def _copy(self, key: tuple, sources: torch.Tensor | list[torch.Tensor], shape: Any = None) -> torch.Tensor:
        raise NotImplementedError


class _StagedBoxes(StoredBoxes):
    """Staged boxes whose pieces DCP's writer takes as they are: each piece a tensor with a storage of its own bytes
    (of the same memory), like every chunk's buffer (see :func:`own_storage`)."""

    def _rows(self, piece: Piece) -> torch.Tensor:
        rows = super()._rows(piece)
        if rows.nbytes == rows.untyped_storage().nbytes():
            return rows
        return own_storage(rows, rows.dtype, rows.shape)


def own_storage(memory: torch.Tensor, dtype: torch.dtype, shape: Any) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over the bytes of ``memory`` (a contiguous CPU tensor), whose storage is
    exactly those bytes, not the whole block they are part of; it keeps the block alive.

    DCP's file writer clones every CPU tensor whose storage is larger than the tensor (torch.save would write the
    whole storage) and keeps the clones until the rank's file is closed: views of one block would sit in host memory
    twice (#46: 1.0x of a rank's state at R = 2 instead of 0.5x).
    """
    flat = memory.reshape(-1).view(torch.uint8)
    return torch.from_numpy(flat.numpy()).view(dtype).view(shape)  # numpy's view holds ``memory``'s storage


class _Shapes(_Chunks):
    """The first walk: each chunk's shape and dtype (``chunks``), and whether its sources live on CUDA (``pinned``)."""

    def __init__(self) -> None:
        self.chunks: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self.pinned = False

    def _copy(self, key: tuple, sources: torch.Tensor | list[torch.Tensor], shape: Any = None) -> torch.Tensor:
        sources = sources if isinstance(sources, list) else [sources]
        shape = sources[0].shape if shape is None else torch.Size(shape)
        self.chunks[key] = (shape, sources[0].dtype)
        self.pinned |= sources[0].device.type == "cuda"
        return torch.empty(shape, dtype=sources[0].dtype, device="meta")


class _Copies(_Chunks):
    """The second walk: the copies into the block's views, how many bytes, and the CUDA event that ends them."""

    def __init__(self, stager: Stager, buffers: dict[tuple, torch.Tensor]) -> None:
        self._stager = stager
        self._buffers = buffers
        self.nbytes = 0
        self._device: torch.device | None = None  # the CUDA device copied from, once a copy was issued there

    def _copy(self, key: tuple, sources: torch.Tensor | list[torch.Tensor], shape: Any = None) -> torch.Tensor:
        """Copy ``sources`` (views of the live state, one after the other along dim 0) into the chunk's buffer."""
        sources = sources if isinstance(sources, list) else [sources]
        buffer = self._buffers[key]
        self.nbytes += buffer.nbytes
        row = 0
        for source in sources:
            rows = source.shape[0] if source.ndim else 1
            self._copy_rows(buffer[row : row + rows] if source.ndim else buffer, source)
            row += rows
        return buffer

    def _copy_rows(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if source.device.type != "cuda":
            target.copy_(source)
            return
        stream = self._stager._copy_stream()
        self._device = source.device
        stream.wait_stream(torch.cuda.current_stream(source.device))  # after what training last wrote
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        source.record_stream(stream)  # its memory is not reused until the copy has run

    def finish(self) -> Callable[[], None]:
        """End the copies; returns what the writer calls before reading the buffers (in DCP's writing thread)."""
        if self._device is None:
            return lambda: None
        event = torch.cuda.Event()
        event.record(self._stager._copy_stream())
        self._stager.wait_before_next_step(event)
        device = self._device

        def ready() -> None:
            # the writing thread's current device is cuda:0 until set: every rank would open a context on GPU 0
            torch.cuda.set_device(device)
            event.synchronize()

        return ready


def copy_to_cpu(value: Any) -> Any:
    """A copy of a nested state dict with every tensor (a DTensor's local shard) copied to CPU memory, once.

    A DTensor stays a DTensor of the same mesh and placements with a CPU local shard (``DTensor.from_local`` would
    move that shard back to the mesh's device).
    """
    return map_tree(value, _leaf_to_cpu, (torch.Tensor, StoredBoxes))


def _leaf_to_cpu(leaf: torch.Tensor | StoredBoxes, path: tuple) -> torch.Tensor | StoredBoxes:
    return leaf.copy_to_cpu() if isinstance(leaf, StoredBoxes) else leaf.detach().to("cpu", copy=True)


def _tensor_bytes(tree: Any) -> int:
    from torch.distributed.tensor import DTensor

    def local(leaf: torch.Tensor | StoredBoxes) -> torch.Tensor:
        return leaf.local if isinstance(leaf, StoredBoxes) else leaf.to_local() if isinstance(leaf, DTensor) else leaf

    return sum(local(leaf).nbytes for _, leaf in tree_leaves(tree, (torch.Tensor, StoredBoxes)))


def _register(block: torch.Tensor) -> None:
    """Page-lock ``block`` (pageable memory of its exact size) for asynchronous copies from the GPU."""
    code = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.nbytes, 1))  # 1: portable
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of the {block.nbytes}-byte staging block failed with CUDA error {code}")
