"""torchtitan's own training recipe for one device, written out from its sources (pytorch/torchtitan @ b5bcd76,
2026-08-21): the baseline ``gpu_throughput.py`` measures this package against.

- activation checkpointing: ``SelectiveAC`` (``torchtitan/distributed/activation_checkpoint.py``): save the outputs
  of the partitioner's compute-intensive ops, SDPA, ``max``, ``linear``, reduce-scatter and all-to-all, except every
  second ``mm``/``linear`` (counted separately in forward and recompute), which is recomputed; CUDA-to-CPU copies are
  saved; ``checkpoint_wrapper(preserve_rng_state=True, determinism_check="default", early_stop=False)``; dynamo's LRU
  cache off;
- compile: ``transformer_block.compile(fullgraph=True)`` per block after AC (``torchtitan/distributed/compile.py``),
  with ``capture_scalar_outputs`` and ``skip_fwd_side_effects_in_bwd_under_checkpoint``;
- optimizer: ``AdamW(fused=True)`` (``torchtitan/components/optimizer/optimizer.py``: ``implementation="fused"``).
"""

from __future__ import annotations

from typing import Any


def save_ops() -> set:
    """The ops whose outputs torchtitan's selective AC saves (``_get_default_save_ops``), those this torch has."""
    import torch
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    aten = torch.ops.aten
    for name in (
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "max",
        "linear",
        "topk",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    for optional in ("inductor_compiled_code", "flex_attention"):
        if hasattr(torch._higher_order_ops, optional):
            ops.add(getattr(torch._higher_order_ops, optional))
    ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    ops.add(torch.ops._c10d_functional.all_to_all_single.default)
    return ops


def selective_policy_contexts() -> tuple[Any, Any]:
    """A fresh pair of contexts with torchtitan's policy (its ``_get_custom_policy``, no forced-recompute shapes)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = save_ops()
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            func == torch.ops.aten._to_copy.default
            and "cuda" in str(args[0].device)
            and str(kwargs.get("device")) == "cpu"
        ):
            return CheckpointPolicy.MUST_SAVE
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in mm_ops:
            counts[mode] += 1
        if func in saved:
            if func in mm_ops and counts[mode] % 2 == 0:  # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def wrap_block(block: Any) -> Any:
    """``block`` under torchtitan's selective AC."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(
        block,
        context_fn=selective_policy_contexts,
        preserve_rng_state=True,
        determinism_check="default",
        early_stop=False,
    )


def set_compile_config() -> None:
    """The dynamo settings torchtitan's ``apply_compile`` and ``ActivationCheckpointing.apply`` make."""
    import torch
    import torch._dynamo

    torch._dynamo.config.capture_scalar_outputs = True
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    torch._C._dynamo.eval_frame._set_lru_cache(False)
