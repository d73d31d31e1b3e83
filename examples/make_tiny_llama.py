"""Make a tiny random Llama locally, in both checkpoint formats, with the libraries' own tools (no download).

Writes two directories that look like what users download, but small (a 2-layer, 64-wide Llama, ~0.1 M parameters):

* ``<out_dir>/tiny-llama-hf``: a transformers directory, ``LlamaForCausalLM(LlamaConfig(...)).save_pretrained()``
  (``config.json``, ``generation_config.json``, ``model.safetensors``) plus a byte-level BPE tokenizer trained here
  with the ``tokenizers`` library on ``--data`` and saved by transformers (``tokenizer.json``,
  ``tokenizer_config.json``), which both ``AutoTokenizer.from_pretrained`` and ``litgpt.Tokenizer`` load.
* ``<out_dir>/tiny-llama-litgpt``: the same weights converted by litgpt's own converter
  (``litgpt.scripts.convert_hf_checkpoint``), as ``litgpt download`` leaves a checkpoint: ``lit_model.pth`` and
  ``model_config.yaml``, with the tokenizer and Hugging Face config files next to them.

Both hold the same model: the script checks that litgpt's ``GPT`` and transformers' ``LlamaForCausalLM`` give the same
logits (float32 noise, ~1e-6) before it returns.

    python examples/make_tiny_llama.py --out_dir out/tiny-llama
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
LITGPT_CONFIG_NAME = "tiny-llama-hsdp"


def train_tokenizer(data: Path, vocab_size: int, out_dir: Path) -> Any:
    """Byte-level BPE trained on ``data``, with ``<s>`` (BOS, id 0) and ``</s>`` (EOS, id 1), saved by transformers.

    Returns:
        The transformers tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: no unknown input
        show_progress=False,
    )
    tokenizer.train([str(data)], trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"BPE on '{data}' reached {tokenizer.get_vocab_size()} tokens, not --vocab_size {vocab_size}: the text is"
            " too short for that many merges. Pass a smaller --vocab_size (at least 258) or a longer --data file."
        )
    bos = tokenizer.token_to_id("<s>")
    # Llama's convention: the tokenizer itself prepends BOS (litgpt reads `add_bos_token` for the same behaviour)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(out_dir)
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["add_bos_token"] = True  # read by litgpt.Tokenizer (its `use_bos`); transformers uses the post-processor
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return wrapped


def hf_llama_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def register_litgpt_config(hf_config: Any) -> str:
    """Add the tiny model to litgpt's config registry (this process only), as litgpt's converter needs a name."""
    import litgpt.config

    # transformers 5 keeps rope_theta in rope_parameters, 4.x as an attribute
    rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta") or hf_config.rope_theta
    litgpt.config.name_to_config[LITGPT_CONFIG_NAME] = {
        "name": LITGPT_CONFIG_NAME,
        "hf_config": {"org": "local", "name": LITGPT_CONFIG_NAME},
        "block_size": hf_config.max_position_embeddings,
        "vocab_size": hf_config.vocab_size,
        "padded_vocab_size": hf_config.vocab_size,
        "n_layer": hf_config.num_hidden_layers,
        "n_head": hf_config.num_attention_heads,
        "n_query_groups": hf_config.num_key_value_heads,
        "n_embd": hf_config.hidden_size,
        "rotary_percentage": 1.0,
        "parallel_residual": False,
        "bias": False,
        "norm_class_name": "RMSNorm",
        "norm_eps": hf_config.rms_norm_eps,
        "mlp_class_name": "LLaMAMLP",
        "intermediate_size": hf_config.intermediate_size,
        "rope_base": int(rope_theta),
    }
    return LITGPT_CONFIG_NAME


def make_tiny_llama(
    out_dir: Path = Path("out/tiny-llama"),
    data: Path = Path("examples/data/tiny.txt"),
    vocab_size: int = 384,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write the transformers and the litgpt directory of one tiny random Llama.

    Args:
        out_dir: Parent of ``tiny-llama-hf`` and ``tiny-llama-litgpt`` (both replaced if they exist).
        data: Text the BPE tokenizer is trained on (relative paths are also tried from the repository root).
        vocab_size: Tokens of the tokenizer and rows of the embedding (258 at least: 256 bytes + BOS + EOS).
        seed: Seed of the random weights.

    Returns:
        ``(transformers directory, litgpt directory)``.
    """
    import torch
    from litgpt import GPT, Config
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint
    from transformers import LlamaForCausalLM

    if not data.is_absolute() and not data.exists():
        data = REPO_ROOT / data
    if not data.is_file():
        raise FileNotFoundError(f"--data '{data}': no such file; pass a text file to train the tokenizer on")
    hf_dir, lit_dir = out_dir / "tiny-llama-hf", out_dir / "tiny-llama-litgpt"
    for directory in (hf_dir, lit_dir):
        if directory.exists():
            shutil.rmtree(directory)
    hf_dir.mkdir(parents=True)

    tokenizer = train_tokenizer(data, vocab_size, hf_dir)
    config = hf_llama_config(vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(hf_dir)
    print(f"transformers: {hf_dir}: {sorted(entry.name for entry in hf_dir.iterdir())}", flush=True)

    # litgpt's converter reads the Hugging Face files in place and writes lit_model.pth + model_config.yaml there
    shutil.copytree(hf_dir, lit_dir)
    convert_hf_checkpoint(lit_dir, model_name=register_litgpt_config(config))
    (lit_dir / "model.safetensors").unlink()  # what remains is what `litgpt download` leaves
    print(f"litgpt: {lit_dir}: {sorted(entry.name for entry in lit_dir.iterdir())}", flush=True)

    lit_model = GPT(Config.from_file(lit_dir / "model_config.yaml")).eval()
    lit_model.load_state_dict(torch.load(lit_dir / "lit_model.pth", weights_only=True))
    tokens = tokenizer(data.read_text()[:400], return_tensors="pt")["input_ids"][:, :64]
    with torch.no_grad():
        difference = (hf_model(tokens).logits - lit_model(tokens)).abs().max().item()
    if difference > 1e-4:
        raise RuntimeError(
            f"litgpt's conversion of {hf_dir} gives different logits (max |diff| {difference:.2e}): the two formats do"
            " not hold the same model"
        )
    parameters = sum(p.numel() for p in hf_model.parameters())
    print(
        f"same model in both formats: {parameters:,} parameters, vocab {vocab_size}; logits of litgpt's GPT vs"
        f" transformers' LlamaForCausalLM on {tokens.shape[1]} tokens: max |diff| {difference:.1e}",
        flush=True,
    )
    return hf_dir, lit_dir


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(make_tiny_llama, as_positional=False)
