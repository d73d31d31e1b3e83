"""The one switch of a dry run: torch's fake process group, and honest answers for the exchanges of Python objects.

Under the fake backend every collective returns at once and carries no data: tensor collectives leave this rank's
values in place (an all-reduce "returns" this rank's number), but object collectives first exchange a pickled
length, so a receiving rank reads garbage and tries to allocate terabytes. While :func:`fake_process_group` is
active, the object collectives of ``torch.distributed`` (which this package, Lightning and DCP call as
``dist.<name>``) answer what every rank would compute in a symmetric program: this rank's own object. DCP runs as a
world of one (each rank plans its own chunks; DTensor offsets stay those of the real rank), and its check that a
save plan covers every tensor whole is skipped, since the other ranks' chunks are not there.

An all-to-all that decides the sizes of the next one (expert parallelism's exchange of per-expert row counts, which
sets how many token rows each rank receives) would hand back uninitialised memory. An evenly split functional
``all_to_all_single`` answers as if every peer sent this rank what this rank sends that peer: the input itself. Then
a rank receives as many rows for its experts as it sends out (``tokens x top-k``, the average of a balanced router),
whatever the untrained router picked; the row exchange that follows, with uneven splits, is torch's fake one.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch.distributed as dist

from fabric_hsdp.versions import (
    dcp_dist_wrapper,
    fake_store_class,
    functional_collectives_module,
    passing_plan_validator,
)

_ACTIVE = False


def active() -> bool:
    """Whether this process runs a dry run (fake process group, honest object collectives)."""
    return _ACTIVE


def _copy(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))  # a real exchange hands back a copy, never the sender's object


def _broadcast_object_list(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
    """Every rank would receive the source rank's objects; in a symmetric program that is what this rank holds."""


def _all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    for index in range(len(object_list)):
        object_list[index] = _copy(obj)


def _gather_object(obj: Any, object_gather_list: list[Any] | None = None, *args: Any, **kwargs: Any) -> None:
    if object_gather_list is not None:
        _all_gather_object(object_gather_list, obj)


def _all_to_all_single_as_sent(original: Any) -> Any:
    def all_to_all_single(
        tensor: Any, output_split_sizes: Any, input_split_sizes: Any, group: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if output_split_sizes is None and input_split_sizes is None:
            return tensor.clone()  # every peer sends this rank what this rank sends it (see the module docstring)
        return original(tensor, output_split_sizes, input_split_sizes, group, *args, **kwargs)

    return all_to_all_single


def _scatter_object_list(
    scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None, *args: Any, **kwargs: Any
) -> None:
    if not scatter_object_input_list:
        raise RuntimeError(
            "dry run: scatter_object_list from another rank has no honest answer in one process (the source's"
            " objects do not exist here)"
        )
    group = kwargs.get("group")
    scatter_object_output_list[0] = _copy(scatter_object_input_list[dist.get_rank(group)])


@contextmanager
def fake_process_group() -> Iterator[None]:
    """Within this context ``init_process_group`` builds torch's fake process group (whatever backend is asked for),
    ``new_group`` gives fake groups too (a gloo side group would wait for peers), and object collectives answer
    with this rank's own objects."""
    global _ACTIVE
    import torch.distributed.checkpoint.default_planner as default_planner

    fake_store = fake_store_class()  # registers backend "fake"
    dist_wrapper = dcp_dist_wrapper()  # DCP's own class, patched in place
    original_init = dist.init_process_group
    original_new_group = dist.new_group
    original_wrapper_init = dist_wrapper.__init__

    def init_process_group(backend: Any = None, init_method: Any = None, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("store", None)
        original_init("fake", *args, store=fake_store(), **kwargs)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        return original_new_group(*args, **kwargs)

    def one_rank_wrapper(self: Any, group: Any, use_dist: bool, coordinator_rank: int) -> None:
        original_wrapper_init(self, group, False, 0)

    with ExitStack() as stack:
        for name, replacement in (
            ("init_process_group", init_process_group),
            ("new_group", new_group),
            ("broadcast_object_list", _broadcast_object_list),
            ("all_gather_object", _all_gather_object),
            ("gather_object", _gather_object),
            ("scatter_object_list", _scatter_object_list),
        ):
            stack.enter_context(mock.patch.object(dist, name, replacement))
        functional_collectives = functional_collectives_module()
        even_all_to_all = _all_to_all_single_as_sent(functional_collectives.all_to_all_single)
        stack.enter_context(mock.patch.object(functional_collectives, "all_to_all_single", even_all_to_all))
        stack.enter_context(mock.patch.object(dist_wrapper, "__init__", one_rank_wrapper))
        stack.enter_context(mock.patch.object(default_planner, "_validate_global_plan", passing_plan_validator()))
        _ACTIVE = True
        try:
            yield
        finally:
            _ACTIVE = False
            if dist.is_initialized():
                dist.destroy_process_group()
