"""float8 tensorwise under FSDP: weights all-gathered in float8 with their scales computed after each optimizer step
(torchtitan's recipe), trained as the per-layer float8 path trains. torchao's emulation runs it on CPU ranks."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import launch

pytestmark = pytest.mark.slow


def float8_steps(num_nodes: int, devices: int, all_gather: bool) -> dict:
    """3 AdamW steps of the tiny LLaMA with tensorwise float8 (emulated), through the strategy's own setup."""
    from dataclasses import replace

    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from fabric_hsdp.setup.float8 import Float8Spec
    from tests.helpers.training import batch, build, layer_class, make_fabric

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    # float8 needs a capable GPU, so the strategy refuses it here: set the validated lever the way it would
    fabric.strategy._levers = replace(fabric.strategy._levers, float8=Float8Spec("tensorwise", emulate=True))
    if not all_gather:  # the per-layer path (what tensor parallelism gets): high-precision all-gather
        import fabric_hsdp.setup.pipeline as pipeline

        convert = pipeline.apply_float8
        pipeline.apply_float8 = lambda model, spec, **kwargs: convert(
            model, spec, **{**kwargs, "tensor_parallel": True}
        )
    model = fabric.setup_module(build("llama", seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    weights = [m.weight for m in model.module.modules() if type(m).__name__ == "Float8Linear"]
    losses = []
    for step in range(3):
        inputs, targets = batch(2, seed=step + fabric.global_rank)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    cast = [isinstance(w.to_local(), WeightWithDynamicFloat8CastTensor) for w in weights]
    precomputed = [getattr(w._local_tensor, "_precomputed_scale", None) is not None for w in weights]  # torchao sets it
    return {"losses": losses, "layers": len(weights), "cast": cast, "precomputed": precomputed}


def test_tensorwise_float8_gathers_in_float8_with_scales_precomputed_and_trains_as_per_layer():
    runs = {}
    for all_gather in (True, False):
        runs[all_gather] = launch(float8_steps, {"all_gather": all_gather}).check().values
    for with_gather, per_layer in zip(runs[True], runs[False], strict=True):
        assert with_gather["layers"] == 14 and all(with_gather["cast"]), with_gather  # 7 linears per block, 2 blocks
        assert all(with_gather["precomputed"]), with_gather  # the scales for the next step, after this one
        assert per_layer["layers"] == 14 and not any(per_layer["cast"]), per_layer
        torch.testing.assert_close(with_gather["losses"], per_layer["losses"], rtol=1e-5, atol=1e-6)
