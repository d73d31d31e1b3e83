"""One launch on (1, 2, 2), several strategies one after another: what tensor parallelism keeps of a model's
meaning beyond its logits -- tied weights, the state-dict layout torch's own export sees, dropout masks -- and what
sequence and loss parallelism change (saved activations, logits) and keep (checkpoints across the levers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.helpers.training import (
    batch,
    build,
    full_optimizer_state,
    full_state,
    layer_class,
    litgpt_config,
    logits_of,
    make_fabric,
    setup_training,
    train_steps,
)

LEVERS = {"sequence_parallel": True, "loss_parallel": True}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _step(fabric: Any, model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    with fabric.strategy.loss_parallel():
        logits = logits_of(model, tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        fabric.backward(loss)
    return loss.item()


def _tied(fabric: Any) -> dict[str, Any]:
    """A tied LM stays tied: one parameter for the optimizer, one value after an AdamW step."""
    facts = {}
    tokens, targets = batch(2, seed=3)
    for kind in ("hf-tied", "llama-tied"):
        reference = build(kind, seed=0)
        model = fabric.setup_module(build(kind, seed=0))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        inner = model.module
        if kind == "hf-tied":
            head, embedding = inner.lm_head, inner.model.embed_tokens
        else:
            head, embedding = inner.output, inner.tok_embeddings
        _step(fabric, model, tokens, targets)
        optimizer.step()
        facts[kind] = {
            "same_parameter": head.weight is embedding.weight,
            "placements": tuple(str(p) for p in head.weight.placements),
            "optimizer_parameters": sum(len(group["params"]) for group in optimizer.param_groups),
            "reference_parameters": len(list(reference.parameters())),
            "equal_after_step": torch.equal(_full(head.weight), _full(embedding.weight)),
        }
    return facts


def _export(fabric: Any, out: Path) -> dict[str, Any]:
    """torch's standard state-dict paths give litgpt's own [Q; K; V] rows under tensor parallelism."""
    import torch.distributed.checkpoint as dcp
    from litgpt.model import GPT
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    reference = build("litgpt", seed=0).state_dict()
    model = fabric.setup_module(build("litgpt", seed=0)).module  # without Fabric's wrapper, as torch code sees it
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    by_hand = {name: _full(tensor) for name, tensor in model.state_dict().items()}

    def unequal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
        return [name for name, tensor in expected.items() if not torch.equal(state[name].cpu(), tensor)]

    facts: dict[str, Any] = {"full_state_dict": unequal(full, reference), "state_dict": unequal(by_hand, reference)}
    # litgpt itself loads the export and computes the same logits
    loaded = GPT(litgpt_config())
    loaded.load_state_dict({name: tensor.cpu() for name, tensor in full.items()})
    tokens, _ = batch(2)
    facts["litgpt_logits_equal"] = torch.equal(logits_of(loaded, tokens), logits_of(build("litgpt", seed=0), tokens))
    # a user's own DCP save of get_model_state_dict(model) holds the model's layout too, and loads back
    dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "user-dcp"))
    if dist.get_rank() == 0:
        dcp_to_torch_save(out / "user-dcp", out / "user-dcp.pt")
        facts["dcp"] = unequal(torch.load(out / "user-dcp.pt", weights_only=True), reference)
    other = build("litgpt", seed=5).state_dict()
    # set_model_state_dict turns the given full tensors into DTensors in place: hand it a copy
    given = {name: tensor.clone() for name, tensor in other.items()}
    set_model_state_dict(model, given, options=StateDictOptions(full_state_dict=True))
    facts["set_full_state_dict"] = unequal(full_state(model), other)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=str(out / "user-dcp"))
    set_model_state_dict(model, state)
    facts["dcp_round_trip"] = unequal(full_state(model), reference)
    return facts


class _MaskRecorder:
    """Records which elements every ``F.dropout`` call zeroed, in call order."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []
        self.original = F.dropout

    def __enter__(self) -> _MaskRecorder:
        def recording(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
            output = self.original(input, p, training, inplace)
            if training and p > 0:
                self.masks.append((_local(output) == 0).detach().clone())
            return output

        F.dropout = recording
        return self

    def __exit__(self, *exc: Any) -> None:
        F.dropout = self.original


def _dropout(fabric: Any, label: str) -> dict[str, Any]:
    """One training step of the example model with dropout 0.5, ranks seeded per rank before setup."""
    tokens, targets = batch(2, seed=4)
    model = build("llama-dropout", seed=0)
    torch.manual_seed(1000 + fabric.global_rank)  # what users write: seed_everything(seed + rank)
    model = fabric.setup_module(model)
    with _MaskRecorder() as recorder:
        _step(fabric, model, tokens, targets)
    gradients = {name: _full(param.grad).clone() for name, param in model.named_parameters()}
    masks: list[list[torch.Tensor]] = [[] for _ in range(fabric.world_size)]
    dist.all_gather_object(masks, recorder.masks)
    # tensor-parallel peers: ranks (0, 1) and (2, 3)
    return {
        "calls": len(recorder.masks),
        "peers_equal": [torch.equal(masks[0][i], masks[1][i]) for i in range(len(masks[0]))],
        "peers_equal_2_3": [torch.equal(masks[2][i], masks[3][i]) for i in range(len(masks[2]))],
        "gradients": gradients,
        "label": label,
    }


def _activation_bytes(fabric: Any, kind: str) -> dict[str, int]:
    """Activation bytes this rank saves for backward in one forward + loss (each storage once, weights not counted),
    and the logits' bytes."""
    tokens, targets = batch(2, seed=5)
    model = fabric.setup_module(build(kind, seed=0))
    storages: dict[int, int] = {}
    loss_storages: dict[int, int] = {}
    record = storages

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        local = _local(tensor)
        if isinstance(local, AsyncCollectiveTensor):  # the result of a collective still in flight
            local = local.trigger_wait()
        weights = {_local(param).untyped_storage().data_ptr() for param in model.parameters()}  # FSDP's unsharded
        if tensor.is_leaf or local.untyped_storage().data_ptr() in weights:  # inputs, buffers, weights
            return tensor
        record[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return tensor

    with fabric.strategy.loss_parallel():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = logits_of(model, tokens)
            record = loss_storages
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        fabric.backward(loss)
    return {
        "model": sum(storages.values()),
        "loss": sum(size for ptr, size in loss_storages.items() if ptr not in storages),
        "logits": _local(logits).untyped_storage().nbytes(),
    }


def _checkpoints_across_levers(plain: Any, levers: Any, out: Path) -> dict[str, Any]:
    """Saved with plain TP, loaded with sequence + loss parallelism, and the reverse: exact."""
    facts = {}
    for kind in ("litgpt", "hf", "llama"):
        for name, saver, loader in (("plain-to-levers", plain, levers), ("levers-to-plain", levers, plain)):
            model, optimizer, scheduler = setup_training(saver, kind, empty_init=False, seed=0)
            train_steps(saver, model, optimizer, scheduler, steps=1)
            expected = full_state(model), full_optimizer_state(model.module, optimizer.optimizer)
            path = out / f"{kind}-{name}"
            saver.save(path, {"model": model, "optimizer": optimizer})
            model, optimizer, scheduler = setup_training(loader, kind, empty_init=True, seed=9)
            loader.load(path, {"model": model, "optimizer": optimizer})
            actual = full_state(model), full_optimizer_state(model.module, optimizer.optimizer)
            facts[f"{kind}-{name}"] = {
                "model": [key for key, value in expected[0].items() if not torch.equal(actual[0][key], value)],
                "optimizer": [
                    f"{fqn}.{key}"
                    for fqn, entries in expected[1].items()
                    for key, value in entries.items()
                    if not torch.equal(actual[1][fqn][key], value)
                ],
                "compared": len(expected[0]),
            }
    return facts


def levers(num_nodes: int, devices: int, out: str) -> dict[str, Any]:
    out_dir = Path(out)
    block = {layer_class("llama")}
    plain = make_fabric(num_nodes, devices, tensor_parallel_size=2)
    facts: dict[str, Any] = {"tied": _tied(plain), "export": _export(plain, out_dir)}
    with_levers = make_fabric(num_nodes, devices, tensor_parallel_size=2, **LEVERS)
    facts["tied_levers"] = _tied(with_levers)
    facts["checkpoints"] = _checkpoints_across_levers(plain, with_levers, out_dir)
    facts["memory"] = {
        label: {kind: _activation_bytes(fabric, kind) for kind in ("llama", "hf", "litgpt")}
        for label, fabric in (("tp", plain), ("levers", with_levers))
    }
    dropout = {"tp": _dropout(plain, "tp"), "sp": _dropout(with_levers, "sp")}
    for label, options in (("tp-ac", {}), ("sp-ac", LEVERS)):
        fabric = make_fabric(num_nodes, devices, tensor_parallel_size=2, activation_checkpointing=block, **options)
        dropout[label] = _dropout(fabric, label)
    gradients = {label: facts.pop("gradients") for label, facts in dropout.items()}
    dropout["recompute_unequal"] = {
        label: [name for name, grad in gradients[label].items() if not torch.equal(grad, gradients[base][name])]
        for label, base in (("tp-ac", "tp"), ("sp-ac", "sp"))
    }
    facts["dropout"] = dropout
    return facts
