"""A plain Fabric training script over a model named by its config: what ``fabric-hsdp plan --verify`` and
``benchmarks/dryrun_scale.py`` dry-run. It is an ordinary user script (it runs under ``fabric-hsdp run`` too).

    python -m fabric_hsdp.dryrun.train_script --model Llama-3-70B --shard_size world --tp 8 --precision bf16-true \
        --activation_checkpointing --num_nodes 16 --devices 8

``--model``: a litgpt config name (``Llama-3-70B``; litgpt's ``GPT``), a litgpt ``model_config.yaml``, or a
transformers ``config.json`` (or its directory; built with ``AutoModelForCausalLM.from_config``). Weights start on
the meta device (``empty_init=True``); ``--init_from`` fills them with ``fabric.load_raw``. ``--lora_r R``: LoRA
adapters of rank R on every linear layer of the blocks, the base frozen, as ``examples/finetune.py --lora_r`` builds
them (litgpt's ``lora.GPT``; peft's ``get_peft_model`` with ``target_modules="all-linear"``).
``--expert_parallel_size N``: a mixture-of-experts model's experts split ``N`` ways (``HybridFSDPStrategy``'s own).
``--context_parallel_size C``: each sequence split over ``C`` ranks (transformers models), the step as a user writes
it: ``strategy.shard_sequence``, the model given the position ids, ``strategy.cross_entropy``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

# litgpt's lora.Config fields for adapters on every linear layer of the blocks (examples/finetune.py's lora_settings)
_LITGPT_LORA = {"lora_query": True, "lora_key": True, "lora_value": True, "lora_projection": True, "lora_mlp": True}


def build(model: str, lora_r: int = 0) -> tuple[torch.nn.Module, type, int]:
    """The model (call inside ``fabric.init_module``), its block class and its vocabulary size; with ``lora_r``, LoRA
    adapters of that rank on the blocks' linear layers and the rest frozen.

    Raises:
        ValueError: ``model`` names no config this script can build (a checkpoint holds shapes, not a class).
    """
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.name.endswith(".json") and path.is_file():
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(path))
        module = AutoModelForCausalLM.from_config(config)
        if lora_r:
            from peft import LoraConfig, get_peft_model

            module = get_peft_model(module, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear"))
        layers = next(child for name, child in module.named_modules() if name.endswith("layers"))
        return module, type(layers[0]), config.vocab_size
    if lora_r:
        from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable
    else:
        from litgpt import GPT, Config
        from litgpt.model import Block
    settings = {"lora_r": lora_r, "lora_alpha": 2 * lora_r, **_LITGPT_LORA} if lora_r else {}
    if path.is_dir() and (path / "model_config.yaml").is_file():
        path = path / "model_config.yaml"
    if path.suffix in (".yaml", ".yml") and path.is_file():
        config = Config.from_file(path, **settings)
    elif not path.exists():
        try:
            config = Config.from_name(model, **settings)
        except ValueError:
            raise ValueError(f"--model {model!r}: not a litgpt config name, model_config.yaml or config.json") from None
    else:
        raise ValueError(
            f"--model {model!r}: a dry run builds the model from its config (a litgpt name, model_config.yaml or"
            " config.json); a checkpoint holds shapes but no model class"
        )
    module = GPT(config)
    if lora_r:
        mark_only_lora_as_trainable(module)
    return module, Block, config.padded_vocab_size


def parse_args(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--shard_size", default="node")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--expert_parallel_size", type=int, default=1)
    parser.add_argument("--context_parallel_size", type=int, default=1)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--activation_checkpointing_mode", default="full", choices=["full", "selective"])
    parser.add_argument("--keep_gathered_while_accumulating", action="store_true")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seq_len", type=int, default=16)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    parser.add_argument("--lora_r", type=int, default=0)
    parser.add_argument("--init_from", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--steps", type=int, default=10)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import lightning as L

    from fabric_hsdp import HybridFSDPStrategy

    args = parse_args(argv)
    shard_size = int(args.shard_size) if args.shard_size.isdigit() else args.shard_size
    with torch.device("meta"):
        _, block, vocab = build(args.model, args.lora_r)  # the block class and vocabulary only: nothing is allocated
    strategy = HybridFSDPStrategy(
        sharded_modules={block},
        shard_size=shard_size,
        tensor_parallel_size=args.tp,
        expert_parallel_size=args.expert_parallel_size,
        context_parallel_size=args.context_parallel_size,
        activation_checkpointing={block} if args.activation_checkpointing else None,
        activation_checkpointing_mode=args.activation_checkpointing_mode,
        keep_gathered_while_accumulating=args.keep_gathered_while_accumulating,
    )
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
    )
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model, _, _ = build(args.model, args.lora_r)
    model = fabric.setup_module(model)
    parameters = model.parameters()
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    else:
        optimizer = torch.optim.SGD(parameters, lr=1e-4, momentum=0.9 if args.optimizer == "sgd" else 0.0)
    optimizer = fabric.setup_optimizers(optimizer)
    if args.init_from:
        fabric.load_raw(args.init_from, model)
    for step in range(args.steps):
        if args.context_parallel_size > 1:
            loss = _context_parallel_loss(strategy, model, args, vocab, step)
        else:
            tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), device=fabric.device)
            output = model(tokens[:, :-1])
            logits = output.logits if hasattr(output, "logits") else output
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if args.save:  # with LoRA, adapter-only, as examples/finetune.py saves
        from fabric_hsdp.adapters import adapter_keys

        adapters = set(adapter_keys(model))
        adapters_only = {"model": lambda name, value: name in adapters} if args.lora_r else None
        fabric.save(args.save, {"model": model, "optimizer": optimizer}, filter=adapters_only)


def _context_parallel_loss(strategy: Any, model: torch.nn.Module, args: Any, vocab: int, step: int) -> torch.Tensor:
    """This rank's share of the step's loss under context parallelism: the ranks of a context group draw the same
    sequences (seeded by their data-parallel rank) and each computes on its part of them."""
    generator = torch.Generator().manual_seed(step * 100_003 + strategy.distributed_sampler_kwargs["rank"])
    tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=generator)
    tokens = tokens.to(strategy.root_device)
    inputs, labels, position_ids = strategy.shard_sequence(tokens[:, :-1], tokens[:, 1:])
    logits = model(inputs, position_ids=position_ids).logits
    return strategy.cross_entropy(logits, labels)


if __name__ == "__main__":
    main()
