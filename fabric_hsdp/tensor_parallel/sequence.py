"""Sequence parallelism and loss parallelism: how they change a tensor-parallel plan.

``sequence_parallel=True`` (torchtitan's Llama plan, Megatron's sequence parallelism): between the layers, where plain
tensor parallelism keeps the residual stream whole on every rank, each rank keeps ``1/T`` of the sequence.

* row-wise layers (attention out, MLP down) end in a reduce-scatter to ``Shard(1)`` instead of an all-reduce;
* norms with weights on the residual stream run on the sequence shard (``SequenceParallel``); a norm in front of
  column-wise layers then all-gathers the normalised sequence once (:class:`~.styles.SequenceParallelNorm`), so
  attention and MLP see the whole sequence as before; a norm after a row-wise layer (litgpt's ``post_*_norm``) keeps
  its shard;
* the embedding (split by vocabulary rows) ends in a reduce-scatter to ``Shard(1)``. transformers models read the
  sequence length from the embedding's output before the first layer (positions, masks), so there the embedding's
  output stays whole and the first layer takes its part (:class:`~.styles.SplitSequence`);
* the output head takes the gathered sequence from the final norm.

Activations between the layers, and what norms save for backward, drop by ``T``. The sequence length must divide by
``T``.

``loss_parallel=True``: the output head keeps its logits split by vocabulary (``Shard(-1)``, a DTensor) instead of
gathering them, and cross-entropy runs on the shards inside torch's ``loss_parallel()`` context
(:func:`fabric_hsdp.tensor_parallel.loss_parallel`): each rank holds ``1/T`` of the logits and of their gradient.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from fabric_hsdp.tensor_parallel.styles import SequenceParallelNorm, SplitSequence

Assignment = tuple[str, nn.Module, Any]  # (module name, module, style)

# litgpt's norms on the output of attention / MLP (Gemma 2 style): they stay on the sequence shard
_POST_NORMS = ("post_attention_norm", "post_mlp_norm")


def _is_norm(module: nn.Module) -> bool:
    has_weights = any(True for _ in module.parameters(recurse=False))
    return has_weights and (isinstance(module, nn.LayerNorm | nn.RMSNorm) or "Norm" in type(module).__name__)


def _is_gathered_head(module: nn.Module, style: Any) -> bool:
    return (
        isinstance(module, nn.Linear)
        and isinstance(style, ColwiseParallel)
        and isinstance(style.output_layouts[0], Replicate)
    )


def with_levers(
    model: nn.Module,
    assignments: list[Assignment],
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    split_embedding_output: bool,
) -> list[Assignment]:
    """``assignments`` changed for sequence and loss parallelism (see module docstring), norms and splits added.

    ``split_embedding_output``: the embedding itself ends in ``Shard(1)``; otherwise the first layer of the model's
    first ``nn.ModuleList`` splits its input.

    Raises:
        ValueError: ``loss_parallel`` without a column-wise output head in the plan, or ``sequence_parallel`` without
            row-wise layers (nothing to shard the sequence after).
    """
    if not (sequence_parallel or loss_parallel):
        return assignments
    changed: list[Assignment] = []
    heads, rowwise = [], []
    for name, module, style in assignments:
        if _is_gathered_head(module, style):
            heads.append(name)
            if loss_parallel:
                style = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        elif sequence_parallel and isinstance(style, RowwiseParallel):
            if isinstance(module, nn.Embedding):
                if split_embedding_output:
                    style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
            else:
                rowwise.append(name)
                style = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Shard(1))
        changed.append((name, module, style))
    if loss_parallel and not heads:
        raise ValueError(
            "HybridFSDPStrategy(loss_parallel=True) keeps the output head's logits split by vocabulary, but the"
            ' tensor-parallel plan has no column-wise output head with gathered logits (e.g. "lm_head":'
            ' "colwise_gather_output"). Add the head to the plan, or drop loss_parallel.'
        )
    if not sequence_parallel:
        return changed
    if not rowwise:
        raise ValueError(
            "HybridFSDPStrategy(sequence_parallel=True) shards the sequence after each row-wise layer, but the"
            " tensor-parallel plan has none. Use a Megatron-style plan (column-wise then row-wise layers), or drop"
            " sequence_parallel."
        )
    return changed + _norms(model, changed) + _first_layer_split(model, changed, split_embedding_output)


def _norms(model: nn.Module, assignments: list[Assignment]) -> list[Assignment]:
    """Every norm with weights on the residual stream: not inside a planned module, not beside a row-wise layer (the
    query/key norms inside attention work on head shards)."""
    planned = {name for name, _, _ in assignments}
    split_parents = {
        name.rpartition(".")[0]
        for name, module, style in assignments
        if isinstance(module, nn.Linear) and isinstance(style, RowwiseParallel)
    }
    norms = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        inside_planned = any(name.startswith(f"{other}.") for other in planned)
        if not name or not _is_norm(module) or name in planned or parent in split_parents or inside_planned:
            continue
        style = SequenceParallel(use_local_output=True) if name.endswith(_POST_NORMS) else SequenceParallelNorm()
        norms.append((name, module, style))
    return norms


def _first_layer_split(model: nn.Module, assignments: list[Assignment], embedding_split: bool) -> list[Assignment]:
    embedding_splits = any(isinstance(module, nn.Embedding) for _, module, _ in assignments)
    if embedding_split and embedding_splits:
        return []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return [(f"{name}.0", module[0], SplitSequence())]
    raise ValueError(
        f"HybridFSDPStrategy(sequence_parallel=True) found no layers (an nn.ModuleList) in {type(model).__name__} to"
        ' start the sequence split at. Split the embedding row-wise in the plan ("embedding_rowwise").'
    )
