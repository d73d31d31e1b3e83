"""Reload a fine-tuned model's export with the library that owns its format; compare it with the fine-tuned model.

``examples/finetune.py`` leaves ``<out_dir>/export`` (litgpt's ``lit_model.pth`` or a transformers safetensors
directory, with config and tokenizer files) and ``<out_dir>/export_check.pt`` (the fine-tuned model's validation loss,
the settings it was computed with, and its logits for one validation sequence). This script, in one plain process:

1. loads the export as a user would: litgpt ``GPT(Config.from_file(...))`` + ``load_state_dict(torch.load(...))``, or
   ``AutoModelForCausalLM.from_pretrained(...)``, and the tokenizer from the export directory;
2. compares its logits with the fine-tuned model's (max |diff|);
3. computes its validation loss on the same windows, tokenized with the export's tokenizer, and compares it with the
   fine-tuned model's final one;
4. generates a few tokens greedily with the library's own generation (litgpt's ``generate``, transformers'
   ``model.generate``) and decodes them.

A LoRA run (``finetune.py --lora_r``) exported its adapters only: they are loaded onto the base from the run's
``--checkpoint_dir`` by peft (``PeftModel.from_pretrained``) or litgpt (``lora.GPT`` given both state dicts), with the
base's tokenizer.

It exits 1 if the logits or the loss differ by more than the tolerances.

    python examples/check_export.py --out_dir out/finetune
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.finetune import (  # noqa: E402
    EXPORT_CHECK,
    TextTokenizer,
    detect_format,
    load_tokenizer,
    logits_of,
    loss_sum,
    read_documents,
    train_and_validation_tokens,
    validation_windows,
    vocab_size_of,
)


@dataclass
class ExportCheck:
    """What :func:`check_export` measured."""

    format: str
    max_logit_diff: float
    val_loss: float
    fine_tuned_val_loss: float
    val_loss_before: float | None
    prompt: str
    generated: str

    @property
    def loss_diff(self) -> float:
        return abs(self.val_loss - self.fine_tuned_val_loss)


def load_adapters(record: dict[str, Any]) -> tuple[str, nn.Module, TextTokenizer]:
    """A LoRA run's export (``finetune.py --lora_r``): the base from the source checkpoint, the adapters on top, as
    each library loads them: peft's ``PeftModel.from_pretrained``, litgpt's ``lora.GPT`` given the base and the
    ``lit_model.pth.lora`` state dicts."""
    fmt, source, export_dir = record["format"], Path(record["source"]), Path(record["export"])
    if fmt == "litgpt":
        from litgpt.lora import GPT, Config

        model = GPT(Config.from_file(source / "model_config.yaml", **record["validation"]["lora"]))
        model.load_state_dict(torch.load(source / "lit_model.pth", weights_only=True), strict=False)
        adapters = torch.load(export_dir / "lit_model.pth.lora", weights_only=True)["model"]
        missing, unexpected = model.load_state_dict(adapters, strict=False)
        if unexpected or any("lora_" in key for key in missing):
            raise ValueError(f"{export_dir / 'lit_model.pth.lora'} does not fit the model: {unexpected or missing}")
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), export_dir)
    model.eval()
    return fmt, model, load_tokenizer(fmt, source, vocab_size_of(model))


def load_export(export_dir: Path) -> tuple[str, nn.Module, TextTokenizer]:
    """``(format, model in eval mode, tokenizer)`` of an export, loaded by litgpt or transformers themselves."""
    fmt = detect_format(export_dir)
    if fmt == "litgpt":
        from litgpt import GPT, Config

        model = GPT(Config.from_file(export_dir / "model_config.yaml"))
        model.load_state_dict(torch.load(export_dir / "lit_model.pth", weights_only=True, mmap=True))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(export_dir)
    model.eval()
    return fmt, model, load_tokenizer(fmt, export_dir, vocab_size_of(model))


@torch.no_grad()
def generate(fmt: str, model: nn.Module, tokenizer: TextTokenizer, prompt: str, new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` by the owning library's generation; returns the new text only."""
    ids = tokenizer.encode(prompt)
    if tokenizer.eos_id is not None:
        ids = ids[:-1]  # a prompt, not a finished document
    prompt_ids = torch.tensor(ids, dtype=torch.long)
    if fmt == "litgpt":
        from litgpt.generate.base import generate as litgpt_generate

        model.max_seq_length = len(ids) + new_tokens
        model.set_kv_cache(batch_size=1)
        out = litgpt_generate(model, prompt_ids, len(ids) + new_tokens, top_k=1, include_prompt=False)
        model.clear_kv_cache()
        new = out.tolist()
    else:
        out = model.generate(
            prompt_ids[None],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pad_token_id=tokenizer.eos_id,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        new = out[0, len(ids) :].tolist()
    return tokenizer.decode(new)


@torch.no_grad()
def check_export(record: dict[str, Any], prompt: str = "Four score and seven", new_tokens: int = 16) -> ExportCheck:
    """Reload ``record["export"]`` and measure it against the fine-tuned model (``record``: an export_check.pt)."""
    lora = "lora" in record["validation"]
    fmt, model, tokenizer = load_adapters(record) if lora else load_export(Path(record["export"]))
    max_logit_diff = (logits_of(model, record["tokens"]).float() - record["logits"]).abs().max().item()
    settings = record["validation"]
    documents = read_documents(Path(settings["data"]), settings["text_key"])
    _, val = train_and_validation_tokens(documents, tokenizer, settings["val_fraction"], settings["seq_len"])
    windows = validation_windows(val, settings["seq_len"], settings["max_val_windows"])
    batch = settings["batch_size"]
    total = sum(loss_sum(model, windows[i : i + batch]) for i in range(0, len(windows), batch))
    val_loss = (total / windows[:, 1:].numel()).item()
    generated = generate(fmt, model, tokenizer, prompt, new_tokens)
    return ExportCheck(
        fmt, max_logit_diff, val_loss, settings["val_loss"], settings.get("val_loss_before"), prompt, generated
    )


def main(
    out_dir: Path = Path("out/finetune"),
    max_logit_diff: float = 1e-4,
    max_loss_diff: float = 1e-5,
    prompt: str = "Four score and seven",
    new_tokens: int = 16,
) -> int:
    """Check the export of a finetune.py run; exit status 1 when it does not reproduce the fine-tuned model.

    The measurements also go to ``<out_dir>/export_check.json``.

    Args:
        out_dir: The ``--out_dir`` of ``examples/finetune.py`` (holds ``export/`` and ``export_check.pt``).
        max_logit_diff: Largest |difference| of any logit accepted (float32 noise: same weights, other kernels).
        max_loss_diff: Largest |difference| of the validation losses accepted.
        prompt: Text to continue.
        new_tokens: Tokens to generate.
    """
    started = time.perf_counter()
    record = torch.load(out_dir / EXPORT_CHECK, weights_only=True)
    result = check_export(record, prompt, new_tokens)
    print(
        f"{result.format} export {record['export']} reloaded by"
        f" {'litgpt (GPT.load_state_dict)' if result.format == 'litgpt' else 'transformers (from_pretrained)'}:"
        f" logits vs the fine-tuned model's: max |diff| {result.max_logit_diff:.2e} (tolerance {max_logit_diff:g});"
        f" val loss {result.val_loss:.6f} vs fine-tuned {result.fine_tuned_val_loss:.6f}: |diff|"
        f" {result.loss_diff:.2e} (tolerance {max_loss_diff:g}); in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    print(f"greedy continuation of {result.prompt!r}: {result.generated!r}", flush=True)
    summary = dict(asdict(result), loss_diff=result.loss_diff, max_logit_diff_allowed=max_logit_diff)
    summary.update(max_loss_diff_allowed=max_loss_diff)
    (out_dir / "export_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    failures = []
    if result.max_logit_diff > max_logit_diff:
        failures.append(f"logits differ by up to {result.max_logit_diff:.2e} > {max_logit_diff:g}")
    if result.loss_diff > max_loss_diff:
        failures.append(f"val loss differs by {result.loss_diff:.2e} > {max_loss_diff:g}")
    if not result.generated:
        failures.append("generation produced no text")
    if failures:
        print(f"check_export: FAILED: {'; '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from jsonargparse import CLI

    sys.exit(CLI(main, as_positional=False))
