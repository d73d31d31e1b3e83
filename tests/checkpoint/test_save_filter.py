"""``fabric.save(path, state, filter=...)``: a checkpoint of only the entries the filter keeps (e.g. LoRA adapters),
sharded or full, loaded back with ``strict=False`` on another topology."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.launch import launch

pytestmark = pytest.mark.slow


def _is_norm(name: str, value: object) -> bool:
    return "norm" in name


def save_filtered(num_nodes: int, devices: int, out: str, name: str) -> dict:
    """Train 2 steps, save the norms only (and the step), record the full model (rank 0 writes expected.pt)."""
    from tests.helpers.training import full_state, layer_class, make_fabric, setup_training, train_steps

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=2)
    expected = full_state(model.module)
    state = {"model": model, "optimizer": optimizer, "step": 2}
    fabric.save(Path(out) / name, state, filter={"model": _is_norm, "optimizer": lambda key, value: False})
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    return {}


def load_filtered(num_nodes: int, devices: int, out: str, name: str) -> dict:
    """Load the filtered checkpoint with strict=False into a model initialised with another seed."""
    from tests.helpers.training import full_state, layer_class, make_fabric, setup_training

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    model, optimizer, _ = setup_training(fabric, empty_init=False, seed=99)
    state = {"model": model, "step": 0}
    before = full_state(model.module)
    fabric.load(Path(out) / name, state, strict=False)
    after = full_state(model.module)
    expected = torch.load(Path(out) / "expected.pt", weights_only=True)
    return {
        "restored": sorted(k for k, v in after.items() if torch.equal(v, expected[k])),
        "untouched": sorted(k for k, v in after.items() if torch.equal(v, before[k])),
        "names": sorted(after),
        "step": state["step"],
    }


@pytest.mark.parametrize("name", ["ckpt", "ckpt.pth"])
def test_a_filtered_save_holds_what_the_filter_keeps_and_loads_with_strict_false(tmp_path, name):
    launch(save_filtered, {"out": str(tmp_path), "name": name}).check()
    path = tmp_path / name
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        stored = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        assert stored and all(key.startswith("model.") and "norm" in key for key in stored), sorted(stored)
        plain = torch.load(path / "meta.pt", weights_only=True)
    else:
        plain = torch.load(path, weights_only=True)
        stored = {f"model.{key}" for key in plain.pop("model")}
        assert stored and all("norm" in key for key in stored), sorted(stored)
    assert plain == {"step": 2}  # the optimizer's filter kept nothing: no optimizer entry at all

    result = launch(
        load_filtered,
        {"out": str(tmp_path), "name": name},
        num_nodes=1,
        ranks_per_node=2,
    )
    for facts in result.check().values:
        norms = [key for key in facts["names"] if "norm" in key]
        others = [key for key in facts["names"] if "norm" not in key]
        assert set(norms) <= set(facts["restored"])  # every saved tensor back, on another topology
        assert sorted(stored) == [f"model.{key}" for key in norms]
        assert [key for key in others if key in facts["untouched"]] == others  # the rest keeps its own init
        assert facts["step"] == 2
