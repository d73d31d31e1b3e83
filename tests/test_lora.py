"""LoRA fine-tuning across nodes (#33): peft around transformers' Llama and litgpt's ``lora.GPT`` on HSDP 2 x 2.

Built on the meta device, the base raw-loaded strictly from the base model's own checkpoint (no key map), the adapters
at their library's init (the model at step 0 is the base model), 3 steps equal to one process started from the same
weights with every base tensor bit-identical after, an adapter-only save (``fabric.save(filter=)``, sharded and full)
resumed exactly on 1 x 2, and the adapters exported in each library's format and loaded there.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import launch
from tests.helpers.parity import beyond_noise
from tests.helpers.training import batch, finetune, litgpt_config, logits_of, tiny_hf_llama, tiny_litgpt

pytestmark = pytest.mark.slow

LEARNING_RATE = 1e-2
STEPS = 3
GLOBAL_BATCH = 8
# "it trained": the global loss falls by more than this fraction of itself in STEPS steps. Measured here: 1.04 %
# (peft) and 0.71 % (litgpt); at a learning rate 1000x too small (plant 46j3) about 0.001 %, which the old judge
# (first loss != last) let pass.
TRAINED_MARGIN = 2e-3
PEFT_TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama with LoRA adapters (r=4) as a new user builds it: peft's ``get_peft_model`` or litgpt's
    ``lora.GPT`` with ``mark_only_lora_as_trainable``."""
    if kind == "peft":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(tiny_hf_llama(seed), LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TARGETS))
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    base = litgpt_config()
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__ if name not in ("rope_n_elem",)}
    config = Config(**fields, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_projection=True)
    torch.manual_seed(seed)
    model = GPT(config)
    mark_only_lora_as_trainable(model)
    return model


def base_checkpoint(kind: str, directory: Path) -> Path:
    """The base model saved by its library's own saver: ``save_pretrained`` (safetensors) or litgpt's
    ``lit_model.pth`` (``torch.save`` of the state dict)."""
    if kind == "peft":
        tiny_hf_llama(seed=5).save_pretrained(directory / "hf")
        return directory / "hf"
    (directory / "litgpt").mkdir()
    torch.save(tiny_litgpt(seed=5).state_dict(), directory / "litgpt" / "lit_model.pth")
    return directory / "litgpt" / "lit_model.pth"


def base_model(kind: str, path: Path) -> torch.nn.Module:
    """The base model, loaded by its library from ``path``."""
    if kind == "peft":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(path)
    model = tiny_litgpt()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


def lora_from_base(kind: str, path: Path) -> torch.nn.Module:
    """The LoRA model filled from the base checkpoint the library's own way: peft wraps the loaded base model, litgpt's
    ``lora.GPT`` maps the base names when it loads a state dict."""
    if kind == "peft":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(base_model(kind, path), LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TARGETS))
    model = lora_model(kind)
    model.load_state_dict(torch.load(path, weights_only=True), strict=False)
    return model


def _steps(model: Any, optimizer: Any, rows: slice, backward: Any) -> list[float]:
    inputs, targets = batch(GLOBAL_BATCH, seed=7)
    losses = []
    for _ in range(STEPS):
        logits = logits_of(model, inputs[rows])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[rows].flatten())
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _tensor_bytes(path: Path) -> int:
    """The bytes of the tensors a sharded checkpoint stores (its files add a fixed overhead: metadata, headers)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sum(
        entry.size.numel() * entry.properties.dtype.itemsize
        for entry in metadata.values()
        if isinstance(entry, TensorStorageMetadata)
    )


def _optimizer_state(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model.module, optimizer, options=options)["state"]
    return {f"{name}.{key}": value.cpu().clone() for name, entries in state.items() for key, value in entries.items()}


def _is_adapter(name: str, value: object) -> bool:
    return "lora_" in name


def train_lora(num_nodes: int, devices: int, kind: str, base: str, out: str, state_dict_type: str) -> dict:
    """Meta init, strict raw load of the base, 3 steps; an adapter-only save and a whole one (``adapter``, ``full``;
    ``.pth`` files with ``state_dict_type="full"``) and, sharded, the library's export."""
    from fabric_hsdp.adapters import export_litgpt_adapter, export_merged, export_peft_adapter
    from tests.helpers.training import full_state, make_fabric

    fabric = make_fabric(num_nodes, devices, state_dict_type=state_dict_type)
    with fabric.init_module(empty_init=True):
        model = lora_model(kind)
    model = fabric.setup_module(model)
    adapters_at_init = full_state(model)  # before the load: what materialisation gave
    fabric.load_raw(base, model)  # strict: every base tensor found, or it raises
    initial = full_state(model)
    inputs, _ = batch(GLOBAL_BATCH, seed=7)
    with torch.no_grad():
        logits_at_start = logits_of(model, inputs).detach().clone()
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    data = fabric.strategy.distributed_sampler_kwargs
    per_rank = GLOBAL_BATCH // data["num_replicas"]
    rows = slice(per_rank * data["rank"], per_rank * (data["rank"] + 1))
    grads_of_frozen: list[str] = []

    def backward(loss: torch.Tensor) -> None:
        fabric.backward(loss)
        frozen = [(n, p) for n, p in model.module.named_parameters() if not p.requires_grad]
        grads_of_frozen.extend(n for n, p in frozen if p.grad is not None)

    losses = _steps(model, optimizer, rows, backward)
    trained = full_state(model)
    optimizer_state = _optimizer_state(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": STEPS}
    out = Path(out)
    suffix = ".pth" if state_dict_type == "full" else ""
    fabric.save(out / f"adapter{suffix}", state, filter={"model": _is_adapter})
    fabric.save(out / f"full{suffix}", state)
    if kind == "peft" and not suffix:
        export_peft_adapter(model, out / "peft-adapter")
        export_merged(model, out / "merged")
    elif not suffix:
        export_litgpt_adapter(model, out / "lit_model.pth.lora")
        export_merged(model, out / "merged.pth")
    with torch.no_grad():
        trained_logits = logits_of(model, inputs).detach().clone()
    return {
        "adapters_at_init": {k: v for k, v in adapters_at_init.items() if "lora_" in k},
        "initial": initial,
        "logits_at_start": logits_at_start,
        "losses": losses,
        "trained": trained,
        "optimizer_state": optimizer_state,
        "grads_of_frozen": grads_of_frozen,
        "trained_logits": trained_logits,
        "trainable": sorted(n for n, p in model.module.named_parameters() if p.requires_grad),
    }


def resume_lora(num_nodes: int, devices: int, kind: str, base: str, out: str) -> dict:
    """On another node count, rank 0 reading consolidated files: the base raw-loaded, then each adapter-only
    checkpoint with ``strict=False``; and the whole model's full checkpoint (its wrapped names) strictly."""
    from tests.helpers.training import full_state, make_fabric

    fabric = make_fabric(num_nodes, devices, load_mode="rank0")  # the other reading path (2 x 2 read in slices)
    resumed = {}
    for name in ("adapter", "adapter.pth", "full.pth"):
        with fabric.init_module(empty_init=True):
            model = lora_model(kind, seed=3)  # other adapter init: all of it must come from the checkpoint
        model = fabric.setup_module(model)
        fabric.load_raw(base, model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(Path(out) / name, state, strict=name == "full.pth")
        resumed[name] = {
            "state": full_state(model),
            "optimizer_state": _optimizer_state(model, optimizer),
            "step": state["step"],
        }
    return resumed


def one_process(
    kind: str, initial: dict[str, torch.Tensor], micro_batches: list[slice] | None = None
) -> tuple[torch.nn.Module, list[float]]:
    """The same 3 steps in one process on the whole batch, from the sharded run's weights at step 0.
    ``micro_batches``: the batch's rows as these micro-batches, accumulated (the same mathematics, another rounding)."""
    model = lora_model(kind)
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    if micro_batches is None:
        return model, _steps(model, optimizer, slice(0, GLOBAL_BATCH), lambda loss: loss.backward())
    inputs, targets = batch(GLOBAL_BATCH, seed=7)
    losses = []
    for _ in range(STEPS):
        step_loss = 0.0
        for rows in micro_batches:
            logits = logits_of(model, inputs[rows])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[rows].flatten()) / len(micro_batches)
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return model, losses


def parity_with_one_process(kind: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The sharded run (its global batch's losses, its adapters) against one process on the whole batch, and the
    noise floor: the same process with the data-parallel ranks' rows as accumulated micro-batches, in their order and
    reversed (:mod:`tests.helpers.parity`'s rule)."""
    from tests.helpers.parity import Trained, distance

    initial = ranks[0]["initial"]
    adapters = [name for name in initial if "lora_" in name]

    def trained(model: torch.nn.Module, losses: list[float]) -> Trained:
        state = model.state_dict()
        return Trained(losses, [], {name: state[name].detach().clone() for name in adapters})

    full_batch = trained(*one_process(kind, initial))
    per_rank = GLOBAL_BATCH // len(ranks)
    micro_batches = [slice(per_rank * rank, per_rank * (rank + 1)) for rank in range(len(ranks))]
    floors = [
        distance(trained(*one_process(kind, initial, order)), full_batch)
        for order in (micro_batches, micro_batches[::-1])
    ]
    global_losses = [sum(rank["losses"][step] for rank in ranks) / len(ranks) for step in range(STEPS)]
    ours = Trained(global_losses, [], {name: ranks[0]["trained"][name] for name in adapters})
    return {
        "ours": distance(ours, full_batch),
        "floor": {what: max(floor[what] for floor in floors) for what in floors[0]},
        "losses": global_losses,
        "one_process_losses": full_batch.losses,
    }


class _RunsByKind(dict):
    """Each kind's runs made on its first use, so that tests of one kind (the range's core tests: peft) launch only
    its own three runs."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, kind: str) -> dict[str, Any]:
        self[kind] = self._make(kind)
        return self[kind]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def make(kind: str) -> dict[str, Any]:
        directory = tmp_path_factory.mktemp(kind)
        base = base_checkpoint(kind, directory)
        args = {"kind": kind, "base": str(base), "out": str(directory)}
        trained = launch(train_lora, {**args, "state_dict_type": "sharded"}, timeout=300)
        trained_full = launch(train_lora, {**args, "state_dict_type": "full"}, timeout=300)
        resumed = launch(resume_lora, args, num_nodes=1, ranks_per_node=2, timeout=300)
        return {
            "base": base,
            "out": directory,
            "ranks": trained.check().values,
            "ranks_full": trained_full.check().values,
            "resumed": resumed.check().values,
        }

    return _RunsByKind(make)


@pytest.mark.timeout(2000)  # per kind: three launches of up to 300 s each
@pytest.mark.parametrize("kind", ["peft", "litgpt"])
def test_lora_base_loads_strict_and_trains_like_one_process(lora_runs, kind):
    run = lora_runs[kind]
    ranks = run["ranks"]
    facts = ranks[0]
    base = base_model(kind, run["base"])
    base_state = base.state_dict()
    adapters = [name for name in facts["initial"] if "lora_" in name]
    assert adapters and facts["trainable"] == sorted(adapters)
    # strict: every base tensor filled from the checkpoint under the wrappers' names, the adapters left at their init
    initial_base = {name: value for name, value in facts["initial"].items() if "lora_" not in name}
    assert len(initial_base) == len(base_state)
    expected_base = lora_from_base(kind, run["base"]).state_dict()
    assert all(torch.equal(value, expected_base[name]) for name, value in initial_base.items())
    for name, value in facts["adapters_at_init"].items():
        if "lora_B" in name:
            assert not value.any(), f"{name} is not zero at init (max {value.abs().max().item():.3g})"
        else:
            assert value.abs().max() > 0, name  # A drawn, as the library draws it
    # step 0 is the base model
    inputs, _ = batch(GLOBAL_BATCH, seed=7)
    with torch.no_grad():
        expected_logits = logits_of(base, inputs)
    start_difference = (facts["logits_at_start"] - expected_logits).abs().max().item()
    print(f"{kind}: max |logits at step 0 - base logits| = {start_difference:.3g}")
    assert start_difference <= 1e-5

    reference, _ = one_process(kind, facts["initial"])
    reference_state = reference.state_dict()
    # parity by the suite's noise-floor rule (tests/helpers/parity.py) on the global batch's losses and the adapters.
    # Measured here (torch 2.13 CPU), ours / floor: peft parameters 1.1e-6 / 8.0e-7, litgpt 4.1e-7 / 5.5e-7, losses
    # 6e-8 / 6e-8 and 1.2e-7 / 1.2e-7. A learning rate 0.0011 % high in the sharded run (plant 46j2) passed the fixed
    # 1e-5 on the adapters' values.
    parity = parity_with_one_process(kind, ranks)
    print(f"{kind}: {parity}")
    assert not beyond_noise(parity["ours"], parity["floor"]), parity
    # it trained: the global loss fell by more than TRAINED_MARGIN of itself in 3 steps
    fell = parity["losses"][0] - parity["losses"][-1]
    assert fell > TRAINED_MARGIN * parity["losses"][0], parity
    # every base tensor bit-identical after training, on every rank; no gradient for any of them
    for rank in ranks:
        assert rank["grads_of_frozen"] == []
        frozen = {k: v for k, v in rank["trained"].items() if k not in adapters}
        assert len(frozen) == len(base_state)
        assert all(torch.equal(value, reference_state[name]) for name, value in frozen.items())
        assert all(torch.equal(value, facts["initial"][name]) for name, value in frozen.items())
    assert {key.rsplit(".", 1)[0] for key in facts["optimizer_state"] if not key.endswith(".step")} == set(adapters)


@pytest.mark.timeout(2000)
@pytest.mark.parametrize("kind", ["peft", "litgpt"])
def test_lora_adapter_only_checkpoint_is_small_and_resumes_on_another_node_count(lora_runs, kind):
    from torch.distributed.checkpoint import FileSystemReader

    run = lora_runs[kind]
    facts = run["ranks"][0]
    adapters = {name for name in facts["initial"] if "lora_" in name}
    stored = set(FileSystemReader(str(run["out"] / "adapter")).read_metadata().state_dict_metadata)
    assert {key.removeprefix("model.") for key in stored if key.startswith("model.")} == adapters
    assert all(key.split(".", 1)[1].split(".", 1)[1].rsplit(".", 1)[0] in adapters for key in stored if "state." in key)
    full_file = torch.load(run["out"] / "adapter.pth", weights_only=True)
    assert set(full_file["model"]) == adapters and full_file["step"] == STEPS
    assert set(full_file["optimizer"]["state"]) == adapters
    sizes = {name: _bytes(run["out"] / name) for name in ("adapter", "full", "adapter.pth", "full.pth")}
    tensors = {name: _tensor_bytes(run["out"] / name) for name in ("adapter", "full")}
    ratio = tensors["adapter"] / tensors["full"]
    print(f"{kind}: file bytes {sizes}; tensor bytes {tensors}; adapter-only / full tensor bytes = {ratio:.3f}")
    assert ratio < 0.15 and sizes["adapter"] < sizes["full"] / 2 and sizes["adapter.pth"] < sizes["full.pth"] / 2
    for rank in run["resumed"]:
        for name, resumed in rank.items():
            facts = run["ranks_full"][0] if name.endswith(".pth") else run["ranks"][0]
            assert resumed["step"] == STEPS
            assert resumed["state"].keys() == facts["trained"].keys()
            unequal = [k for k, v in resumed["state"].items() if not torch.equal(v, facts["trained"][k])]
            assert unequal == [], f"{name}: {unequal[:3]}"
            assert resumed["optimizer_state"].keys() == facts["optimizer_state"].keys()
            assert all(torch.equal(v, facts["optimizer_state"][k]) for k, v in resumed["optimizer_state"].items())


@pytest.mark.timeout(2000)
def test_peft_export_loads_in_peft_and_gives_the_trained_logits(lora_runs):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    run = lora_runs["peft"]
    directory = run["out"] / "peft-adapter"
    assert (directory / "adapter_config.json").is_file()
    saved = load_file(directory / "adapter_model.safetensors")
    assert set(saved) == set(get_peft_model_state_dict(lora_model("peft")))  # keys as peft itself saves them
    model = PeftModel.from_pretrained(base_model("peft", run["base"]), directory)
    inputs, _ = batch(GLOBAL_BATCH, seed=7)
    with torch.no_grad():
        logits = logits_of(model, inputs)
    difference = (logits - run["ranks"][0]["trained_logits"]).abs().max().item()
    print(f"peft export: max |logits - trained logits| = {difference:.3g}")
    assert difference <= 1e-5
    assert (logits - logits_of(base_model("peft", run["base"]), inputs)).abs().max() > 1e-3  # the adapters count


@pytest.mark.timeout(2000)
def test_litgpt_adapter_file_loads_in_litgpt_and_gives_the_trained_logits(lora_runs):
    from litgpt.lora import lora_filter

    run = lora_runs["litgpt"]
    saved = torch.load(run["out"] / "lit_model.pth.lora", weights_only=True)
    reference = lora_model("litgpt")
    assert set(saved) == {"model"}
    assert set(saved["model"]) == {k for k, v in reference.state_dict().items() if lora_filter(k, v)}
    reference.load_state_dict(torch.load(run["base"], weights_only=True), strict=False)  # litgpt's own renaming
    reference.load_state_dict(saved["model"], strict=False)
    inputs, _ = batch(GLOBAL_BATCH, seed=7)
    with torch.no_grad():
        difference = (logits_of(reference, inputs) - run["ranks"][0]["trained_logits"]).abs().max().item()
    print(f"litgpt adapter file: max |logits - trained logits| = {difference:.3g}")
    assert difference <= 1e-5


@pytest.mark.timeout(2000)
@pytest.mark.parametrize("kind", ["peft", "litgpt"])
def test_merged_export_equals_the_librarys_own_merge_and_loads_as_the_base_model(lora_runs, kind):
    run = lora_runs[kind]
    inputs, _ = batch(GLOBAL_BATCH, seed=7)
    if kind == "peft":
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(run["out"] / "merged")  # a plain transformers model
        library = PeftModel.from_pretrained(base_model(kind, run["base"]), run["out"] / "peft-adapter")
        expected = library.merge_and_unload().state_dict()
    else:
        from litgpt.lora import merge_lora_weights

        merged = tiny_litgpt()
        merged.load_state_dict(torch.load(run["out"] / "merged.pth", weights_only=True))  # strict: litgpt's GPT
        library = lora_from_base(kind, run["base"])
        library.load_state_dict(torch.load(run["out"] / "lit_model.pth.lora", weights_only=True)["model"], strict=False)
        merge_lora_weights(library)  # litgpt's own merge, then its base names as its merge_lora script saves them
        expected = {k.replace(".linear.", "."): v for k, v in library.state_dict().items() if "lora_" not in k}
    state = merged.state_dict()
    assert state.keys() == expected.keys()
    unequal = [name for name, value in state.items() if not torch.equal(value, expected[name])]
    assert unequal == [], unequal[:3]  # bit for bit what the library's merge gives
    with torch.no_grad():
        difference = (logits_of(merged, inputs) - run["ranks"][0]["trained_logits"]).abs().max().item()
    print(f"{kind} merged export: max |logits - trained logits| = {difference:.3g}")
    assert difference <= 1e-5


def test_lora_is_refused_under_tensor_parallelism_with_the_reason():
    from fabric_hsdp.adapters.init import refuse_unsupported_adapters

    with pytest.raises(ValueError, match=r"does not support LoRA models yet .* Use tensor_parallel_size=1"):
        refuse_unsupported_adapters(lora_model("peft"), tensor_parallel=True)
    refuse_unsupported_adapters(lora_model("peft"), tensor_parallel=False)


def test_peft_inits_that_need_the_base_weights_are_refused_on_meta():
    from peft import LoraConfig, get_peft_model

    from fabric_hsdp.adapters.init import refuse_unsupported_adapters
    from fabric_hsdp.setup.materialize import parameters_on_meta

    with parameters_on_meta():
        model = get_peft_model(tiny_hf_llama(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="olora"))
    with pytest.raises(ValueError, match=r"init_lora_weights='olora'.*empty_init=False"):
        refuse_unsupported_adapters(model, tensor_parallel=False)


def test_base_names_of_peft_and_litgpt_models():
    from fabric_hsdp.adapters import base_names

    names = base_names(lora_model("peft"))
    assert names["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert names["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] is None
    assert names["base_model.model.lm_head.weight"] == "lm_head.weight"
    assert {name for name in names.values() if name} == set(tiny_hf_llama().state_dict())
    names = base_names(lora_model("litgpt"))
    assert names["lm_head.linear.weight"] == "lm_head.weight"
    assert names["transformer.h.0.attn.qkv.lora_A"] is None
    assert {name for name in names.values() if name} == set(tiny_litgpt().state_dict())
    assert base_names(tiny_litgpt()) == {}


def frozen_base_in_bf16(num_nodes: int, devices: int, base: str) -> dict:
    """``bf16-mixed``: a peft model's frozen base held in bf16 shards, its adapters in fp32; 3 steps."""
    from tests.helpers.training import full_state, make_fabric

    fabric = make_fabric(num_nodes, devices, precision="bf16-mixed")
    with fabric.init_module(empty_init=True):
        model = lora_model("peft")
    model = fabric.setup_module(model)
    fabric.load_raw(base, model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    data = fabric.strategy.distributed_sampler_kwargs
    per_rank = GLOBAL_BATCH // data["num_replicas"]
    rows = slice(per_rank * data["rank"], per_rank * (data["rank"] + 1))
    initial = full_state(model)
    losses = _steps(model, optimizer, rows, lambda loss: fabric.backward(loss.float()))
    shards = {name: param.to_local() for name, param in model.module.named_parameters()}
    return {
        "dtypes": {name: shard.dtype for name, shard in shards.items()},
        "frozen_shard_bytes": sum(s.numel() * s.element_size() for n, s in shards.items() if "lora_" not in n),
        "shard_bytes": sum(s.numel() * s.element_size() for s in shards.values()),
        "optimizer_dtypes": {key: value.dtype for key, value in _optimizer_state(model, optimizer).items()},
        "initial": initial,
        "trained": full_state(model),
        "losses": losses,
    }


@pytest.mark.timeout(400)
def test_a_frozen_base_is_held_in_bf16_under_bf16_mixed_while_adapters_train_in_fp32(tmp_path):
    from fabric_hsdp.planning import Training, model_shape_of_module
    from fabric_hsdp.planning.memory import memory_per_device

    base = base_checkpoint("peft", tmp_path)
    facts = launch(frozen_base_in_bf16, {"base": str(base)}, timeout=300).check().values[0]
    adapters = {name for name in facts["dtypes"] if "lora_" in name}
    frozen = {name: dtype for name, dtype in facts["dtypes"].items() if name not in adapters}
    assert adapters and set(frozen.values()) == {torch.bfloat16}  # no fp32 master copy of the base
    assert {facts["dtypes"][name] for name in adapters} == {torch.float32}
    assert {dtype for key, dtype in facts["optimizer_dtypes"].items() if not key.endswith(".step")} == {torch.float32}
    base_state = {f"base_model.model.{k}": v for k, v in base_model("peft", base).state_dict().items()}
    expected_bytes = sum(v.numel() for v in base_state.values()) * 2 // 2  # 2 bytes (bf16), over 2 shard ranks
    print(f"frozen base: {facts['frozen_shard_bytes']} bytes per rank (bf16), fp32 would be {2 * expected_bytes}")
    assert facts["frozen_shard_bytes"] == expected_bytes
    # the planner (shard_size="auto", fabric-hsdp plan) counts what the strategy holds
    planned = memory_per_device(model_shape_of_module(lora_model("peft")), Training("bf16-mixed"), 2, 1)
    assert planned.parameters == facts["shard_bytes"]
    for name, value in facts["trained"].items():
        if "lora_" in name:
            continue
        wrapped = name.replace(".base_layer.", ".")
        assert torch.equal(value, base_state[wrapped].to(torch.bfloat16)), name  # loaded, and never changed
    assert any(facts["trained"][n].ne(facts["initial"][n]).any() for n in adapters if "lora_B" in n)
    assert all(torch.isfinite(torch.tensor(facts["losses"])))


def test_the_planner_counts_a_frozen_base_without_gradients_or_optimizer_state():
    from fabric_hsdp.planning import Training, Workload, model_shape_of_module
    from fabric_hsdp.planning.memory import memory_per_device
    from fabric_hsdp.planning.traffic import traffic_per_step
    from fabric_hsdp.topology import Topology

    model = lora_model("peft")
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    lora = model_shape_of_module(model)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    everything = model_shape_of_module(model)
    training = Training("bf16-mixed", Workload(optimizer="adamw"))
    planned, planned_full = (memory_per_device(shape, training, 2, 1) for shape in (lora, everything))
    # every dim 0 of this model is even: a shard rank holds half of each tensor
    trainable = sum(p.numel() for p in adapters) // 2
    frozen = sum(p.numel() for p in model.parameters()) // 2 - trainable
    assert planned.parameters == 4 * trainable + 2 * frozen  # the base in bf16, the adapters in fp32
    assert planned.gradients == 4 * trainable
    assert planned.optimizer == 2 * 4 * trainable + 4 * len(adapters)  # AdamW's moments and step counters
    assert planned_full.parameters == 4 * (trainable + frozen) and planned_full.gradients == 4 * (trainable + frozen)
    assert "trainable" in lora.summary() and "trainable" not in everything.summary()
    layout = Topology(num_nodes=2, ranks_per_node=2, shard_size=2)
    lora_traffic, full_traffic = (traffic_per_step(shape, training, layout) for shape in (lora, everything))
    assert lora_traffic.inter_node_bytes < full_traffic.inter_node_bytes  # only the adapters' gradients cross


def _example_source(kind: str, directory: Path) -> Path:
    """A tiny base checkpoint directory as ``examples/finetune.py`` takes it (no tokenizer: byte tokens)."""
    source = directory / f"tiny-{kind}"
    if kind == "transformers":
        tiny_hf_llama(seed=5).save_pretrained(source)
        return source
    from litgpt.utils import save_config

    source.mkdir()
    save_config(litgpt_config(), source)
    torch.save(tiny_litgpt(seed=5).state_dict(), source / "lit_model.pth")
    return source


@pytest.mark.timeout(600)  # two launches of up to 240 s
@pytest.mark.parametrize("kind", ["transformers", "litgpt"])
def test_finetune_example_with_lora_r_keeps_adapter_only_checkpoints_resumes_and_exports(tmp_path, kind):
    from torch.distributed.checkpoint import FileSystemReader

    from examples.check_export import check_export

    source, out_dir = _example_source(kind, tmp_path), tmp_path / "out"
    args = {"checkpoint_dir": str(source), "out_dir": str(out_dir), "max_steps": 4, "save_every": 2, "seq_len": 16}
    args.update(batch_size=2, learning_rate=1e-2, lora_r=4)
    output = launch(finetune, {"args": args}, timeout=240).check().ranks[0].stdout
    assert "LoRA r=4" in output
    stored = FileSystemReader(str(out_dir / "checkpoints" / "step-000002")).read_metadata().state_dict_metadata
    model_keys = [key for key in stored if key.startswith("model.")]
    assert model_keys and all("lora_" in key for key in model_keys)  # the adapters only
    assert any(key.startswith("optimizer.state.") for key in stored)
    record = torch.load(out_dir / "export_check.pt", weights_only=True)
    result = check_export(record, prompt="Four", new_tokens=8)  # the export loaded by peft / litgpt onto the base
    print(f"{kind} --lora_r 4: {result}")
    assert result.max_logit_diff <= 1e-5 and result.loss_diff < 1e-5
    assert result.val_loss < result.val_loss_before

    shutil.rmtree(out_dir / "checkpoints" / "step-000004")
    shutil.rmtree(out_dir / "export")
    output = launch(finetune, {"args": args}, timeout=240).check().ranks[0].stdout
    assert f"resumed from {out_dir / 'checkpoints' / 'step-000002'} (step 2)" in output
    resumed = torch.load(out_dir / "export_check.pt", weights_only=True)["validation"]["val_loss"]
    assert resumed == record["validation"]["val_loss"]  # the adapters and AdamW state came back exactly


def test_peft_modules_to_save_is_refused_on_meta_with_what_works():
    from peft import LoraConfig, get_peft_model

    from fabric_hsdp.adapters.init import refuse_unsupported_adapters
    from fabric_hsdp.setup.materialize import parameters_on_meta

    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with parameters_on_meta():
        model = get_peft_model(tiny_hf_llama(), config)
    with pytest.raises(ValueError, match=r"ModulesToSaveWrapper at .*lm_head.*Leave modules_to_save out"):
        refuse_unsupported_adapters(model, tensor_parallel=False)
    refuse_unsupported_adapters(get_peft_model(tiny_hf_llama(), config), tensor_parallel=False)  # real: fine


def merge_that_fails(num_nodes: int, devices: int, out: str) -> dict:
    """``export_merged`` where the library's delta raises on every rank: each rank must raise, none wait."""
    from litgpt.lora import LoRALinear

    from fabric_hsdp.adapters import export_merged
    from tests.helpers.training import make_fabric

    fabric = make_fabric(num_nodes, devices)
    with fabric.init_module(empty_init=True):
        model = lora_model("litgpt")
    model = fabric.setup_module(model)

    def broken(self: Any) -> torch.Tensor:
        raise RuntimeError("planted failure in get_lora_AB")

    LoRALinear.get_lora_AB = broken
    try:
        export_merged(model, Path(out) / "merged.pth")
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return {"error": f"{type(error).__name__}: {error}", "written": (Path(out) / "merged.pth").exists()}
    return {"error": None}


@pytest.mark.timeout(200)
def test_a_merge_that_fails_ends_every_rank_with_the_error(tmp_path):
    args = {"out": str(tmp_path)}
    result = launch(merge_that_fails, args, num_nodes=1, ranks_per_node=2, timeout=150).check()
    for facts in result.values:
        assert facts["error"] == "RuntimeError: planted failure in get_lora_AB" and not facts["written"], facts


def test_two_tensors_with_one_base_name_are_refused_as_ambiguous():
    from litgpt.lora import LoRALinear

    from fabric_hsdp.checkpoint.training.load_names import load_names

    model = torch.nn.Sequential(LoRALinear(8, 8, r=2, lora_alpha=4))
    model[0].register_parameter("weight", torch.nn.Parameter(torch.zeros(8, 8)))  # "0.weight" and "0.linear.weight"
    targets = model.state_dict()
    with pytest.raises(ValueError, match=r"same base-model name .*'0.weight'.*key_map="):
        load_names(model, targets, {key: key for key in targets}, {}, None)
