"""The levers' argument checks and activation checkpointing's recompute, in one process (no launch)."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from fabric_hsdp import HybridFSDPStrategy
from fabric_hsdp.setup.activation_checkpointing import apply_activation_checkpointing
from fabric_hsdp.setup.float8 import converts, float8_unsupported_reason
from tests.helpers.counters import OpCounter
from tests.helpers.launch import REPO_ROOT
from tests.helpers.training import batch, build, layer_class, logits_of


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"activation_checkpointing_mode": "some"}, "activation_checkpointing_mode='some') is not valid"),
        ({"activation_checkpointing_mode": 0}, "activation_checkpointing_mode=0) is not valid"),
        ({"compile": "yes"}, "compile='yes') is not valid: pass True, or a dict of torch.compile"),
        ({"float8": "blockwise"}, "float8='blockwise') is not valid: pass True, or one of ['rowwise', 'tensorwise']"),
    ],
)
def test_invalid_lever_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        HybridFSDPStrategy(**kwargs)


def test_the_levers_are_read_only():
    levers = HybridFSDPStrategy(compile=True)._levers
    with pytest.raises(dataclasses.FrozenInstanceError):
        levers.compile = False


def test_importing_the_strategy_leaves_the_planner_unimported():
    """``shard_size="auto"`` and ``planner_training`` import it when asked; a plain run never needs it."""
    code = "import sys, fabric_hsdp.strategy; print([name for name in sys.modules if 'fabric_hsdp.planning' in name])"
    printed = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == "[]"


def test_float8_is_refused_without_a_capable_gpu():
    if float8_unsupported_reason() is None:  # an SM 8.9+ GPU with torchao: accepted
        assert HybridFSDPStrategy(float8=True)._levers.float8.recipe == "rowwise"
        return
    with pytest.raises(RuntimeError, match=r"float8=True\) cannot run here: "):
        HybridFSDPStrategy(float8=True)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="float8 matmuls need an NVIDIA GPU of compute capability 8.9"):
            HybridFSDPStrategy(float8="tensorwise")


def test_float8_skips_the_output_head_and_dims_not_divisible_by_16():
    model = build("litgpt")  # n_embd 64, intermediate 96, vocab 256 (qkv 128 rows)
    vocab = {model.transformer.wte.num_embeddings}
    chosen = [name for name, module in model.named_modules() if converts(name, module, vocab)]
    assert "lm_head" not in chosen
    assert "transformer.h.0.attn.qkv" in chosen and "transformer.h.0.mlp.fc_1" in chosen
    small = torch.nn.Linear(64, 24)  # 24 % 16 != 0
    assert not converts("transformer.h.0.mlp.odd", small, vocab)


def _backward_ops(kind: str, mode) -> dict[str, int]:
    model = build(kind, seed=0)
    if mode is not None:
        layer = layer_class(kind)
        apply_activation_checkpointing(model, lambda name, module: isinstance(module, layer), mode)
    inputs, targets = batch(2)
    loss = torch.nn.functional.cross_entropy(logits_of(model, inputs).flatten(0, 1), targets.flatten())
    with OpCounter() as counter:
        loss.backward()
    return {"mm": counter.counts["mm"], "silu": counter.counts["silu"]}


@pytest.mark.parametrize("kind", ["litgpt", "hf"])
def test_activation_checkpointing_modes_recompute_what_they_say(kind):
    """Ops run in backward: without AC no forward op (``silu``) runs again; full AC reruns every matmul of both
    blocks; selective reruns the elementwise ops but no matmul (their outputs were saved); k=2 reruns one block."""
    none, full, selective, every_second = (_backward_ops(kind, mode) for mode in (None, "full", "selective", 2))
    assert none["silu"] == 0
    assert full["silu"] == selective["silu"] == 2 and every_second["silu"] == 1  # one MLP per block, two blocks
    # forward matmuls a block recomputes: q, k, v (litgpt: one qkv), o, gate, up -- not the MLP's down projection,
    # whose output backward does not need (the recompute stops early)
    per_block = 4 if kind == "litgpt" else 6
    assert full["mm"] == none["mm"] + 2 * per_block
    assert every_second["mm"] == none["mm"] + per_block
    assert selective["mm"] == none["mm"]


@pytest.mark.timeout(900)  # inductor + gcc: about a minute on 2 idle cores, several on a loaded machine
def test_compile_is_per_block_in_place_and_bounded():
    """Inductor (gcc on CPU) compiles each block in place: names unchanged, logits and gradients as eager, and the
    two identical blocks share their graph (dynamo counts one frame per block and one graph in all)."""
    import torch._dynamo

    from fabric_hsdp.setup.compile import apply_compile

    eager, compiled = build("litgpt", seed=0), build("litgpt", seed=0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    blocks = [(f"transformer.h.{i}", block) for i, block in enumerate(compiled.transformer.h)]
    assert apply_compile(compiled, blocks, True) == ["transformer.h.0", "transformer.h.1"]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    inputs, targets = batch(2)
    grads = []
    for model in (eager, compiled):
        loss = torch.nn.functional.cross_entropy(logits_of(model, inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert dict(counters["frames"]) == {"total": 2, "ok": 2} or counters["frames"]["ok"] >= 1, dict(counters["frames"])


def test_float8_conversion_swaps_the_eligible_linears(caplog):
    """torchao's emulation runs the converted model on CPU: the eligible layers are Float8Linear, the head is not.
    Without compile, and for layers this small, the user is told float8 will likely be slower than bf16."""
    from torchao.float8.float8_linear import Float8Linear

    from fabric_hsdp.setup.float8 import Float8Spec, apply_float8

    model = build("litgpt")
    with caplog.at_level("WARNING", logger="fabric_hsdp"):
        names = apply_float8(model, Float8Spec("rowwise", emulate=True), compiled=False)
    assert "without compile=True" in caplog.text
    assert "10 of 10 converted linear layers are below torchao's size thresholds" in caplog.text
    converted = sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))
    assert converted == sorted(names) and len(names) == 10  # 5 linears per block, 2 blocks; lm_head left alone
    assert not isinstance(model.lm_head, Float8Linear)
    inputs, _ = batch(2)
    assert torch.isfinite(logits_of(model, inputs)).all()


def test_selective_checkpointing_saves_float8_matmuls_and_their_scales():
    """float8 + selective AC: its matmuls (``_scaled_mm``) and amax (``max``) are saved, as torchtitan's list does;
    without them every float8 matmul was recomputed."""
    from fabric_hsdp.setup.activation_checkpointing import saved_ops

    ops = saved_ops()
    assert torch.ops.aten._scaled_mm.default in ops and torch.ops.aten.max.default in ops
    assert torch.ops.aten.mm.default in ops


def _compiled_backward_ops(mode) -> dict[str, int]:
    """``_backward_ops`` with each block compiled (AOTAutograd without inductor: the same partition, seconds)."""
    import torch._dynamo

    from fabric_hsdp.setup.compile import apply_compile

    torch._dynamo.reset()
    model = build("litgpt", seed=0)
    if mode is not None:
        apply_activation_checkpointing(model, lambda name, module: isinstance(module, layer_class("litgpt")), mode)
    blocks = [(f"transformer.h.{i}", block) for i, block in enumerate(model.transformer.h)]
    apply_compile(model, blocks, {"backend": "aot_eager"})
    inputs, targets = batch(2)
    loss = torch.nn.functional.cross_entropy(logits_of(model, inputs).flatten(0, 1), targets.flatten())
    # the profiler, not a dispatch mode: the compiled backward runs higher-order ops (run_with_rng_state) that a
    # dispatch mode must implement itself
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        loss.backward()
    names = [event.name for event in profiler.events()]
    return {"mm": names.count("aten::mm") + names.count("aten::addmm")}


@pytest.mark.timeout(300)
def test_compiled_blocks_recompute_what_their_mode_says():
    """Under compile the checkpoint is traced with the block, so selective recomputes no matmul and full only the
    block's own forward: with hooks around the compiled block both reran it whole (the selective policy never saw
    the matmuls), 8 extra matmuls here for either mode."""
    none, full, selective = (_compiled_backward_ops(mode) for mode in (None, "full", "selective"))
    assert selective["mm"] == none["mm"], (none, selective)
    assert none["mm"] < full["mm"] <= none["mm"] + 2 * 4, (none, full)  # at most qkv, proj, fc_1, fc_2 per block
