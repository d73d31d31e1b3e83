"""Cross-entropy on vocabulary-sharded logits (``HybridFSDPStrategy(loss_parallel=True)``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loss_parallel(enabled: bool = True) -> Iterator[None]:
    """Compute the loss and run its backward on logits split by vocabulary, without gathering them.

    torch's ``loss_parallel()``: inside it, ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) accept the head's
    ``Shard(-1)`` DTensor logits, each rank working on its ``1/T`` of the vocabulary (a max, a sum of exponentials
    and the target's logit are all-reduced). The backward must run inside it too::

        with fabric.strategy.loss_parallel():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            fabric.backward(loss)

    The loss is a replicated DTensor: ``loss.item()`` works as usual; ``loss.full_tensor()`` gives a plain tensor to
    add to others. ``enabled=False`` (what the strategy passes without ``loss_parallel=True``) does nothing, so the
    same loop runs either way. Only class indices as targets; no label smoothing.
    """
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    with torch_loss_parallel():
        yield
