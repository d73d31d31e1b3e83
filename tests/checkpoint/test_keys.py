import pytest
import torch

from fabric_hsdp.checkpoint import KeyMatch, TensorInfo, format_key_errors, make_key_map, match_keys
from fabric_hsdp.checkpoint.core.keys import parse_key_map_rules, suggest_prefix_rule


def test_make_key_map_specs():
    assert make_key_map(None)("a.b") == "a.b"
    rules = make_key_map({"transformer.": "model.", "transformer.h.": "layers.", "lm_head.": None})
    assert rules("transformer.h.0.w") == "layers.0.w"  # the longest prefix wins
    assert rules("transformer.wte.weight") == "model.wte.weight"
    assert rules("lm_head.weight") is None
    assert rules("other") == "other"
    assert make_key_map(str.upper)("ab") == "AB"
    assert make_key_map("transformer.=model.,!rope.")("rope.cache") is None
    assert make_key_map(["transformer.=", "x=y"])("transformer.a") == "a"
    with pytest.raises(TypeError, match="key_map must be None, a callable"):
        make_key_map(3)


def test_parse_key_map_rules():
    assert parse_key_map_rules("transformer.=model., lm_head.=, !rope_cache") == {
        "transformer.": "model.",
        "lm_head.": "",
        "rope_cache": None,
    }
    with pytest.raises(ValueError, match="key_map rule 'oops' is not 'OLD=NEW'"):
        parse_key_map_rules("oops")


def test_exact_match_with_key_map():
    match = match_keys(["transformer.a", "transformer.b", "rope"], ["model.a", "model.b"], {"transformer.": "model."})
    assert match == KeyMatch(
        mapping={"model.a": "transformer.a", "model.b": "transformer.b"}, missing=[], unexpected=["rope"]
    )
    dropped = match_keys(["a", "rope"], ["a"], {"rope": None})
    assert (dropped.unexpected, dropped.dropped) == ([], ["rope"])


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "model.", "module._orig_mod."])
def test_wrapper_prefixes_are_stripped_when_unambiguous(prefix):
    match = match_keys([f"{prefix}a.weight", f"{prefix}b.weight"], ["a.weight", "b.weight"])
    assert match.mapping == {"a.weight": f"{prefix}a.weight", "b.weight": f"{prefix}b.weight"}
    assert (match.missing, match.unexpected) == ([], [])


def test_wrapper_stripping_is_skipped_when_ambiguous():
    match = match_keys(["module.a", "model.a", "module.b"], ["a", "b"])
    assert match.mapping == {"b": "module.b"}
    assert match.missing == ["a"]
    assert match.unexpected == ["module.a", "model.a"]
    exact_first = match_keys(["model.x", "x"], ["x"])
    assert (exact_first.mapping, exact_first.unexpected) == ({"x": "x"}, ["model.x"])
    hf = match_keys(["model.embed.weight", "lm_head.weight"], ["embed.weight", "lm_head.weight"])
    assert hf.mapping == {"embed.weight": "model.embed.weight", "lm_head.weight": "lm_head.weight"}


def test_key_map_collisions_are_errors():
    with pytest.raises(ValueError, match="key_map renames both 'a.x' and 'b.x' to 'x'"):
        match_keys(["a.x", "b.x"], ["x"], {"a.": "", "b.": ""})


def test_missing_message_in_the_conventions_style():
    model = {f"layers.{i}.mlp.w1.weight": TensorInfo("", (11008, 4096), torch.float32) for i in range(3, 15)}
    match = match_keys(["other"], list(model), {"other": None})
    message = format_key_errors(match, model, {}, source_name="lit-llama.pth", hint="Pass strict=False.")
    assert message == (
        "checkpoint 'lit-llama.pth' has no tensor for 'layers.3.mlp.w1.weight' (model expects [11008, 4096] float32),"
        " 'layers.4.mlp.w1.weight' (model expects [11008, 4096] float32), 'layers.5.mlp.w1.weight' (model expects"
        " [11008, 4096] float32); 9 more missing. Pass strict=False."
    )


def test_unexpected_and_mismatched_shapes_are_listed():
    model = {"a": (torch.Size([4, 2]), torch.float32), "b": torch.zeros(3)}
    source = {"a": TensorInfo("a", (2, 4), torch.float16), "b": torch.zeros(3), "c": torch.zeros(2, dtype=torch.int64)}
    match = match_keys(source, model)
    message = format_key_errors(match, model, source, source_name="ckpt.pth")
    assert message == (
        "checkpoint 'ckpt.pth' has 1 tensor the model does not: 'c' ([2] int64). In 'ckpt.pth', 'a' is [2, 4] float16"
        " but the model expects [4, 2] float32. Pass strict=False to skip them, or key_map= to rename."
    )
    assert format_key_errors(match_keys(["b"], ["b"]), model, source, source_name="ckpt.pth") is None


def test_a_consistent_prefix_difference_is_suggested():
    source = {f"transformer.h.{i}.attn.weight": torch.zeros(1) for i in range(3)}
    model = {f"layers.{i}.attn.weight": torch.zeros(1) for i in range(3)}
    match = match_keys(source, model)
    assert suggest_prefix_rule(match.missing, match.unexpected) == {"transformer.h.": "layers."}
    message = format_key_errors(match, model, source, source_name="x.pth")
    assert message.endswith("The names differ by a prefix: key_map={'transformer.h.': 'layers.'} would rename them.")
    assert make_key_map({"transformer.h.": "layers."})("transformer.h.2.attn.weight") == "layers.2.attn.weight"


@pytest.mark.parametrize(
    ("model_keys", "checkpoint_keys", "expected"),
    [
        (
            ["transformer.wte.weight", "transformer.h.0.attn.qkv.weight", "lm_head.weight"],
            ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"],
            "The model uses litgpt's parameter names and the checkpoint transformers's",
        ),
        (
            ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"],
            ["transformer.wte.weight", "transformer.h.0.attn.qkv.weight", "lm_head.weight"],
            "The model uses transformers's parameter names and the checkpoint litgpt's",
        ),
    ],
)
def test_the_other_projects_naming_says_convert_instead_of_strict_false(model_keys, checkpoint_keys, expected):
    """A litgpt model on a transformers directory (and the reverse): 'Pass strict=False' would train random weights."""
    info = TensorInfo("", (4, 4), torch.float32)
    match = match_keys(checkpoint_keys, model_keys)
    message = format_key_errors(
        match, dict.fromkeys(model_keys, info), dict.fromkeys(checkpoint_keys, info), source_name="ckpt"
    )
    assert expected in message and "strict=False would train from random weights" in message
    assert "convert_to_litgpt" in message or "convert_from_litgpt" in message
    assert "Pass strict=False to skip them" not in message
