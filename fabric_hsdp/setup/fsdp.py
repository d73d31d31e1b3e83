"""Which modules become ``fully_shard`` units, and with what mixed precision and offload (``apply_fsdp``, the last
step of :mod:`fabric_hsdp.setup.pipeline`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn

from fabric_hsdp import versions
from fabric_hsdp.logs import info_on_rank_zero
from fabric_hsdp.setup.precision import PRECISION_DTYPES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from fabric_hsdp.expert_parallel import ExpertUnits

_logger = logging.getLogger(__name__)

ModulePolicy = set[type[nn.Module]] | Iterable[type[nn.Module]] | Callable[[str, nn.Module], bool]


def module_matcher(policy: ModulePolicy | None, argument: str) -> Callable[[str, nn.Module], bool] | None:
    """Turn a set of module classes, or a ``(name, module) -> bool`` callable, into one predicate."""
    if policy is None:
        return None
    if callable(policy) and not isinstance(policy, type):
        return policy
    if isinstance(policy, type):
        policy = {policy}
    classes = tuple(policy)
    bad = [cls for cls in classes if not (isinstance(cls, type) and issubclass(cls, nn.Module))]
    if bad or not classes:
        raise TypeError(
            f"HybridFSDPStrategy({argument}=...) takes a set of nn.Module classes (e.g. {{Block}}) or a callable"
            f" (name, module) -> bool; got {policy!r}."
        )
    return lambda name, module: isinstance(module, classes)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for Fabric's ``precision=`` string."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in PRECISION_DTYPES:
        raise ValueError(
            f"HybridFSDPStrategy does not support Fabric(precision={precision!r}). Choose one of:"
            f" {', '.join(PRECISION_DTYPES)}."
        )
    dtypes = PRECISION_DTYPES[precision]
    if not dtypes.mixed:  # "true" precisions built the parameters in their dtype: nothing to cast
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtypes.compute), reduce_dtype=getattr(torch, dtypes.reduce))


class PolicyMixedPrecision(MixedPrecision):
    """Fabric's ``"bf16-mixed"`` under FSDP2, whose policy computes with bf16 parameters and reduces in fp32.

    Lightning's ``MixedPrecision`` runs ``torch.autocast`` on top (casting what is bf16 already, and upcasting
    norms and softmax) and converts the outputs to fp32 (at 8k tokens x 128k vocabulary a 4.2 GB copy of the logits,
    plus its gradient). Here the forward runs as the policy casts it (torchtitan's way), and outputs come back as
    computed: take ``logits.float()`` for an fp32 loss.
    """

    def forward_context(self) -> Any:
        from contextlib import nullcontext

        return nullcontext()

    def convert_output(self, data: Any) -> Any:
        return data


def precision_plugin(plugin: Precision | None) -> Precision | None:
    """The plugin to use for the one Fabric chose: :class:`PolicyMixedPrecision` in place of ``"bf16-mixed"``'s
    autocast; others (fp16 keeps autocast and its loss scaler) as they are."""
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        return PolicyMixedPrecision("bf16-mixed", plugin.device)
    return plugin


def offloads(cpu_offload: bool | OffloadPolicy) -> bool:
    """Whether ``HybridFSDPStrategy(cpu_offload=...)`` (a bool or an offload policy) puts the state in CPU memory:
    the one reading of the argument (FSDP's policy, the process group's backend, the planner)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return cpu_offload is True or isinstance(cpu_offload, CPUOffloadPolicy)


def offload_policy(cpu_offload: bool | OffloadPolicy, device: torch.device) -> OffloadPolicy:
    """``True`` means FSDP2's ``CPUOffloadPolicy()``; a policy object is used as given.

    Raises:
        ValueError: offloading was asked for on a CPU device, where the shards already are in CPU memory (FSDP2's
            offload copies them to an accelerator for each step and fails without one).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    policy = cpu_offload if isinstance(cpu_offload, OffloadPolicy) else CPUOffloadPolicy() if cpu_offload else None
    if offloads(cpu_offload) and device.type == "cpu":
        raise ValueError(
            "HybridFSDPStrategy(cpu_offload=True) moves the shards from an accelerator's memory to CPU memory, but this"
            " run's device is the CPU, where they already are. Drop cpu_offload, or run on GPUs."
        )
    return policy or OffloadPolicy()


@dataclass
class FSDPSettings:
    """Everything ``apply_fsdp`` needs besides the model, its units and the mesh."""

    sharded_modules: Callable[[str, nn.Module], bool] | None  # None: the layers of the model's nn.ModuleLists
    reshard_after_forward: bool | int | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None


def sharded_units(
    module: nn.Module, sharded_modules: Callable[[str, nn.Module], bool] | None
) -> list[tuple[str, nn.Module]]:
    """The modules that become their own FSDP unit, by name, in model order (the root not included).

    Raises:
        ValueError: ``sharded_modules`` matched nothing; the message lists the model's module classes.
    """
    named = [(name, child) for name, child in module.named_modules() if name]
    matcher = sharded_modules or _module_list_layers(module)
    units = [(name, child) for name, child in named if matcher(name, child)]
    if sharded_modules is None and units:
        info_on_rank_zero(_logger, "sharding %d layers (%s) one unit each", len(units), _class_names(units))
    if not units:
        what = "sharded_modules=..." if sharded_modules else "sharded_modules=None (layers of nn.ModuleLists)"
        raise ValueError(
            f"HybridFSDPStrategy({what}) matched no submodule of {type(module).__name__}, so nothing would be sharded"
            f" layer by layer. The model contains: {_class_names(named)}. Pass the transformer block class, e.g."
            " HybridFSDPStrategy(sharded_modules={Block})."
        )
    return units


def apply_fsdp(
    module: nn.Module,
    units: list[tuple[str, nn.Module]],
    mesh: DeviceMesh,
    settings: FSDPSettings,
    experts: ExpertUnits | None = None,
) -> None:
    """``fully_shard`` the experts of expert parallelism over their own mesh, every unit bottom-up, then the
    embeddings and the head (:func:`outer_units`), then the root, over ``mesh`` (the ``(replicate, shard)`` mesh)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": settings.reshard_after_forward}
    if settings.mp_policy is not None:
        kwargs["mp_policy"] = settings.mp_policy
    if settings.offload_policy is not None:
        kwargs["offload_policy"] = settings.offload_policy
    # Children first: an FSDP unit manages the parameters not already owned by a unit below it.
    experts_units = experts.modules if experts else []
    for child in experts_units:
        by_rows = {"shard_placement_fn": _by_rows} if experts.by_rows else {}
        fully_shard(child, **{**kwargs, "mesh": experts.mesh, **by_rows})
    for _, child in reversed(units):
        if not any(child is unit for unit in experts_units):  # sharded_modules naming the experts: a unit already
            fully_shard(child, **kwargs)
    embeddings, tail = outer_units(module, units)
    for embedding in embeddings:
        fully_shard(embedding, **kwargs)
    if tail:  # the backward starts with it: keep it gathered from its forward to then (torchtitan does)
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    fully_shard(module, **kwargs)
    module.register_forward_hook(_reshard_after_forward_without_gradients)
    if reduces_by_sum(mesh):
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_force_sum_reduction_for_comms(True)  # FSDP2 sums, then divides the shard itself


def _by_rows(param: nn.Parameter) -> Any:
    from torch.distributed.tensor import Shard

    return Shard(1)


def reduces_by_sum(mesh: DeviceMesh) -> bool:
    """Whether FSDP2 must sum gradients over ``mesh`` and divide them itself (``ReduceOp.AVG`` is not trusted): when
    a backend that reduces them, the one each dim's group uses for the mesh's device type, is gloo."""
    import torch.distributed as dist

    backends = {
        versions.backend_for_device(dist.get_backend(mesh.get_group(dim)), mesh.device_type) for dim in range(mesh.ndim)
    }
    return any(map(versions.gloo_reduces_average_as_sum, backends))


def hold_frozen_in_compute_dtype(module: nn.Module, mp_policy: MixedPrecisionPolicy | None) -> list[str]:
    """Under mixed precision, hold the frozen parameters (``requires_grad=False`` at setup: a LoRA model's base) in
    the compute dtype; return their names.

    FSDP2 keeps every sharded parameter in the dtype it was built in, fp32 under ``"bf16-mixed"``: a master copy for
    the optimizer. A frozen parameter is never updated, and the policy computes with its bf16 cast anyway, so an fp32
    shard only doubles its memory. Cast here, before ``fully_shard``, it is held (and loaded) in bf16, which the
    policy then uses as it is: the same values in forward and backward, half the bytes. FSDP2 requires one dtype per
    unit for the trainable parameters only (the adapters stay fp32).
    """
    dtype = getattr(mp_policy, "param_dtype", None)
    if dtype is None:
        return []
    cast: dict[int, nn.Parameter] = {}  # one new parameter per tensor: tied weights stay tied
    names = []
    for owner_name, owner in module.named_modules():
        for name, param in list(versions.module_parameters(owner).items()):
            if param is None or param.requires_grad or param.dtype == dtype or not param.is_floating_point():
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                names.append(f"{owner_name}.{name}" if owner_name else name)
            versions.module_parameters(owner)[name] = cast[id(param)]
    if names:
        info_on_rank_zero(_logger, "holding %d frozen parameters in %s (no fp32 master copy)", len(names), dtype)
    return names


def outer_units(module: nn.Module, units: list[tuple[str, nn.Module]]) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules outside the blocks that hold parameters, as units of their own (torchtitan's layout): each
    embedding alone, freed after its forward; the rest (the final norm and the output head) together.

    Left in the root they stay gathered for the whole step (2 x 128256 x 4096 bf16 = 2.1 GB per GPU at Llama-3-8B),
    and their reduce-scatter is the last collective of the backward, with nothing to overlap. An embedding tied to
    the head (one weight in both) stays in the root with the rest: a weight belongs to one unit.
    """
    inside = {id(sub) for _, unit in units for sub in unit.modules()}
    holders = {
        name: sub
        for name, sub in module.named_modules()
        if name and id(sub) not in inside and next(sub.parameters(recurse=False), None) is not None
    }
    # the topmost holders: one inside another is sharded with it
    top = [sub for name, sub in holders.items() if not any(name.startswith(other + ".") for other in holders)]
    embeddings = [sub for sub in top if isinstance(sub, nn.Embedding)]
    tail = [sub for sub in top if not isinstance(sub, nn.Embedding)]
    tied = {id(p) for sub in embeddings for p in sub.parameters()} & {id(p) for sub in tail for p in sub.parameters()}
    if tied:
        return [], []
    return embeddings, tail


def _reshard_after_forward_without_gradients(module: nn.Module, args: Any, output: Any) -> None:
    """The root unit (and any unit with ``reshard_after_forward=False``) keeps its parameters gathered after forward
    for the backward to use. A forward without gradients (a validation loss, ``generate()``) has no backward, so they
    stayed gathered: an optimizer made then from ``model.parameters()`` held plain tensors. Reshard them here."""
    from torch.distributed.fsdp import FSDPModule

    if torch.is_grad_enabled():
        return
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _module_list_layers(module: nn.Module) -> Callable[[str, nn.Module], bool]:
    # only the outermost lists' layers: a list inside a layer (litgpt's MoE experts) is part of it, and an expert
    # that some rank's tokens skip must not be a unit of its own (its all-gather would run on some ranks only)
    layers: set[int] = set()
    inside: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and id(sub) not in inside:
            for child in sub:
                layers.add(id(child))
                inside.update(id(nested) for nested in child.modules())
    return lambda name, child: id(child) in layers


def _class_names(named: list[tuple[str, nn.Module]]) -> str:
    return ", ".join(sorted({type(child).__name__ for _, child in named}))


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was already applied to ``module``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def parameter_names(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[int, str]:
    """Each parameter's name by identity, taken before sharding; refuses optimizers that already have state."""
    for optimizer in optimizers:
        if optimizer.state:
            raise ValueError(
                "The optimizer already has state, which cannot follow the parameters into their shards. Create"
                " the optimizer after fabric.setup_module(model), then call fabric.setup_optimizers(optimizer)."
            )
    return {id(param): name for name, param in module.named_parameters()}


def repoint_optimizers(module: nn.Module, optimizers: list[torch.optim.Optimizer], names: dict[int, str]) -> None:
    """``fully_shard`` replaced each parameter with a sharded one: point the optimizers at them by name."""
    sharded = dict(module.named_parameters())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(param)]] for param in group["params"]]


def check_optimizer_is_sharded(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds parameters ``setup_module`` did not shard (created too early)."""
    from torch.distributed.tensor import DTensor

    plain = [p for group in optimizer.param_groups for p in group["params"] if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"The optimizer holds {len(plain)} parameter(s) that are not sharded (e.g. shape"
            f" {list(plain[0].shape)}): it was created before fabric.setup_module(model). Create it after:"
            " `model = fabric.setup_module(model); optimizer = fabric.setup_optimizers(AdamW(model.parameters()))`."
        )
