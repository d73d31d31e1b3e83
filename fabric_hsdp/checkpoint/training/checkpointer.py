"""What the strategy's ``save_checkpoint``/``load_checkpoint``/``load_raw`` do, with the settings it was given.

One :class:`Checkpointer` per strategy, as torchtitan's ``CheckpointManager``: it holds the background saves (and
so the one save in flight) and the I/O watchdog, knows this rank's place (local rank, ranks per node, the mesh),
agrees on the path across ranks, picks the way down for each call (a full file, a sharded save in the foreground or
the background, a sharded load, a raw load plus a full checkpoint's extras), and decides the unpickling rule
(``weights_only``) once per call. The strategy's hooks only pass their arguments on.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.fabric.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from fabric_hsdp.agreement import fail_together
from fabric_hsdp.checkpoint.core.commit import check_writable
from fabric_hsdp.checkpoint.core.keys import KeyMapSpec
from fabric_hsdp.checkpoint.core.watchdog import IOWatchdog
from fabric_hsdp.checkpoint.training.background import BackgroundSaves
from fabric_hsdp.checkpoint.training.full import restore_extras, save_full
from fabric_hsdp.checkpoint.training.raw_load import LoadResult, load_into_model, validate_load_mode
from fabric_hsdp.checkpoint.training.sharded import find_sharded, load_sharded, save_sharded
from fabric_hsdp.checkpoint.training.state import CheckpointState, Filter
from fabric_hsdp.models.fused_rows import held_row_order
from fabric_hsdp.models.lora import user_module

STATE_DICT_TYPES = ("sharded", "full")


def validate_state_dict_type(state_dict_type: str) -> str:
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={state_dict_type!r} must be 'sharded' (DCP directory) or 'full' (one file).")
    return state_dict_type


class Checkpointer:
    """A strategy's checkpoints (the arguments are the strategy's, documented there).

    Call :meth:`set_up` once the default process group exists, and :meth:`close` or :meth:`finish_at_exit` at the
    end. Every method that saves or loads is a collective: call it on every rank. Each runs in tensor parallelism's
    ``held_row_order()``: the checkpoint code maps the regrouped rows of fused parameters itself.
    """

    def __init__(
        self,
        *,
        state_dict_type: str,
        async_save: bool,
        load_mode: str,
        load_turn_size: int,
        split_replica_reads: bool,
        io_timeout: float | timedelta | None,
    ) -> None:
        self.state_dict_type = validate_state_dict_type(state_dict_type)
        self.load_mode = validate_load_mode(load_mode)
        self.load_turn_size = load_turn_size
        self.split_replica_reads = split_replica_reads
        self._watchdog = IOWatchdog(io_timeout)
        self._background = BackgroundSaves(enabled=async_save, watchdog=self._watchdog)
        self._broadcast: Callable[[Any], Any] = lambda obj: obj
        self._place: dict[str, int] = {"local_rank": 0, "ranks_per_node": 1}
        self._mesh: Callable[[], Any] = lambda: None

    def set_up(
        self,
        timeout: Any,
        *,
        broadcast: Callable[[Any], Any],
        local_rank: int,
        ranks_per_node: int,
        mesh: Callable[[], Any],
    ) -> None:
        """Once the processes exist: the collectives' ``timeout``, rank 0's ``broadcast`` of an object, this rank's
        place, and ``mesh()`` giving the strategy's mesh once built (``None`` before; ``shard_size="auto"`` builds it
        at ``setup_module``)."""
        self._background.set_up(timeout)
        self._broadcast, self._mesh = broadcast, mesh
        self._place = {"local_rank": local_rank, "ranks_per_node": ranks_per_node}

    def agreed_path(self, path: Any) -> Path:
        """Rank 0's ``path``, made absolute: every rank writes and reads the same files."""
        return Path(self._broadcast(Path(path).absolute()))

    def save(self, path: Path, state: dict[str, Any], *, full: bool = False, filter: Filter | None = None) -> None:
        """Write ``state`` at rank 0's ``path``: one full file (``full``, ``state_dict_type="full"`` or a
        ``.safetensors`` path), else a sharded DCP directory, in the background with ``async_save``; ``filter``:
        Fabric's ``save(filter=)``."""
        path = self.agreed_path(path)
        self.wait()
        with held_row_order(), self._watchdog.watch(f"saving checkpoint '{path}'"):
            checkpoint = CheckpointState(state)
            if full or self.state_dict_type == "full" or path.suffix == ".safetensors":
                save_full(path, checkpoint, filter)  # rank 0 writes; the others wait in its gathers
                return
            background = self._background if self._background.enabled else None
            save_sharded(path, checkpoint, self._broadcast, background, filter)

    def check_writable(self, directory: Any) -> None:
        """Raise ``SaveError`` on every rank now if any rank cannot create files in rank 0's ``directory``."""
        directory = self.agreed_path(directory)
        with fail_together(f"checking that checkpoints can be written in '{directory}'"):
            check_writable(directory)

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its failure on every rank."""
        self._background.wait()

    def load(self, path: Path, state: Any, *, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """Restore ``state`` (a module, or a dict of a model, optimizers and plain values) in place from rank 0's
        ``path``, a sharded checkpoint or any consolidated format; return what is left."""
        if not state:
            raise ValueError(
                "HybridFSDPStrategy.load_checkpoint needs the objects to restore, e.g."
                " fabric.load(path, {'model': model, 'optimizer': optimizer}) or fabric.load_raw(path, model)."
            )
        path = self.agreed_path(path)
        with held_row_order():
            return self._load(path, state, strict=strict, safe=weights_only is not False)  # None: the safe loader

    def _load(self, path: Path, state: nn.Module | Optimizer | dict[str, Any], *, strict: bool, safe: bool) -> Any:
        self.wait()
        if isinstance(state, nn.Module):
            self.load_raw(path, state, strict=strict, weights_only=safe)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "Load an optimizer together with its model: fabric.load(path, {'model': ..., ...})"
            )
        checkpoint = CheckpointState(state)
        sharded, metadata = find_sharded(path, checkpoint.model_key, weights_only=safe)
        if sharded:
            split_mesh = self._mesh() if self.split_replica_reads else None
            with self._watchdog.watch(f"loading checkpoint '{path}'"):
                return load_sharded(path, checkpoint, state, strict, safe, split_mesh=split_mesh, metadata=metadata)
        self.load_raw(path, checkpoint.model, strict=strict, weights_only=safe)
        return restore_extras(path, checkpoint, state, strict=strict, weights_only=safe)

    def load_raw(
        self,
        path: Path,
        module: nn.Module,
        *,
        strict: bool,
        weights_only: bool,
        key_map: KeyMapSpec = None,
        load_mode: str | None = None,
    ) -> LoadResult:
        """Fill ``module``'s shards from a consolidated checkpoint (see ``HybridFSDPStrategy.load_raw``)."""
        self.wait()
        with held_row_order(), self._watchdog.watch(f"loading '{path}'"):
            result = load_into_model(
                path,
                user_module(module),
                strict=strict,
                key_map=key_map,
                load_mode=validate_load_mode(load_mode or self.load_mode),
                turn_size=self.load_turn_size,
                weights_only=weights_only,
                **self._place,
                split_mesh=self._mesh() if self.split_replica_reads else None,
            )
        if not strict and (result.missing or result.unexpected):
            rank_zero_warn(
                f"Loaded {len(result.loaded)} tensors from '{path}'; {len(result.missing)} missing in the checkpoint"
                f" (e.g. {result.missing[:3]}), {len(result.unexpected)} unused (e.g. {result.unexpected[:3]})."
            )
        return result

    def close(self) -> None:
        """Finish the save in flight (raising its failure on every rank), then drop the background saves' group."""
        try:
            self.wait()
        finally:
            self._background.close()

    def finish_at_exit(self) -> bool:
        """At interpreter exit: let the save in flight finish, without collectives; ``True`` if it failed."""
        return self._background.finish_at_exit()
