"""Training parity with one process, judged against the floating-point noise measured in the same run.

A sharded run and a single process on the full batch compute the same mathematics in a different summation order, so
they differ by rounding. How much depends on the machine (which kernels, which vector width) and is amplified by
AdamW: an element whose gradient is near zero gets an update of order ``lr`` from rounding alone. Instead of a fixed
threshold, every run also trains the single-process model a second way that is mathematically identical -- the same
rows as accumulated micro-batches, in the order the ranks hold them and in reverse -- and reports the larger distance
from the full-batch run: the noise floor of this machine for this model. The test compares the sharded run's distance
with it.

Tensor parallelism is judged more finely as well (``gradients=True``): the first step's gradients, gathered before
clipping, against the same model and batch in float64 in one process, relative to the global gradient norm. AdamW
normalises each element, so a gradient off by a per-tensor scale barely moves the parameters; on the gradients it reads
directly. The floor is the same measure for the model's fp32 gradients in one process, and a control per model
(:data:`GRADIENT_CONTROLS`: one path of the gradient 1 % off, in the sharded run) shows the resolution.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers.training import batch, build, full_state, layer_class, logits_of, make_fabric

LEARNING_RATE = 1e-2
MAX_NORM = 0.5
CLIP_VALUE = 0.01
MICRO_BATCH = 2
BUGS = ("no_replicate_allreduce", "wrong_sampler", "skip_sync_flush")
# per model, label -> (module, factor): the gradient flowing into that module's output scaled by ``factor`` in the
# sharded run (its weight's gradient and what it passes back), its forward unchanged. 1 % of a query projection's
# (litgpt: the fused qkv), and of the embedding's share of hf-tied's tied gradient.
GRADIENT_CONTROLS = {
    "llama": {"wq x1.01": ("layers.1.attention.wq", 1.01)},
    "hf": {"q_proj x1.01": ("model.layers.1.self_attn.q_proj", 1.01)},
    "litgpt": {"qkv x1.01": ("transformer.h.1.attn.qkv", 1.01)},
    "hf-tied": {
        "q_proj x1.01": ("model.layers.1.self_attn.q_proj", 1.01),
        "embedding path x0.99": ("model.embed_tokens", 0.99),
    },
}


@dataclass
class Trained:
    losses: list[float]
    norms: list[float]
    state: dict[str, torch.Tensor]
    batches: list = field(default_factory=list)  # the inputs of each micro-batch this rank trained on
    forwards_per_micro_batch: float = 0.0  # forward calls of each layer per micro-batch: 2 when it is recomputed
    use_cache: Any = None  # a transformers model's config.use_cache after setup
    resharded_after_forward: bool | None = None  # a layer's parameters are sharded again after a forward
    gradients: dict[str, torch.Tensor] | None = None  # the first step's, full and in stored row order, if asked


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits_of(model, inputs).flatten(0, 1), targets.flatten())


def _clip(model: torch.nn.Module, clip: str | None) -> float | None:
    if clip == "norm":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM).item()
    if clip == "value":
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=CLIP_VALUE)
    return None


def train_one_process(
    kind: str, inputs: torch.Tensor, targets: torch.Tensor, steps: int, clip: str | None, micro_batches: Any = None
) -> Trained:
    """One process, fp32. ``micro_batches`` (lists of rows): accumulate those; else the full batch in one go."""
    model = build(kind, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses, norms = [], []
    for _ in range(steps):
        if micro_batches is None:
            loss = _loss(model, inputs, targets)
            loss.backward()
            step_loss = loss.item()
        else:
            step_loss = 0.0
            for rows in micro_batches:
                loss = _loss(model, inputs[rows], targets[rows]) / len(micro_batches)
                loss.backward()
                step_loss += loss.item()
        norm = _clip(model, clip)
        if norm is not None:
            norms.append(norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return Trained(losses, norms, {name: t.detach().clone() for name, t in model.state_dict().items()})


def first_step_gradients(
    kind: str, inputs: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One process, the full batch: the first step's gradients of the model in ``dtype``."""
    model = build(kind, seed=0).to(dtype)
    _loss(model, inputs, targets).backward()
    return {name: param.grad.detach().clone() for name, param in model.named_parameters()}


def gradient_distance(gradients: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``max over tensors ||g - exact|| / ||exact||_global``, and the tensor where it is largest."""
    scale = torch.stack([value.double().norm() for value in exact.values()]).norm()
    each = {name: ((gradients[name].double() - value.double()).norm() / scale).item() for name, value in exact.items()}
    worst = max(each, key=each.__getitem__)
    return {"value": each[worst], "tensor": worst}


def relative_gradient_distance(gradients: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``max over tensors ||g - exact|| / ||exact||``, each tensor by its own norm (an error in a small tensor is not
    hidden by the embedding's large norm), and the tensor where it is largest."""
    each = {
        name: ((gradients[name].double() - value.double()).norm() / value.double().norm()).item()
        for name, value in exact.items()
        if value.double().norm() > 0
    }
    worst = max(each, key=each.__getitem__)
    return {"value": each[worst], "tensor": worst}


def _gathered_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor (a collective), fused rows (litgpt's qkv) in the stored order."""
    from fabric_hsdp.tensor_parallel import fused_rows_of

    module = getattr(model, "module", model)
    fused = fused_rows_of(module)
    gradients = {}
    for name, param in module.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        gradients[name] = (fused[name].to_stored_order(grad) if name in fused else grad).detach().cpu().clone()
    return gradients


@contextmanager
def _scaled_gradient(model: torch.nn.Module, control: tuple[str, float] | None) -> Iterator[None]:
    """``control`` = (module, factor): the gradient into that module's output times ``factor``, the forward exact."""
    if control is None:
        yield
        return
    name, factor = control

    def scale(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + (factor - 1) * (output - output.detach())  # output - output.detach() is exactly 0

    handle = getattr(model, "module", model).get_submodule(name).register_forward_hook(scale)
    try:
        yield
    finally:
        handle.remove()


def sampler_rows(num_rows: int, num_replicas: int, rank: int) -> list[int]:
    """The rows ``DistributedSampler(shuffle=False)`` gives ``rank``."""
    return list(DistributedSampler(range(num_rows), num_replicas=num_replicas, rank=rank, shuffle=False))


@contextmanager
def _planted(bug: str | None, fabric: Any) -> Iterator[None]:
    """``no_replicate_allreduce``: ``fully_shard`` gets only the ``shard`` dim of the mesh, so replicas never sync."""
    if bug != "no_replicate_allreduce":
        yield
        return
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    def shard_only(module: torch.nn.Module, *, mesh: Any, **kwargs: Any) -> Any:
        # sliced from the whole mesh: torch 2.8 slices no submesh of a submesh (the FSDP mesh under TP is one)
        return original(module, mesh=fabric.strategy.device_mesh["shard"], **kwargs)

    fsdp.fully_shard = shard_only
    try:
        yield
    finally:
        fsdp.fully_shard = original


def _train_sharded(
    fabric: Any,
    kind: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    steps: int,
    accumulate: int,
    clip: str | None,
    setup_together: bool,
    bug: str | None,
    gradients: bool = False,
    control: tuple[str, float] | None = None,
) -> Trained:
    """``gradients``: gather the first step's gradients; ``control``: plant :data:`GRADIENT_CONTROLS`' scale and
    stop after those (no optimizer step, no state)."""
    model = build(kind, seed=0)
    with _planted(bug, fabric):
        if setup_together:
            model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
        else:
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    layers = [sub for sub in model.modules() if isinstance(sub, layer_class(kind))]
    # calls of the layer class's own forward: the recompute runs it inside the checkpoint, not through the layer's
    # hooks (as torchtitan's checkpoint_wrapper reruns the wrapped module's forward). Not in compiled blocks
    # (Module.compile): the graph recomputes inside its own backward, and the counter would be a guard to recompile on.
    forwards, layer_forward = [0], layer_class(kind).forward
    compiled = any(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)

    def counted_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        forwards[0] += 1
        return layer_forward(self, *args, **kwargs)

    if not compiled:
        layer_class(kind).forward = counted_forward
    hooks = []
    # in training: FSDP2 leaves a layer's parameters gathered after its forward with reshard_after_forward=False
    after_forward: list[bool] = []

    def record(module: torch.nn.Module, *_: Any) -> None:
        after_forward.append(all(isinstance(p, DTensor) for p in module.parameters()))

    hooks.append(layers[0].register_forward_hook(record))
    dataset = TensorDataset(inputs, targets)
    if bug == "wrong_sampler":  # every replica reads the first replica's rows instead of its own
        shard_size = fabric.strategy.topology.shard_size
        world = fabric.world_size
        sampler = DistributedSampler(dataset, num_replicas=world, rank=fabric.global_rank % shard_size, shuffle=False)
        loader = fabric.setup_dataloaders(
            DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler), use_distributed_sampler=False
        )
    else:  # Fabric inserts a DistributedSampler with the strategy's distributed_sampler_kwargs
        loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=False))
    losses, norms, seen = [], [], []
    first_gradients = None
    for step in range(1 if control else steps):
        micro_batches = list(loader)
        assert len(micro_batches) == accumulate, (len(micro_batches), accumulate)
        seen.append([rows.tolist() for rows, _ in micro_batches])
        step_loss = torch.zeros(())
        for micro, (micro_inputs, micro_targets) in enumerate(micro_batches):
            last = micro == accumulate - 1
            sync = fabric.no_backward_sync(model, enabled=bug == "skip_sync_flush" or not last)
            with sync, fabric.strategy.loss_parallel(), _scaled_gradient(model, control):  # loss_parallel: a no-op
                loss = _loss(model, micro_inputs, micro_targets)  # unless loss_parallel=True
                fabric.backward(loss / accumulate)
            loss = loss.detach()
            step_loss += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss) / accumulate
        if (gradients or control) and step == 0:
            first_gradients = _gathered_gradients(model)
        if control:
            break
        if clip == "norm":
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        elif clip == "value":
            fabric.clip_gradients(model, optimizer, clip_val=CLIP_VALUE)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(step_loss, reduce_op="mean").item())
    for hook in hooks:
        hook.remove()
    layer_class(kind).forward = layer_forward
    if control:
        return Trained([], [], {}, seen, gradients=first_gradients)
    config = getattr(getattr(model, "module", model), "config", None)
    per_micro_batch = float("nan") if compiled else forwards[0] / (len(layers) * steps * accumulate)
    state = full_state(model)
    with torch.no_grad():  # a forward without gradients, after which the strategy reshards every unit
        logits_of(model, inputs[:1])
    resharded = after_forward[-1]
    use_cache = getattr(config, "use_cache", None)
    return Trained(losses, norms, state, seen, per_micro_batch, use_cache, resharded, first_gradients)


def _relative(values: list[float], reference: list[float]) -> float:
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(values, reference, strict=True)), default=0.0)


def distance(trained: Trained, reference: Trained) -> dict[str, float]:
    """Largest relative difference of losses, clip norms, and parameters (per tensor: ``|a - b| / |b|``)."""
    parameters = max(
        ((trained.state[name] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        for name, ref in reference.state.items()
        if ref.is_floating_point()
    )
    return {
        "losses": _relative(trained.losses, reference.losses),
        "norms": _relative(trained.norms, reference.norms),
        "parameters": parameters,
    }


# A sharded run differs from one process by rounding. It may differ by at most NOISE_FACTOR times the distance between
# two single-process runs that differ only in summation order (full batch vs the same rows as accumulated
# micro-batches, in two orders), measured in the same launch on the same machine, and never by more than CAPS.
# MIN_TOLERANCE, for when the single-process runs happen to round alike: ~16 fp32 ulps (6e-8 each) for losses and
# parameters; a gradient norm sums the squares of ~1e5 elements, whose rounding grows like sqrt(1e5) ulps.
NOISE_FACTOR = 10
MIN_TOLERANCE = {"losses": 1e-6, "norms": 2e-5, "parameters": 1e-6}
CAPS = {"losses": 1e-4, "norms": 1e-4, "parameters": 1e-3}


def beyond_noise(distance: dict[str, float], floor: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The measures (losses, norms, parameters) beyond their tolerance, as ``{measure: (distance, tolerance)}``: empty
    when ``distance`` is within the noise of ``floor``, so ``assert not beyond_noise(...)`` reads as it means."""
    tolerances = {what: min(cap, max(NOISE_FACTOR * floor[what], MIN_TOLERANCE[what])) for what, cap in CAPS.items()}
    return {what: (distance[what], tolerances[what]) for what in CAPS if distance[what] > tolerances[what]}


def parity(
    num_nodes: int,
    devices: int,
    kind: str = "llama",
    steps: int = 3,
    accumulate: int = 1,
    clip: str | None = None,
    activation_checkpointing: bool = False,
    setup_together: bool = False,
    bugs: list[str] = (),
    kinds: list[str] | None = None,
    variants: dict[str, dict[str, Any]] | None = None,
    gradients: bool = False,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Train sharded (and, for ``bugs``, with each bug planted); return distances to one process and the noise floor.

    ``kinds``: several models, one after the other in this launch (the result is then keyed by kind); ``bugs`` are
    planted in the first one only.
    ``variants``: with ``kinds``, more strategies (label -> extra strategy arguments, e.g. sequence_parallel=True)
    trained in the same launch against the same references; their distances under ``"variants"``.
    ``gradients``: also the first step's gradients against float64 (see the module docstring), of the run, its
    variants and the model's control, under ``"gradients"``.
    ``strategy_kwargs``: passed to the strategy, e.g. ``tensor_parallel_size=2``.
    """
    layers = {layer_class(name) for name in kinds or [kind]}
    if activation_checkpointing:
        strategy_kwargs["activation_checkpointing"] = layers
    options = dict(
        steps=steps, accumulate=accumulate, clip=clip, setup_together=setup_together, bugs=bugs, gradients=gradients
    )
    if kinds is not None:  # the strategy's default sharded_modules: the layers of the models' nn.ModuleLists
        fabric = make_fabric(num_nodes, devices, **strategy_kwargs)
        others = {
            label: make_fabric(num_nodes, devices, **strategy_kwargs, **extra)
            for label, extra in (variants or {}).items()
        }
        return {
            name: _parity(fabric, name, **dict(options, bugs=bugs if name == kinds[0] else []), variants=others)
            for name in kinds
        }
    fabric = make_fabric(num_nodes, devices, sharded_modules=layers, **strategy_kwargs)
    return _parity(fabric, kind, **options)


def _parity(
    fabric: Any,
    kind: str,
    steps: int,
    accumulate: int,
    clip: str | None,
    setup_together: bool,
    bugs: list[str],
    variants: dict[str, Any] | None = None,
    gradients: bool = False,
) -> dict[str, Any]:
    variants = variants or {}
    sampler = fabric.strategy.distributed_sampler_kwargs
    num_rows = MICRO_BATCH * accumulate * sampler["num_replicas"]
    inputs, targets = batch(num_rows)
    full_batch = train_one_process(kind, inputs, targets, steps, clip)
    # the same rows as accumulated micro-batches, in the order the data-parallel ranks hold them
    micro_batches = [
        rows[start : start + MICRO_BATCH]
        for rank in range(sampler["num_replicas"])
        for rows in [sampler_rows(num_rows, sampler["num_replicas"], rank)]
        for start in range(0, len(rows), MICRO_BATCH)
    ]
    accumulated = train_one_process(kind, inputs, targets, steps, clip, micro_batches)
    reversed_order = train_one_process(kind, inputs, targets, steps, clip, micro_batches[::-1])
    floors = [distance(accumulated, full_batch), distance(reversed_order, full_batch)]
    options = (kind, inputs, targets, steps, accumulate, clip, setup_together)
    ours = _train_sharded(fabric, *options, bug=None, gradients=gradients)
    others = {
        label: _train_sharded(other, *options, bug=None, gradients=gradients) for label, other in variants.items()
    }
    facts = {
        "floor": {what: max(floor[what] for floor in floors) for what in floors[0]},
        "ours": distance(ours, full_batch),
        "bugs": {bug: distance(_train_sharded(fabric, *options, bug=bug), full_batch) for bug in bugs},
        "variants": {label: distance(trained, full_batch) for label, trained in others.items()},
        "sampler": sampler,
        "batches": ours.batches,
        "forwards_per_micro_batch": ours.forwards_per_micro_batch,
        "use_cache": ours.use_cache,
        "resharded_after_forward": ours.resharded_after_forward,
    }
    if gradients:
        controls = {
            label: _train_sharded(fabric, *options, bug=None, control=control).gradients
            for label, control in GRADIENT_CONTROLS[kind].items()
        }
        exact, one_process = _gradient_references(kind, inputs, targets)
        facts["gradients"] = {
            "one_process": gradient_distance(one_process, exact),
            "ours": gradient_distance(ours.gradients, exact),
            "variants": {label: gradient_distance(trained.gradients, exact) for label, trained in others.items()},
            "controls": {label: gradient_distance(planted, exact) for label, planted in controls.items()},
        }
    return facts


def _gradient_references(
    kind: str, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The first step's gradients in one process, float64 and float32: computed on rank 0, sent to the others."""
    import torch.distributed as dist

    references = [None]
    if dist.get_rank() == 0:
        references = [
            tuple(first_step_gradients(kind, inputs, targets, dtype) for dtype in (torch.float64, torch.float32))
        ]
    dist.broadcast_object_list(references, src=0)
    return references[0]
