"""``Box``: the one shape a box of a tensor has in the package (offsets and sizes per dim, as DCP's chunks).

Where a caller needs another form it converts at the boundary: ``box.slices()`` to index a tensor (and for a
source's ``read_slice``), :meth:`Box.of_index` from such an index, ``box.stops`` for the ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A box of a tensor: in each dim ``d``, ``sizes[d]`` elements from ``offsets[d]`` on (DCP's chunk shape)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of_index(cls, index: tuple[slice, ...] | slice, shape: Sequence[int], name: str) -> Box:
        """The box a ``read_slice`` index selects: a tuple of unit-step slices, missing trailing dims whole."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > len(shape):
            raise ValueError(f"index {index} has {len(index)} entries but tensor '{name}' has shape {list(shape)}")
        offsets, sizes = [], []
        for dim, size in enumerate(shape):
            item = index[dim] if dim < len(index) else slice(None)
            if not isinstance(item, slice):
                raise TypeError(f"read_slice('{name}', ...) takes a tuple of slices, got {item!r} at dim {dim}")
            start, stop, step = item.indices(size)
            if step != 1:
                raise ValueError(f"read_slice('{name}', ...) supports unit steps only, got step {step} at dim {dim}")
            offsets.append(start)
            sizes.append(max(0, stop - start))
        return cls(tuple(offsets), tuple(sizes))

    @property
    def stops(self) -> tuple[int, ...]:
        """Where the box ends in each dim (exclusive)."""
        return tuple(offset + size for offset, size in zip(self.offsets, self.sizes))

    def slices(self) -> tuple[slice, ...]:
        """The index that selects the box from the whole tensor: ``tensor[box.slices()]``."""
        return tuple(slice(offset, stop) for offset, stop in zip(self.offsets, self.stops))
