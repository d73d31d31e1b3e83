"""What a dry run watches while the user's script runs: Fabric's devices, the strategy's setup, loads, steps, saves.

Every hook is a class-level patch that lives only while :meth:`DryRunSession.hooks` is active; the script is not
changed and need not know.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from fabric_hsdp.dryrun.measure import Meter, host_resident
from fabric_hsdp.dryrun.save import SaveRecord, full_save_record, save_this_rank
from fabric_hsdp.dryrun.world import DryRunWorld


class StepLimitReached(BaseException):  # noqa: N818 - not an error: the run is over (a BaseException, so a
    """Raised after the last optimizer step of a dry run to leave the user's loop (``except Exception`` in the
    script does not catch it)."""


_logger = logging.getLogger(__name__)


@dataclass
class DryRunSession:
    """The state of one dry run of ``world``: the strategy and model the script set up, phases, steps and saves."""

    world: DryRunWorld
    max_steps: int
    scratch: Path
    notes: list[str] = field(default_factory=list)
    strategy: Any = None
    fabric: Any = None
    model: Any = None
    model_shape: Any = None
    optimizers: list[Any] = field(default_factory=list)
    tokens_shape: tuple[int, ...] | None = None  # the first training forward's (grad enabled, module in train mode)
    no_grad_tokens_shape: tuple[int, ...] | None = None  # the first other forward's (validation), a fallback
    steps: int = 0
    saves: list[SaveRecord] = field(default_factory=list)
    meter: Meter | None = None
    checkpoint_read: int = 0
    no_compute: bool = False  # the steps run on tensors without data, their allocations counted (dryrun/counted.py)
    _load_depth: int = 0
    _saving: bool = False
    _counting: ExitStack | None = None
    _counter: Any = None
    _resident_at_count: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """Patch Fabric and ``HybridFSDPStrategy`` for the dry run; undone on exit."""
        from lightning.fabric import Fabric

        from fabric_hsdp.strategy import HybridFSDPStrategy

        self.meter = Meter(self.device)
        with ExitStack() as stack:
            patch = functools.partial(self._patch, stack)
            patch(Fabric, "__init__", self._fabric_init)
            patch(HybridFSDPStrategy, "setup_environment", self._setup_environment)
            patch(HybridFSDPStrategy, "setup_module", self._setup_module)
            patch(HybridFSDPStrategy, "setup_optimizer", self._setup_optimizer)
            patch(HybridFSDPStrategy, "load_raw", self._load)
            patch(HybridFSDPStrategy, "load_checkpoint", self._load)
            patch(HybridFSDPStrategy, "save_checkpoint", self._save)
            patch(HybridFSDPStrategy, "save_full_checkpoint", self._save_full)
            stack.enter_context(self._count_checkpoint_reads())
            stack.enter_context(_no_io_watchdog())
            if self.device.type == "cuda":
                stack.enter_context(_every_rank_on_cuda_0(self.world.devices_per_node))
            from torch.optim.optimizer import register_optimizer_step_post_hook

            handle = register_optimizer_step_post_hook(self._after_step)
            stack.callback(handle.remove)
            yield

    @contextmanager
    def _count_checkpoint_reads(self) -> Iterator[None]:
        """Count the tensor bytes read from checkpoint files: every reader ends in ``fileio.readinto``."""
        from fabric_hsdp.checkpoint.core import fileio

        original = fileio.readinto

        def readinto(fd: int, target: torch.Tensor, offset: int, **kwargs: Any) -> Any:
            self.checkpoint_read += target.nbytes
            return original(fd, target, offset, **kwargs)

        with mock.patch.object(fileio, "readinto", readinto):
            yield

    @staticmethod
    def _patch(stack: ExitStack, owner: type, name: str, hook: Any) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def patched(this: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(original, this, *args, **kwargs)

        stack.enter_context(mock.patch.object(owner, name, patched))

    # --- Fabric(...): devices of this machine -------------------------------------------------------------------
    def _fabric_init(self, original: Any, fabric: Any, *args: Any, **kwargs: Any) -> None:
        accelerator = kwargs.get("accelerator", "auto")
        if self.device.type == "cpu" and str(accelerator) in ("cuda", "gpu", "auto", "mps"):
            if str(accelerator) != "auto":
                self.notes.append(
                    f"the script asks for accelerator={accelerator!r}; this machine has no GPU, so every rank runs"
                    " on CPU (CPU memory stands in for device memory; CUDA-only paths are not exercised)"
                )
            kwargs["accelerator"] = "cpu"
        elif self.device.type == "cuda" and str(accelerator) in ("auto", "gpu"):
            kwargs["accelerator"] = "cuda"
        if kwargs.get("devices", "auto") in ("auto", -1, "-1"):
            kwargs["devices"] = self.world.devices_per_node  # what "auto" finds on a node of the real cluster
        original(fabric, *args, **kwargs)
        self.fabric = fabric

    # --- fabric.launch(): the strategy ----------------------------------------------------------------------------
    def _setup_environment(self, original: Any, strategy: Any) -> None:
        self.strategy = strategy
        self.meter.rebase()  # the script's own imports are not the training's memory
        original(strategy)
        atexit.unregister(strategy._end_of_process)  # the dry run tears down itself, in this process

    def _setup_module(self, original: Any, strategy: Any, module: Any) -> Any:
        from fabric_hsdp.planning.model import model_shape_of_module

        try:
            self.model_shape = model_shape_of_module(module, tensor_parallel_plan=_tensor_parallel_plan(strategy))
        except Exception as error:  # noqa: BLE001 - the plan comparison is a bonus, never a reason to fail
            self.notes.append(f"no planner comparison: {error}")
        result = original(strategy, module)
        self.model = result
        # before FSDP's own pre-forward hook: --max_steps 0 stops before its lazy init and first all-gather
        result.register_forward_pre_hook(self._record_tokens, with_kwargs=True, prepend=True)
        self.meter.end("setup")
        return result

    def _setup_optimizer(self, original: Any, strategy: Any, optimizer: Any) -> Any:
        self.optimizers.append(optimizer)
        return original(strategy, optimizer)

    def _record_tokens(self, module: Any, args: tuple, kwargs: dict) -> None:
        # the plan is for a training step: a validation forward first (no grad, often another batch) is a fallback
        training = torch.is_grad_enabled() and module.training
        if (self.tokens_shape if training else self.no_grad_tokens_shape) is None:
            first = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
            if first is not None and first.dim() >= 2:
                if training:
                    self.tokens_shape = tuple(first.shape[:2])
                else:
                    self.no_grad_tokens_shape = tuple(first.shape[:2])
        if self.max_steps == 0:  # set-up and loads only: stop before the first forward computes anything
            self.meter.end("setup")  # what ran since the last phase (e.g. the optimizer's set-up) is set-up
            raise StepLimitReached
        if training and self.no_compute and self._counting is None:
            self._start_counting()

    # --- --no_compute: the steps on tensors without data, every allocation counted ----------------------------------
    def _start_counting(self) -> None:
        from fabric_hsdp.dryrun.counted import counted_step

        if self.device.type == "cuda":  # the device's allocated bytes, as the Meter measures every other phase
            self._resident_at_count = torch.cuda.memory_allocated(self.device) - self.meter.baseline_device
        else:
            self._resident_at_count = max(0, host_resident() - self.meter.baseline_host)
        self._counting = ExitStack()
        self._counter = self._counting.enter_context(counted_step())

    def stop_counting(self) -> None:
        """Leave the counted steps (at the step limit, or when the script ends first) and record them as ``step``."""
        if self._counting is None or self._counter is None:
            return
        self._counting.close()
        phase = self.meter.end("step")
        phase.counted_allocations = self._counter.peak
        phase.counted_peak = self._resident_at_count + self._counter.peak
        self._counter = None

    # --- loads and steps ----------------------------------------------------------------------------------------
    def _load(self, original: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        self._load_depth += 1
        if self._load_depth == 1:
            self.meter.end("setup" if self.steps == 0 else "step")
        try:
            return original(strategy, *args, **kwargs)
        finally:
            self._load_depth -= 1
            if self._load_depth == 0:
                self.meter.end("load")

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._saving:  # DCP initialises an optimizer's empty state with a step of zero gradients
            return
        self.steps += 1
        if self.steps >= self.max_steps:
            if self._counter is not None:
                self.stop_counting()
            else:
                self.meter.end("step")
            raise StepLimitReached

    # --- saves: this rank's files into scratch, no commit ----------------------------------------------------------
    def _save(self, original: Any, strategy: Any, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if self.no_compute and self._counting is not None:
            self.notes.append(f"save '{path}' skipped: under --no_compute the trained tensors hold no data to write")
            return
        self.meter.end("step")
        strategy.wait_for_checkpoint()
        self._saving = True
        try:
            filter = kwargs.get("filter")  # Fabric passes save_checkpoint(path=, state=, filter=)
            self.saves.append(save_this_rank(strategy, Path(path), state, self.scratch, self.world.rank, filter))
        finally:
            self._saving = False
        self.meter.end("save")

    def _save_full(self, original: Any, strategy: Any, path: Any, state: dict[str, Any]) -> None:
        self.saves.append(full_save_record(Path(path), state, self.world.rank))

    def save_after_stop(self) -> None:
        """The script's own save came after the step limit: save what it set up, as a save at that point would."""
        if self.strategy is None or self.model is None or self.saves:
            return
        _logger.warning(
            "dryrun: saving this rank's share of the model and optimizer into %s after the step limit, as the"
            " script's save would (pass --no-save_after_stop to skip it)",
            self.scratch,
        )
        state: dict[str, Any] = {"model": self.model}
        state.update({f"optimizer{index or ''}": optimizer for index, optimizer in enumerate(self.optimizers)})
        self.meter.start()
        self._saving = True
        try:
            record = save_this_rank(self.strategy, Path("checkpoint"), state, self.scratch, self.world.rank)
        finally:
            self._saving = False
        record.by_dry_run = True
        self.saves.append(record)
        self.meter.end("save")


def _tensor_parallel_plan(strategy: Any) -> Any:
    levers = getattr(strategy, "_levers", None)  # the strategy's setup options (fabric_hsdp/setup/pipeline.py)
    return getattr(levers, "tensor_parallel_plan", getattr(strategy, "_tensor_parallel_plan", "auto"))


@contextmanager
def _no_io_watchdog() -> Iterator[None]:
    """The I/O watchdog posts progress to the job's store for its neighbour rank: in a dry run there is neither."""
    from fabric_hsdp.checkpoint.core import watchdog

    with mock.patch.object(watchdog, "_default_store", lambda: None):
        yield


@contextmanager
def _every_rank_on_cuda_0(devices_per_node: int) -> Iterator[None]:
    """Let ``Fabric(accelerator="cuda", devices=N)`` accept N devices on a one-GPU machine, all of them ``cuda:0``."""
    from lightning.fabric.accelerators.cuda import CUDAAccelerator

    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(
                CUDAAccelerator,
                "parse_devices",
                staticmethod(lambda devices: list(range(int(devices) if str(devices).isdigit() else devices_per_node))),
            )
        )
        stack.enter_context(
            mock.patch.object(
                CUDAAccelerator,
                "get_parallel_devices",
                staticmethod(lambda devices: [torch.device("cuda", 0)] * len(devices)),
            )
        )
        stack.enter_context(
            mock.patch.object(CUDAAccelerator, "auto_device_count", staticmethod(lambda: devices_per_node))
        )
        yield
