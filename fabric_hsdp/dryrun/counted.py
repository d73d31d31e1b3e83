"""A training step without compute: tensors with shapes and no data, every allocation the program makes counted.

``counted_step()`` enters torch's ``FakeTensorMode`` (tensors made within it carry a shape, a dtype and a device but
no data: an op costs microseconds whatever its size) and, above it, :class:`AllocationCounter`, which sees every
ATen call and counts the bytes of each storage an op creates, until the storage is freed (a weak reference's
finaliser) or resized (``UntypedStorage.resize_``, how FSDP2 frees and re-allocates its all-gather buffers). The
real tensors that exist when it starts (the sharded parameters the set-up made) are not counted: the dry run
measures them as resident memory. Ops that write in place or return a view (their schema's outputs alias an input)
make no new storage, so the optimizer's in-place update of a real parameter (through its data-less image, under
``allow_non_fake_inputs``) is not an allocation.

This is the memory torch asks its allocator for, as CUDA's ``memory_allocated`` would count it on a GPU: neither
the caching allocator's rounding and reserve nor fragmentation (``max_memory_reserved`` is higher), nor a CPU
allocator's overhead. A value read back that fake tensors do not know (``loss.item()``) is 0: the tensors hold no
numbers.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from fabric_hsdp.versions import (
    active_fake_mode,
    c10d_functional_ops,
    data_dependent_output_error,
    dtensor_sharding_propagator,
    fake_tensor_mode,
    item_op,
    storages_of,
    torch_dispatch_mode_class,
)

_TorchDispatchMode = torch_dispatch_mode_class()
_DataDependentOutput = data_dependent_output_error()


class AllocationCounter(_TorchDispatchMode):
    """Counts the bytes of the storages that ops create within it: ``live`` now, ``peak`` since it began.

    A storage is counted from the first op that returns it as a new tensor (its schema says the output aliases no
    input), until it is freed;
    ``resize_`` changes its count (one that was not counted is counted at its new size from its first growth).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.storages = 0
        self._counted: dict[int, list[int]] = {}  # id(storage) -> [bytes counted]
        self._fake_mode = None
        self._original_resize = torch.UntypedStorage.resize_
        self._original_propagate: Any = None
        self._propagating = 0

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _count(self, storage: Any) -> None:
        key = id(storage)
        if key in self._counted:
            return
        entry = [storage.nbytes()]
        self._counted[key] = entry
        self.storages += 1
        self._add(entry[0])
        weakref.finalize(storage, self._freed, key, entry)

    def _freed(self, key: int, entry: list[int]) -> None:
        self.live -= entry[0]
        if self._counted.get(key) is entry:
            del self._counted[key]

    def _resize(self, storage: Any, size: int) -> Any:
        before = storage.nbytes()
        result = self._original_resize(storage, size)
        entry = self._counted.get(id(storage))
        if entry is None and storage.nbytes() > before:
            self._count(storage)  # at its new size
        elif entry is not None:
            self._add(storage.nbytes() - entry[0])
            entry[0] = storage.nbytes()
        return result

    def __enter__(self) -> AllocationCounter:
        self._fake_mode = active_fake_mode()
        counter = self

        def resize_(storage: Any, size: int) -> Any:  # not an ATen call a dispatch mode sees
            return counter._resize(storage, size)

        torch.UntypedStorage.resize_ = resize_
        propagator = dtensor_sharding_propagator()
        self._original_propagate = original = propagator._propagate_tensor_meta_non_cached

        def propagate(propagator_self: Any, *args: Any, **kwargs: Any) -> Any:
            # DTensor runs the op on global shapes under our fake mode to learn the output's: no memory of this rank
            counter._propagating += 1
            try:
                return original(propagator_self, *args, **kwargs)
            finally:
                counter._propagating -= 1

        propagator._propagate_tensor_meta_non_cached = propagate
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize
        dtensor_sharding_propagator()._propagate_tensor_meta_non_cached = self._original_propagate
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # let DTensor run its local ops, which this mode then sees
        if func is c10d_functional_ops().wait_tensor.default and active_fake_mode() is not None:
            return args[0]  # eagerly it returns its input; its fake kernel makes a new tensor
        try:
            result = func(*args, **(kwargs or {}))
        except _DataDependentOutput:
            if func is not item_op():
                raise
            return _zero_like(args[0])  # .item() of a tensor without data (a logged loss): no value to give
        if self._propagating or active_fake_mode() is not self._fake_mode:
            return result  # DTensor's sharding propagation: the global shapes, not this rank's memory
        returns = func._schema.returns
        outputs = result if len(returns) > 1 else (result,)
        for output, declared in zip(outputs, returns, strict=False):
            if declared.alias_info is not None:
                continue  # in place or a view: an input's storage (a real tensor's is its data-less image)
            for tensor in _tensors(output):
                for storage in storages_of(tensor):
                    self._count(storage)
        return result


def _zero_like(tensor: torch.Tensor) -> bool | int | float:
    if tensor.dtype == torch.bool:
        return False
    return 0.0 if tensor.dtype.is_floating_point or tensor.dtype.is_complex else 0


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


@contextmanager
def counted_step() -> Iterator[AllocationCounter]:
    """``FakeTensorMode`` (real tensors allowed in, as data-less images) with an :class:`AllocationCounter` above it."""
    with ExitStack() as stack:
        stack.enter_context(fake_tensor_mode(allow_non_fake_inputs=True))
        yield stack.enter_context(AllocationCounter())
