"""``ProcessGroupStrategy``: what a Fabric strategy with one process per device over a default process group answers
the same way whatever it parallelizes (its devices, nodes and launcher, the collectives Fabric calls), so that
:mod:`fabric_hsdp.strategy` holds only what :class:`~fabric_hsdp.strategy.HybridFSDPStrategy` does."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.distributed import ReduceOp, _sync_ddp_if_available
from torch import Tensor
from typing_extensions import override

from fabric_hsdp.processes import distributed


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device of ``parallel_devices``, on ``num_nodes`` nodes; Lightning's subprocess launcher where
    the cluster environment does not start the processes itself. It writes checkpoints itself (no ``CheckpointIO``).
    """

    def __init__(
        self,
        accelerator: Accelerator | None,
        parallel_devices: list[torch.device] | None,
        cluster_environment: ClusterEnvironment | None,
        precision: Precision | None,
        process_group_backend: str | None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._process_group_backend = process_group_backend
        self._num_nodes = 1

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        raise NotImplementedError(f"`{type(self).__name__}` writes checkpoints itself; it has no CheckpointIO plugin.")

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise NotImplementedError(f"`{type(self).__name__}` does not support setting a CheckpointIO plugin.")

    @property
    @override
    def root_device(self) -> torch.device:
        if self.parallel_devices is None:
            raise RuntimeError("the strategy has no devices yet: pass it to L.Fabric(...), which assigns them")
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def precision_name(self) -> str:
        """Fabric's precision string for this run (``"32-true"`` when no plugin has been set)."""
        return getattr(self.precision, "precision", "32-true")

    @property
    def environment(self) -> ClusterEnvironment:
        """The cluster environment, which Fabric sets before launching."""
        if self.cluster_environment is None:
            raise RuntimeError("the strategy has no cluster environment yet: pass it to L.Fabric(...), which sets one")
        return self.cluster_environment

    @override
    def _configure_launcher(self) -> None:
        if not self.environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.environment, self.num_processes, self.num_nodes)

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        distributed.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return distributed.broadcast_object(obj, src)

    @override
    def teardown(self) -> None:
        """The cluster environment, precision plugin and accelerator. Not ``ParallelStrategy.teardown()``: it would
        touch ``checkpoint_io``, which this strategy does not have."""
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
