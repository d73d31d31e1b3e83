"""``HybridFSDPStrategy``: Lightning Fabric's hooks, each a few lines over the modules that do the work."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import Strategy
from lightning.fabric.utilities import rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from lightning.fabric.wrappers import _unwrap_objects
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from fabric_hsdp.checkpoint.core.keys import KeyMapSpec
from fabric_hsdp.checkpoint.training.checkpointer import Checkpointer
from fabric_hsdp.checkpoint.training.raw_load import LoadMode, LoadResult
from fabric_hsdp.processes import distributed, failures
from fabric_hsdp.processes.launchers import check_launch, detect_launcher, environment_for, one_gpu_per_task
from fabric_hsdp.processes.process_group_strategy import ProcessGroupStrategy
from fabric_hsdp.processes.run_topology import RunTopology
from fabric_hsdp.processes.teardown import ShardedModuleRegistry, exit_now
from fabric_hsdp.setup.float8 import precompute_scales_after_steps
from fabric_hsdp.setup.fsdp import (
    ModulePolicy,
    check_optimizer_is_sharded,
    parameter_names,
    precision_plugin,
    repoint_optimizers,
)
from fabric_hsdp.setup.gradients import ReplicaSyncControl, clip_grad_norm
from fabric_hsdp.setup.materialize import parameters_on_meta
from fabric_hsdp.setup.pipeline import levers_of, set_up_module
from fabric_hsdp.tensor_parallel import TensorParallelPlan, loss_parallel
from fabric_hsdp.topology import ParallelMesh, ShardSize, Topology

if TYPE_CHECKING:
    from fabric_hsdp.planning.memory import Training, Workload  # workload='s type and the planner's view


class HybridFSDPStrategy(ProcessGroupStrategy):
    """Hybrid sharded data parallel (HSDP) on FSDP2: shard within a node (or group of nodes), replicate across them,
    optionally split each layer by tensor parallelism inside the node. docs/api.md has each argument in full.

    The mesh is ``(replicate, shard)``, or ``(replicate, shard, tensor)`` with ``tensor_parallel_size > 1``; only the
    gradient all-reduce crosses the ``replicate`` dim, so all-gathers stay on the fast links. Mixed precision follows
    ``Fabric(precision=...)`` through FSDP2's policy (fp32 master shards, fp32 gradient reduction).

    Arguments:
        sharded_modules: Module classes (or a ``(name, module) -> bool`` callable) that become ``fully_shard``
            units. ``None``: the layers of the model's outermost ``nn.ModuleList``.
        shard_size: Ranks sharding one copy: ``"node"`` (default), ``"world"`` (plain FSDP), a number that divides
            the world and covers whole nodes, or ``"auto"`` (planned at ``setup_module``, as ``fabric-hsdp plan``).
        memory_budget: With ``"auto"``: bytes per rank (e.g. ``"70GB"``); default the free CUDA memory.
        workload: With ``"auto"``: the micro-batch, sequence length and optimizer to plan for.
        tensor_parallel_size: Ranks of a node that split each layer (default 1: none).
        tensor_parallel_plan: ``"auto"`` (transformers' plan, litgpt's ``GPT``, a model's ``_tp_plan``), a dict of
            module-name patterns to styles, or a callable ``(model, tensor_mesh) -> None``.
        sequence_parallel: Under TP, keep the activations between layers split by sequence.
        loss_parallel: Under TP, keep the logits split by vocabulary; use ``strategy.loss_parallel()`` for the loss.
        expert_parallel_size: Ranks of a node that split each mixture-of-experts layer's experts among them; each
            token goes to the rank holding its expert and back (all-to-all). Divides the shard group, the ranks per
            node and the experts per layer. Default ``None``: 1 (none), or with ``shard_size="auto"`` the planner's
            choice.
        context_parallel_size: Ranks of a node that split each sequence among them (keys and values all-gathered in
            each attention); they take the same micro-batch, cut with ``strategy.shard_sequence``. Default ``None``:
            1 (none; ``shard_size="auto"`` plans without it unless given: the training loop must cut its sequences).
        reshard_after_forward: FSDP2's option (``None``: FSDP2 decides).
        keep_gathered_while_accumulating: Keep every unit's parameters gathered from the first forward of an
            optimizer step to the last backward: inside ``fabric.no_backward_sync(model, enabled=True)`` the units
            are not resharded after backward, and they are not resharded after forward (implies
            ``reshard_after_forward=False``). One all-gather per step whatever the accumulation, for the memory
            of the whole model unsharded in the compute dtype (per tensor-parallel rank).
        activation_checkpointing: Module classes (or a callable) whose activations are recomputed in backward.
        activation_checkpointing_mode: ``"full"`` (default), ``"selective"`` (matmul, attention and collective
            outputs kept) or an int ``k`` (every ``k``-th selected module).
        compile: ``True`` or ``torch.compile`` keyword arguments: each unit compiled on its own, in place.
        float8: ``True``, ``"rowwise"`` or ``"tensorwise"``: torchao float8 linears (needs an SM 8.9+ GPU).
        cpu_offload: ``True`` for FSDP2's ``CPUOffloadPolicy()``, or an ``OffloadPolicy``.
        state_dict_type: ``"sharded"`` (default: a DCP directory, every rank writing) or ``"full"`` (one file from
            rank 0); a path ending in ``.safetensors`` is always saved full.
        async_save: ``fabric.save`` returns once each rank's chunks are staged to host memory; written in the
            background, committed atomically; the next save or load, ``wait_for_checkpoint()`` or ``teardown()``
            waits for it.
        load_mode: How consolidated files are read: ``"slice"`` (default: each rank its own elements), ``"turns"``
            or ``"rank0"``.
        load_turn_size: Ranks per node reading at once in ``"turns"``.
        split_replica_reads: Under HSDP the replicas each read 1/R of a shard and all-gather the rest.
        io_timeout: Seconds a rank's checkpoint I/O may stall before every rank fails naming it (``None``: off).
        process_group_backend: Default ``"nccl"`` on CUDA (``"cpu:gloo,cuda:nccl"`` with ``cpu_offload``), ``"gloo"``
            on CPU.
        timeout: Timeout of the collectives.
        accelerator, parallel_devices, cluster_environment, precision: As for Lightning's other strategies.
    """

    def __init__(
        self,
        sharded_modules: ModulePolicy | None = None,
        shard_size: ShardSize | Literal["auto"] = "node",
        memory_budget: int | str | None = None,
        workload: Workload | None = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: TensorParallelPlan = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        expert_parallel_size: int | None = None,
        context_parallel_size: int | None = None,
        reshard_after_forward: bool | int | None = None,
        keep_gathered_while_accumulating: bool = False,
        activation_checkpointing: ModulePolicy | None = None,
        activation_checkpointing_mode: Literal["full", "selective"] | int = "full",
        compile: bool | dict[str, Any] = False,
        float8: bool | str = False,
        cpu_offload: bool | Any = False,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        async_save: bool = False,
        load_mode: LoadMode = "slice",
        load_turn_size: int = 1,
        split_replica_reads: bool = False,
        io_timeout: float | timedelta | None = 600.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
    ) -> None:
        failures.install()  # a package error ends the script with one line on rank 0, not a traceback per rank
        self._launched_by = (
            detect_launcher()
        )  # mpirun inside SLURM, srun inside salloc: see fabric_hsdp/processes/launchers.py
        if (binding := one_gpu_per_task()) is not None:  # before Fabric's own "only has [0]"
            rank_zero_warn(binding)
        environment = cluster_environment or environment_for(self._launched_by)
        super().__init__(accelerator, parallel_devices, environment, precision, process_group_backend)
        self._levers = levers_of(
            sharded_modules=sharded_modules,
            reshard_after_forward=reshard_after_forward,
            keep_gathered_while_accumulating=keep_gathered_while_accumulating,
            cpu_offload=cpu_offload,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_plan=tensor_parallel_plan,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_mode=activation_checkpointing_mode,
            compile=compile,
            float8=float8,
        )
        self._run_topology = RunTopology(
            shard_size, tensor_parallel_size, memory_budget, workload, expert_parallel_size, context_parallel_size
        )
        self._checkpoints = Checkpointer(
            state_dict_type=state_dict_type,
            async_save=async_save,
            load_mode=load_mode,
            load_turn_size=load_turn_size,
            split_replica_reads=split_replica_reads,
            io_timeout=io_timeout,
        )
        self._timeout = timeout
        self._backward_sync_control = ReplicaSyncControl(self._levers.keep_gathered_while_accumulating)
        self._sharded = ShardedModuleRegistry()

    @property
    def precision(self) -> Precision:
        """Fabric's precision plugin; ``"bf16-mixed"`` without autocast (FSDP2's policy is the mixed precision)."""
        return Strategy.precision.fget(self)

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        Strategy.precision.fset(self, precision_plugin(precision))

    @property
    def device_mesh(self) -> Any:
        """The named ``DeviceMesh``: dims ``("replicate", "shard")``, or ``("replicate", "shard", "tensor")`` with
        tensor parallelism; exists once the processes are set up."""
        return self.parallel_mesh.device_mesh

    @property
    def parallel_mesh(self) -> ParallelMesh:
        """The mesh and its sub-meshes by purpose (``fsdp``, ``tensor``, ``replicate``); exists once the processes
        are set up."""
        return self._run_topology.mesh

    @property
    def topology(self) -> Topology:
        """Degrees of the mesh (``shard_size``, ``replicate_size``, nodes, ranks per node) and this rank's place."""
        return self._run_topology.topology

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._run_topology.sampler_kwargs(self.world_size, self.global_rank)

    @override
    def setup_environment(self) -> None:
        check_launch(self._launched_by, self.environment, self.num_nodes, self.num_processes, self.local_rank)
        self._run_topology.check_device(self.root_device.type)
        super().setup_environment()  # the accelerator selects cuda:LOCAL_RANK here, before anything is allocated
        # before the process group exists: a rank that fails while starting (the rank-layout check) must destroy it
        # too, or the interpreter's exit destroys it and can abort ("terminate called without an active exception")
        atexit.register(self._end_of_process)
        self._process_group_backend = distributed.start_processes(
            self.environment,
            self._launched_by,
            self.root_device,
            num_nodes=self.num_nodes,
            ranks_per_node=self.num_processes,
            backend=self._process_group_backend,
            timeout=self._timeout,
            cpu_offload=self._levers.cpu_offload,
        )
        failures.install()  # again, above the hook init_process_group installed (it prefixes every line)
        backend, ranks_per_node = self._process_group_backend, self.num_processes
        self._run_topology.set_up(self.num_nodes, ranks_per_node, self.world_size, self.root_device, backend)
        self._checkpoints.set_up(
            self._timeout,
            broadcast=self.broadcast,
            local_rank=self.local_rank,
            ranks_per_node=ranks_per_node,
            mesh=lambda: self._run_topology.mesh_if_built,
        )

    @override
    def setup_module(self, module: Module) -> Module:
        if not self._run_topology.resolved:  # shard_size="auto": plan the model (every rank, the same choice)
            self._run_topology.choose(
                module, self._levers.tensor_parallel_plan, self.planner_training(self._run_topology.workload)
            )
        set_up_module(
            module,
            self.parallel_mesh,
            self.topology,
            self._levers,
            precision=self.precision_name,
            device=self.root_device,
            global_rank=self.global_rank,
        )
        self._sharded.add(module)
        return module

    def planner_training(self, workload: Workload | None = None) -> Training:
        """How the planner sees this strategy's training (precision, levers, offload) for ``workload``: what
        ``shard_size="auto"`` chooses with and the dry run's report compares against."""
        from fabric_hsdp.planning.auto import planner_training

        return planner_training(self.precision_name, workload, self._levers)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        names = parameter_names(module, optimizers)  # before fully_shard replaces the parameters
        module = self.setup_module(module)
        repoint_optimizers(module, optimizers, names)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        check_optimizer_is_sharded(optimizer)
        if self._levers.float8 is not None and self._levers.float8.recipe == "tensorwise":
            precompute_scales_after_steps(optimizer, self._sharded.modules())
        return optimizer

    @override
    def module_to_device(self, module: Module) -> None:
        pass  # setup_module places the local shards

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        stack = ExitStack()
        if empty_init:
            stack.enter_context(parameters_on_meta())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        parameters = self.precision.main_params(optimizer)
        return clip_grad_norm(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save model, optimizer(s) and plain values: a sharded DCP directory, or one full file (``state_dict_type``).

        The checkpoint appears at ``path`` only once complete; a previous checkpoint there is replaced atomically.
        ``filter`` keeps, per state key, the entries its function returns ``True`` for, as Fabric's other strategies
        do (``{"model": lambda name, value: "lora_" in name}``: adapters only); load such a checkpoint with
        ``strict=False``.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint() takes no storage_options: it writes DCP itself.")
        if filter is not None and not isinstance(filter, dict):
            raise TypeError(f"filter= must be a dict of functions by state key, e.g. {{'model': fn}}; got {filter!r}.")
        self._checkpoints.save(path, state, filter=filter)

    def save_full_checkpoint(self, path: _PATH, state: dict[str, Module | Optimizer | Any]) -> None:
        """Write ``state`` as one consolidated file whatever ``state_dict_type`` says, e.g. a final export beside
        periodic sharded checkpoints: ``.pth`` in Fabric's layout, or ``.safetensors`` for the model alone.

        Rank 0 writes, gathering one tensor at a time; the file holds the model's own layout (also under tensor
        parallelism). Call it on every rank.
        """
        self._checkpoints.save(path, _unwrap_objects(state), full=True)

    def check_writable(self, directory: _PATH) -> None:
        """Raise ``SaveError`` on every rank now if some rank cannot create files in ``directory`` (made if missing).

        Call it at start-up for the directories the job saves into: an unwritable one (read-only, wrong permissions, a
        file in the way) is found before the first step, not at the first save. Call it on every rank.
        """
        self._checkpoints.check_writable(directory)

    def shard_sequence(self, *tensors: Tensor, position_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        """This rank's part of a batch of sequences under ``context_parallel_size=C``: each ``[batch, T]`` tensor
        (input ids, labels already shifted) cut to its head-tail chunks of ``T / 2C`` tokens, then their position
        ids (``position_ids``: a packed batch's own, restarting at 0 at each document; default ``0 .. T - 1``).
        Without context parallelism the tensors as they are and the position ids. Pass the position ids to the
        model (litgpt's ``GPT`` takes none: ``model(input_ids)``; it reads a packed sequence as one), and compute the
        loss with :meth:`cross_entropy`::

            input_ids, labels, position_ids = fabric.strategy.shard_sequence(input_ids, labels)
            logits = model(input_ids, position_ids=position_ids).logits
            fabric.backward(fabric.strategy.cross_entropy(logits, labels))
        """
        from fabric_hsdp.context_parallel.sequence import shard_sequence

        context = self.parallel_mesh.context
        rank, size = (0, 1) if context is None else (context.get_local_rank(), context.size())
        return shard_sequence(tensors, rank, size, position_ids)

    def cross_entropy(self, logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
        """The loss of this rank's tokens as its share of the mean over the labelled tokens of the whole sequences
        (the context group's); a plain mean without context parallelism. Its gradients are the unsplit run's.
        To log the step's loss: ``fabric.all_reduce(loss, reduce_op="sum") / strategy.topology.data_parallel_size``."""
        from fabric_hsdp.context_parallel import cross_entropy

        context = self.parallel_mesh.context
        return cross_entropy(logits, labels, None if context is None else context.get_group(), ignore_index)

    def loss_parallel(self) -> AbstractContextManager:
        """The context to compute the loss and run its backward in, for ``loss_parallel=True``'s split logits.

        ``F.cross_entropy`` works on each rank's ``1/T`` of the vocabulary (torch's ``loss_parallel()``); without
        ``loss_parallel=True`` it does nothing, so one loop serves both::

            with fabric.strategy.loss_parallel():
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                fabric.backward(loss)

        The loss is a replicated DTensor: ``.item()`` as usual, ``.full_tensor()`` to add it to plain tensors.
        """
        return loss_parallel(self._levers.loss_parallel)

    def wait_for_checkpoint(self) -> None:
        """Block until a save running in the background (``async_save=True``) is committed; raise its failure.

        Call it on every rank. Saves, loads and ``teardown()`` call it themselves.
        """
        self._checkpoints.wait()

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a sharded checkpoint or any consolidated format; return what is left.

        A DCP directory holding ``state``'s model key loads with resharding onto this topology. Anything else (a raw
        state dict, a Fabric full checkpoint, safetensors, a Hugging Face directory, a flat DCP directory) fills the
        shards per ``load_mode``; a Fabric full checkpoint also restores the optimizers and plain values.
        """
        return self._checkpoints.load(path, state, strict=strict, weights_only=weights_only)

    def load_raw(
        self,
        path: _PATH,
        module: Module,
        strict: bool = True,
        *,
        key_map: KeyMapSpec = None,
        load_mode: LoadMode | None = None,
        weights_only: bool = True,
    ) -> LoadResult:
        """Fill ``module``'s shards from a consolidated checkpoint without a full copy per rank.

        Args:
            path: A raw state dict (``.pth``/``.pt``/``.bin``), a Fabric full checkpoint, a ``.safetensors`` file, a
                Hugging Face directory, or a DCP directory.
            module: The model after ``fabric.setup_module``.
            strict: Raise one error listing missing, unexpected and mis-shaped tensors; ``False`` loads what
                matches and logs the rest (also returned).
            key_map: Renames checkpoint keys: a callable ``str -> str | None`` or prefix rules ``{"old.": "new."}``.
                Wrappers (``module.``, ``_orig_mod.``, ``model.``) are stripped automatically when unambiguous.
            load_mode: Overrides the strategy's ``load_mode`` for this call.
            weights_only: Unpickle with torch's safe loader; ``False`` only for trusted files.
        """
        options = {"strict": strict, "weights_only": weights_only, "key_map": key_map, "load_mode": load_mode}
        return self._checkpoints.load_raw(Path(path), module, **options)

    @override
    def teardown(self) -> None:
        """Finish a background save, release the modules' FSDP state, destroy the process group, tear down plugins."""
        try:
            self._checkpoints.close()
        finally:
            self._sharded.release_and_destroy()
        super().teardown()

    def _end_of_process(self) -> None:
        """At interpreter exit: finish a background save, then release the modules and the process group."""
        failed = self._checkpoints.finish_at_exit()
        self._sharded.release_and_destroy()
        if failed:  # a checkpoint the script asked for was not written: the exit status must say so
            exit_now(1)
