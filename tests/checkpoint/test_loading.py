"""Raw loading in one process (no process group): what does not need several ranks to go wrong."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fabric_hsdp.checkpoint.training.raw_load import load_into_model


class TiedLM(nn.Module):
    """An embedding tied to the output layer, as in Llama 3.2 1B/3B: state_dict() names the one tensor twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("stored", ["embed.weight", "head.weight"])
def test_tied_weights_load_strict_from_a_checkpoint_that_stores_them_once(tmp_path, stored):
    source = TiedLM()
    # save_pretrained and safetensors keep one name of a shared tensor
    save_file(
        {stored: source.embed.weight.detach().clone(), **source.norm.state_dict(prefix="norm.")}, tmp_path / "m.st"
    )
    model = TiedLM()
    with torch.no_grad():
        model.embed.weight.zero_()
    result = load_into_model(tmp_path / "m.st", model, strict=True)
    assert result.missing == []
    assert torch.equal(model.embed.weight, source.embed.weight) and model.head.weight is model.embed.weight


def test_an_untied_weight_that_the_checkpoint_lacks_is_still_missing(tmp_path):
    source = TiedLM()
    save_file({"embed.weight": source.embed.weight.detach().clone()}, tmp_path / "m.st")
    with pytest.raises(ValueError, match=r"no tensor for 'norm.weight'"):
        load_into_model(tmp_path / "m.st", TiedLM(), strict=True)
