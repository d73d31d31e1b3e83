"""DCP's planners with two changes: non-tensor entries unpickled safely, and :class:`StoredBoxes` written and read.

Torch's load planner always unpickles non-tensor entries with ``weights_only=False``; :class:`SafeLoadPlanner` uses
``torch.load(weights_only=...)``. DCP's default planners look objects up by type, so both call
:func:`~fabric_hsdp.checkpoint.core.boxes.lookup` for the boxes of
:class:`~fabric_hsdp.checkpoint.core.boxes.StoredBoxes`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from fabric_hsdp.checkpoint.core.boxes import lookup, stored_boxes_in
from fabric_hsdp.errors import unsafe_pickle_error
from fabric_hsdp.versions import flatten_state_dict, set_element


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also writes the boxes of
    :class:`~fabric_hsdp.checkpoint.core.boxes.StoredBoxes`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return lookup(self.state_dict, index)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, unpickling non-tensor entries with ``torch.load(weights_only=...)``.

    Torch's planner always unpickles them with ``weights_only=False``; optimizer ``param_groups`` (numbers, bools,
    tuples) load fine with the safe loader. Every value read is also kept in ``loaded`` by its DCP key (``dcp.load``
    hands the planner a copy of the top level of the state dict). It also fills the boxes of
    :class:`~fabric_hsdp.checkpoint.core.boxes.StoredBoxes`.
    """

    def __init__(self, *, weights_only: bool, allow_partial_load: bool = False, flatten_state_dict: bool = True):
        super().__init__(flatten_state_dict=flatten_state_dict, allow_partial_load=allow_partial_load)
        self._weights_only = weights_only
        self.loaded: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up initialises meta tensors in place and replaces every leaf of a type it does not know with None:
        # put the StoredBoxes back, then flatten again.
        kept = stored_boxes_in(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if kept:
            for container, key, value in kept:
                container[key] = value
            if self.flatten_state_dict:
                self.state_dict, self.mappings = flatten_state_dict(self.original_state_dict)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=self._weights_only)
        except pickle.UnpicklingError as error:
            raise unsafe_pickle_error(f"checkpoint entry {fqn!r}", str(error).splitlines()[0]) from None
        self.loaded[fqn] = loaded
        set_element(self.original_state_dict, self.mappings.get(fqn, (fqn,)), loaded)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return lookup(self.state_dict, index)
