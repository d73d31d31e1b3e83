"""Fine-tune a Llama checkpoint (litgpt or transformers directory) with ``HybridFSDPStrategy`` on one or many nodes.

``--checkpoint_dir`` is either

* a litgpt checkpoint directory (``lit_model.pth`` + ``model_config.yaml``, as ``litgpt download`` leaves it): the
  model is litgpt's ``GPT(Config.from_file(...))``, the tokenizer ``litgpt.Tokenizer(checkpoint_dir)``; or
* a transformers directory (``config.json`` + ``*.safetensors``, single or indexed): the model is
  ``AutoModelForCausalLM.from_config(...)``, the tokenizer ``AutoTokenizer.from_pretrained(checkpoint_dir)``.

The model is built on the meta device (no memory, no init time), sharded (each layer of the model's ``nn.ModuleList``
one FSDP unit: ``HybridFSDPStrategy(sharded_modules=None)``), then filled with ``fabric.load_raw`` in ``slice`` mode:
each rank reads only its own shard's elements from the file, never a full copy. It trains on ``--data``, a text file
or a JSONL file (one ``{"text": ...}`` per line), tokenized with the checkpoint's own tokenizer (byte tokens only
when the directory has none, and the log says so). Every step logs the loss, tokens/s and peak memory; the validation
loss is computed before training, every ``--eval_every`` steps and at the end.

Checkpoints are sharded DCP directories ``<out_dir>/checkpoints/step-<N>`` (every rank writes its own shards), with
``<out_dir>/checkpoints/latest`` pointing at the newest (replaced atomically); ``--keep_last k`` keeps the newest k.
Started again with the same ``--out_dir`` the job resumes from the newest *complete* one (an incomplete one is
skipped, the reason logged), on any number of nodes, or from ``--resume PATH``. When the data-parallel size differs
from the saved run's, the gradient accumulation is adjusted to keep the global batch (or the log says what changed).
On SLURM's pre-kill signal (``#SBATCH --signal=USR1@90``) or SIGTERM every rank stops at the same step boundary and
saves; with ``--requeue true`` the job requeues itself (``scontrol requeue``) and the restarted job resumes
(:mod:`fabric_hsdp.processes.preemption`). At the end the model is
exported in the source's own format to ``<out_dir>/export``: ``lit_model.pth`` for litgpt, a ``save_pretrained``-style
safetensors directory for transformers, with the config and tokenizer files of ``--checkpoint_dir`` next to it, and
each tensor in its dtype in the source checkpoint. ``<out_dir>/export_check.pt`` keeps the fine-tuned model's
validation loss and the logits of one validation sequence, which ``examples/check_export.py`` compares with the
export reloaded by litgpt or transformers.

Launch (``--devices``/``--num_nodes`` default to what torchrun, SLURM's srun or Open MPI's mpirun started)::

    python examples/make_tiny_llama.py --out_dir out/tiny-llama     # a tiny random Llama in both formats
    # two simulated nodes x two ranks on this machine: both commands at once (two shells), same port
    fabric run --accelerator cpu --devices 2 --num-nodes 2 --node-rank 0 --main-address 127.0.0.1 --main-port 29500 \
        examples/finetune.py --checkpoint_dir out/tiny-llama/tiny-llama-hf
    fabric run --accelerator cpu --devices 2 --num-nodes 2 --node-rank 1 --main-address 127.0.0.1 --main-port 29500 \
        examples/finetune.py --checkpoint_dir out/tiny-llama/tiny-llama-hf
    torchrun --nproc-per-node 2 examples/finetune.py --checkpoint_dir out/tiny-llama/tiny-llama-litgpt
    srun python examples/finetune.py --checkpoint_dir checkpoints/meta-llama/Llama-3.2-1B --precision bf16-mixed
    python examples/finetune.py --accelerator cpu --devices 2 --checkpoint_dir ...   # Fabric starts the processes

With ``--lora_r R`` the job fine-tunes LoRA adapters of rank R on every linear layer of the blocks (litgpt's
``lora.GPT``; peft's ``get_peft_model`` around the transformers model), the base frozen and loaded from
``--checkpoint_dir`` as above (no key map: the strategy knows the wrappers' names). Its checkpoints hold the adapters
and their optimizer state only (``fabric.save(filter=...)``; resumed onto the base with ``strict=False``), and the
export is the adapters in the library's format: a peft adapter directory (``PeftModel.from_pretrained(base, export)``)
or litgpt's ``lit_model.pth.lora``; ``examples/check_export.py`` loads the base and the adapters and compares.

Options: ``python examples/finetune.py --help``; a YAML file: ``--config examples/configs/finetune.yaml``.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES.parent))  # `examples.launching` without installing the examples

from examples.launching import devices_and_nodes, launched_by_fabric_cli, say  # noqa: E402
from examples.retention import keep_last, newest_complete, point_latest, why_incomplete  # noqa: E402
from fabric_hsdp import HybridFSDPStrategy  # noqa: E402
from fabric_hsdp.adapters import adapter_keys  # noqa: E402
from fabric_hsdp.processes.preemption import Preemption  # noqa: E402

Format = Literal["litgpt", "transformers"]
WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".index.json", ".distcp")
EXPORT_CHECK = "export_check.pt"


# --- the checkpoint directory: format, model, tokenizer ---------------------------------------------------------------


def detect_format(checkpoint_dir: Path) -> Format:
    """``"litgpt"`` for ``lit_model.pth`` + ``model_config.yaml``, ``"transformers"`` for ``config.json`` + safetensors.

    Raises:
        FileNotFoundError: the directory is neither, with what it holds and what each format needs.
    """
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"--checkpoint_dir '{checkpoint_dir}' is not a directory")
    if (checkpoint_dir / "lit_model.pth").is_file() and (checkpoint_dir / "model_config.yaml").is_file():
        return "litgpt"
    if (checkpoint_dir / "config.json").is_file() and any(checkpoint_dir.glob("*.safetensors")):
        return "transformers"
    held = sorted(entry.name for entry in checkpoint_dir.iterdir())[:12]
    raise FileNotFoundError(
        f"--checkpoint_dir '{checkpoint_dir}' is neither a litgpt checkpoint (lit_model.pth + model_config.yaml) nor"
        f" a transformers directory (config.json + *.safetensors); it holds {held}. For a litgpt model run"
        " `litgpt download <repo>` (or litgpt's convert_hf_checkpoint); for transformers, save_pretrained()."
    )


def weights_of(fmt: Format, checkpoint_dir: Path) -> Path:
    """What ``fabric.load_raw`` reads: ``lit_model.pth``, or the transformers directory (one or indexed files)."""
    return checkpoint_dir / "lit_model.pth" if fmt == "litgpt" else checkpoint_dir


def lora_settings(lora_r: int, lora_alpha: int) -> dict[str, Any]:
    """litgpt's ``lora.Config`` fields for LoRA of rank ``lora_r`` on every linear layer of the blocks."""
    return {"lora_r": lora_r, "lora_alpha": lora_alpha, "lora_query": True, "lora_key": True, "lora_value": True,
            "lora_projection": True, "lora_mlp": True}  # fmt: skip


def build_model(fmt: Format, checkpoint_dir: Path, lora_r: int = 0, lora_alpha: int = 16) -> nn.Module:
    """The model of the checkpoint's architecture, untrained; call it inside ``fabric.init_module(empty_init=True)``.

    With ``lora_r > 0``: LoRA adapters of that rank on every linear layer of the blocks, the rest frozen (litgpt's
    ``lora.GPT`` with ``mark_only_lora_as_trainable``; peft's ``get_peft_model`` with ``target_modules="all-linear"``).
    """
    if fmt == "litgpt":
        if lora_r:
            from litgpt.lora import GPT as LoRAGPT
            from litgpt.lora import Config as LoRAConfig
            from litgpt.lora import mark_only_lora_as_trainable

            model = LoRAGPT(
                LoRAConfig.from_file(checkpoint_dir / "model_config.yaml", **lora_settings(lora_r, lora_alpha))
            )
            mark_only_lora_as_trainable(model)
            return model
        from litgpt import GPT, Config

        return GPT(Config.from_file(checkpoint_dir / "model_config.yaml"))
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint_dir)
    # Fabric's precision sets the default dtype (bf16 under "bf16-true"); transformers would take config.json's
    dtype_argument = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_config(config, **{dtype_argument: torch.get_default_dtype()})
    if lora_r:
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=lora_alpha, target_modules="all-linear"))
    return model


def vocab_size_of(model: nn.Module) -> int:
    """Rows of the model's output layer: every token id must be below this."""
    config = model.config
    return int(getattr(config, "padded_vocab_size", None) or config.vocab_size)


def tied_aliases(model: nn.Module) -> set[str]:
    """State-dict names of tensors already listed under an earlier name (tied weights: ``lm_head.weight`` of a model
    whose output layer shares the embedding). The export leaves them out unless the source checkpoint has them, as
    ``save_pretrained`` does; transformers would otherwise untie the weights when it loads both."""
    seen: set[int] = set()
    aliases = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(name)
        seen.add(id(tensor))
    return aliases


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``(batch, seq, vocab)`` logits of a litgpt ``GPT`` (returns them) or a transformers model (``.logits``)."""
    if hasattr(getattr(model, "config", None), "use_cache"):  # transformers: no KV cache while training
        return model(input_ids=tokens, use_cache=False).logits
    return model(tokens)


class ModuleListLayers:
    """The layers of the model's ``nn.ModuleList``s, as the strategy's default sharding finds them.

    The same rule as ``HybridFSDPStrategy(sharded_modules=None)``; used to name the layer class in the log and as the
    ``(name, module) -> bool`` policy for activation checkpointing (call :meth:`find` before ``setup_module``).
    """

    def __init__(self) -> None:
        self.classes: set[type[nn.Module]] = set()
        self.count = 0

    def find(self, model: nn.Module) -> str:
        layers = [child for sub in model.modules() if isinstance(sub, nn.ModuleList) for child in sub]
        self.classes = {type(layer) for layer in layers}
        self.count = len(layers)
        return ", ".join(sorted(cls.__name__ for cls in self.classes)) or "none"

    def __call__(self, name: str, module: nn.Module) -> bool:
        return type(module) in self.classes


class TextTokenizer:
    """One interface over litgpt's ``Tokenizer``, transformers' ``AutoTokenizer`` and byte tokens (the fallback).

    ``encode`` returns one document's ids with the tokenizer's BOS and EOS around it (when it has them), the same ids
    for the same tokenizer files whichever library reads them.
    """

    def __init__(self, kind: str, backend: Any, bos_id: int | None, eos_id: int | None, vocab_size: int) -> None:
        self.kind = kind
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        if self.kind == "litgpt":
            ids = self.backend.encode(text, bos=False, eos=False).tolist()
        elif self.kind == "transformers":
            ids = self.backend(text, add_special_tokens=False)["input_ids"]
        else:
            ids = list(text.encode("utf-8"))
        return (
            ([self.bos_id] if self.bos_id is not None else [])
            + ids
            + ([self.eos_id] if self.eos_id is not None else [])
        )

    def decode(self, ids: list[int]) -> str:
        if self.kind == "litgpt":
            return self.backend.decode(torch.tensor(ids))
        if self.kind == "transformers":
            return self.backend.decode(ids, skip_special_tokens=True)
        return bytes(ids).decode("utf-8", errors="replace")

    def describe(self) -> str:
        if self.kind == "bytes":
            return "byte tokens (FALLBACK: the checkpoint directory has no tokenizer; ids 0-255 are UTF-8 bytes)"
        name = "litgpt.Tokenizer" if self.kind == "litgpt" else f"transformers {type(self.backend).__name__}"
        return f"{name}, vocab {self.vocab_size}, BOS {self.bos_id}, EOS {self.eos_id}"


def load_tokenizer(fmt: Format, checkpoint_dir: Path, model_vocab_size: int) -> TextTokenizer:
    """The checkpoint's own tokenizer (litgpt's for litgpt, transformers' for transformers); bytes if it has none.

    Raises:
        ValueError: the tokenizer's ids do not fit the model's vocabulary.
    """
    has_tokenizer = any((checkpoint_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
    if not has_tokenizer:
        tokenizer = TextTokenizer("bytes", None, None, None, 256)
    elif fmt == "litgpt":
        from litgpt import Tokenizer

        backend = Tokenizer(checkpoint_dir)
        tokenizer = TextTokenizer("litgpt", backend, backend.bos_id, backend.eos_id, backend.vocab_size)
    else:
        from transformers import AutoTokenizer

        backend = AutoTokenizer.from_pretrained(checkpoint_dir)
        tokenizer = TextTokenizer("transformers", backend, backend.bos_token_id, backend.eos_token_id, len(backend))
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer ({tokenizer.describe()}) has {tokenizer.vocab_size} tokens but the model's embedding only"
            f" {model_vocab_size} rows: '{checkpoint_dir}' mixes files of different models."
        )
    return tokenizer


# --- data -------------------------------------------------------------------------------------------------------------


def resolve_data(data: Path) -> Path:
    """``data`` as given, else relative to the repository root; must be a file."""
    if not data.is_absolute() and not data.exists():
        data = EXAMPLES.parent / data
    if not data.is_file():
        raise FileNotFoundError(f"--data '{data}': no such file. Pass a text file or a JSONL file of {{'text': ...}}.")
    return data


def read_documents(data: Path, text_key: str = "text") -> list[str]:
    """A ``.jsonl`` file's ``text_key`` fields, one document per line; any other file is one document."""
    if data.suffix != ".jsonl":
        return [data.read_text(encoding="utf-8")]
    documents = []
    for number, line in enumerate(data.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"'{data}' line {number} is not JSON ({error})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"'{data}' line {number} has no string field {text_key!r} (it has {keys}); see --text_key")
        documents.append(record[text_key])
    if not documents:
        raise ValueError(f"'{data}' holds no records")
    return documents


def train_and_validation_tokens(
    documents: list[str], tokenizer: TextTokenizer, val_fraction: float, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All documents' ids in one stream, split: the first ``1 - val_fraction`` trains, the rest validates."""
    tokens = torch.tensor([token for document in documents for token in tokenizer.encode(document)], dtype=torch.long)
    split = int(len(tokens) * (1 - val_fraction))
    train, val = tokens[:split], tokens[split:]
    if len(train) <= seq_len + 1 or len(val) < seq_len + 1:
        raise ValueError(
            f"the data gives {len(tokens)} tokens: {len(train)} to train on and {len(val)} to validate, but each split"
            f" needs more than --seq_len + 1 = {seq_len + 1}. Use more data, a smaller --seq_len or another"
            " --val_fraction."
        )
    return train, val


def validation_windows(val_tokens: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping ``(seq_len + 1)``-token windows from the start of the validation split (at most max_windows)."""
    count = min(max_windows, (len(val_tokens) - 1) // seq_len)
    return torch.stack([val_tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)])


def train_batch(tokens: torch.Tensor, step: int, rank: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Random windows that depend only on (seed, step, rank), so a resumed run sees the data it would have seen."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[start : start + seq_len + 1] for start in starts.tolist()])


def loss_sum(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of the windows (float64), and thus exact to average over any split."""
    logits = logits_of(model, windows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten(), reduction="sum").double()


def part_logits(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """:func:`logits_of` a rank's part of each sequence under context parallelism: a transformers model takes its
    tokens' position ids; litgpt's ``GPT`` takes none (the strategy knows a rank's positions, one document each)."""
    if hasattr(getattr(model, "config", None), "use_cache"):
        return model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits
    return model(tokens)


def context_parallel_loss(strategy: HybridFSDPStrategy, model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Under ``context_parallel_size > 1``: this rank's share of the windows' mean next-token loss, computed on its
    part of each sequence (``strategy.shard_sequence``); the context group's shares add up to the mean."""
    tokens, labels, position_ids = strategy.shard_sequence(windows[:, :-1], windows[:, 1:])
    logits = part_logits(model, tokens, position_ids)
    return strategy.cross_entropy(logits, labels)


def windows_loss(strategy: HybridFSDPStrategy, model: nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(summed next-token loss in float64, tokens)`` of this rank's part of the windows: all of them, or under
    context parallelism its part of each sequence (summed over the context group each token counts once)."""
    if strategy.topology.context_parallel_size == 1:
        return loss_sum(model, windows), windows[:, 1:].numel()
    tokens, labels, position_ids = strategy.shard_sequence(windows[:, :-1], windows[:, 1:])
    logits = part_logits(model, tokens, position_ids)
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").double()
    return total, labels.numel()


@torch.no_grad()
def probe_logits(fabric: L.Fabric, model: nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """The ``(1, length, vocab)`` logits of one probe sequence on CPU, for ``examples/check_export.py``; under
    context parallelism each rank computes its part and the context group gathers the whole sequence."""
    model.eval()
    strategy = fabric.strategy
    context = strategy.parallel_mesh.context
    if context is None:
        logits = logits_of(model, probe).float().cpu()
    else:
        step = 2 * context.size()
        probe = probe[:, : max(step, probe.shape[1] // step * step)]
        tokens, position_ids = strategy.shard_sequence(probe)
        part = part_logits(model, tokens, position_ids).float()
        group = context.get_group()
        gathered = fabric.all_gather(part, group=group).transpose(0, 1).flatten(1, 2)  # (1, length, vocab)
        positions = fabric.all_gather(position_ids, group=group).transpose(0, 1).flatten(1)
        logits = gathered[:, positions[0].argsort()].cpu()
    model.train()
    return logits


# --- memory, checkpoints, export --------------------------------------------------------------------------------------


def peak_memory(device: torch.device) -> tuple[int, str]:
    """``(bytes, what was measured)``: CUDA's peak allocation on a GPU, the process's peak RSS (VmHWM) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak GPU memory (torch.cuda.max_memory_allocated)"
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024, "peak RSS (VmHWM of /proc/self/status)"
    return 0, "peak memory (unknown on this OS)"


def export_model(
    checkpoint: Path, fmt: Format, checkpoint_dir: Path, export_dir: Path, max_shard_size: str, tied: set[str]
) -> str:
    """Write the model of a sharded checkpoint in the source's format; one process, one tensor in memory at a time.

    Each tensor is written in its dtype in ``checkpoint_dir``'s weights (fine-tuning may hold fp32 master weights of
    a bf16 model); second names of tied tensors (``tied``) only if the source has them. The non-weight files of
    ``checkpoint_dir`` (configs, tokenizer) are copied next to the weights.

    Returns:
        What was written, for the log.
    """
    from fabric_hsdp.checkpoint import LazyTensor, atomic_output, open_checkpoint, write_safetensors, write_torch_file

    with open_checkpoint(weights_of(fmt, checkpoint_dir)) as source:
        source_dtypes = {name: source.tensor_info(name).dtype for name in source}
    side_files = {
        entry.name: entry
        for entry in sorted(checkpoint_dir.iterdir())
        if entry.is_file() and not entry.name.startswith(".") and not entry.name.endswith(WEIGHT_SUFFIXES)
    }

    def in_source_dtype(tensor: LazyTensor) -> LazyTensor:
        dtype = source_dtypes.get(tensor.name, tensor.dtype)
        if dtype == tensor.dtype or not dtype.is_floating_point:
            return tensor
        return LazyTensor(tensor.name, tensor.shape, dtype, lambda: tensor.read().to(dtype))

    with open_checkpoint(checkpoint) as trained:
        tensors = {
            name: in_source_dtype(lazy)
            for name, lazy in trained.lazy_tensors().items()
            if name not in tied or name in source_dtypes
        }
        if fmt == "litgpt":
            with atomic_output(export_dir, overwrite=True) as staging:
                staging.mkdir()
                write_torch_file(staging / "lit_model.pth", tensors)
                for name, file in side_files.items():
                    shutil.copyfile(file, staging / name)
            weights = ["lit_model.pth"]
        else:
            written = write_safetensors(
                export_dir, tensors, max_shard_size=max_shard_size, extra_files=side_files, overwrite=True
            )
            weights = [path.name for path in written]
    return f"{len(tensors)} tensors in {weights}, with {sorted(side_files)}"


# --- the job ----------------------------------------------------------------------------------------------------------


@dataclass
class Parallelism:
    """How the model is spread over the ranks; every field goes to ``HybridFSDPStrategy`` as it is.

    Attributes:
        shard_size: ``node`` (HSDP: shard within a node, replicate across nodes), ``world`` (FSDP over all ranks) or
            a number of ranks (e.g. 16: two 8-GPU nodes hold one copy of a model too large for one).
        activation_checkpointing: Recompute each layer's activations in backward (less memory, ~30% more compute).
        load_mode: How the consolidated checkpoint is read: ``slice`` (each rank reads its own shard), ``turns`` or
            ``rank0`` (docs/loading.md).
        async_save: Write checkpoints in the background while training goes on.
        tensor_parallel_size: Ranks of one node that split each layer (tensor parallelism; 1: none).
        context_parallel_size: Ranks of one node that split each sequence (context parallelism; 1: none): they take
            the same batch, each computes on ``seq_len / C`` of its tokens.
    """

    shard_size: Literal["node", "world"] | int = "node"
    activation_checkpointing: bool = False
    load_mode: Literal["slice", "turns", "rank0"] = "slice"
    async_save: bool = False
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1


def make_strategy(parallel: Parallelism, layers: ModuleListLayers) -> HybridFSDPStrategy:
    """The strategy: one ``fully_shard`` unit per layer of the model's ``nn.ModuleList``s (``sharded_modules=None``).

    A new strategy option (e.g. ``tensor_parallel_size``) is one field of :class:`Parallelism` passed on here: the
    data order and the validation split follow the strategy's data-parallel ranks, and the export reads the sharded
    checkpoint, which stores full tensor shapes however the ranks split them.
    """
    return HybridFSDPStrategy(
        sharded_modules=None,
        shard_size=parallel.shard_size,
        activation_checkpointing=layers if parallel.activation_checkpointing else None,
        load_mode=parallel.load_mode,
        async_save=parallel.async_save,
        tensor_parallel_size=parallel.tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
    )


def layout_line(topology: Any) -> str:
    """The start-up line's layout: ranks, nodes, and the mesh with every dim's name (three under TP)."""
    return (
        f"{topology.world_size} ranks = {topology.num_nodes} node(s) x {topology.ranks_per_node},"
        f" mesh ({', '.join(topology.mesh_dim_names)}) = {topology.mesh_shape}"
    )


def main(
    checkpoint_dir: Path,
    data: Path = Path("examples/data/tiny.txt"),
    out_dir: Path = Path("out/finetune"),
    text_key: str = "text",
    val_fraction: float = 0.1,
    max_val_windows: int = 32,
    max_steps: int = 20,
    batch_size: int = 4,
    seq_len: int = 64,
    learning_rate: float = 1e-3,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    log_every: int = 1,
    eval_every: int = 0,
    save_every: int = 10,
    keep_last: int = 0,
    resume: bool | str = True,
    requeue: bool = False,
    grad_accumulation: int = 1,
    export: bool = True,
    export_max_shard_size: str = "5GB",
    parallel: Parallelism = Parallelism(),  # noqa: B008 - jsonargparse copies the default
    lora_r: int = 0,
    lora_alpha: int = 16,
    accelerator: str = "auto",
    devices: int | str = "auto",
    num_nodes: int | None = None,
    precision: str | None = None,
    seed: int = 42,
) -> None:
    """Fine-tune a litgpt or transformers checkpoint with HSDP, save sharded checkpoints, export in its format.

    Args:
        checkpoint_dir: A litgpt checkpoint directory (``lit_model.pth`` + ``model_config.yaml``) or a transformers
            directory (``config.json`` + safetensors); its tokenizer files are used when present.
        data: A text file, or a ``.jsonl`` file with one ``{"text": ...}`` object per line (relative paths are also
            tried from the repository root).
        out_dir: Holds ``checkpoints/step-<N>`` (resumed from), ``export/`` and ``export_check.pt``.
        text_key: The field of each JSONL record that holds its text.
        val_fraction: The last part of the token stream held out for the validation loss.
        max_val_windows: Validation sequences of ``seq_len`` tokens at most (from the start of the held-out part).
        max_steps: Optimizer steps in total (a resumed run continues up to this number).
        batch_size: Sequences per rank per step (also per rank per validation forward).
        seq_len: Tokens per sequence (at most the model's context length).
        learning_rate: AdamW's peak learning rate.
        warmup_steps: Steps of linear warm-up to ``learning_rate`` (computed from the step, so resuming keeps it).
        weight_decay: AdamW weight decay.
        grad_clip: Clip the gradient norm to this; 0 turns clipping off.
        log_every: Log loss, tokens/s and peak memory every this many steps.
        eval_every: Also compute the validation loss every this many steps (0: before training and at the end only).
        save_every: Save a sharded checkpoint every this many steps (0: only at the end); the last step is always saved.
        keep_last: Keep only the newest this many checkpoints (0: all).
        resume: ``true``: continue from the newest complete ``checkpoints/step-<N>`` in ``out_dir`` if there is one;
            a path: from that checkpoint; ``false``: start from ``checkpoint_dir``'s weights.
        requeue: On SIGUSR1/SIGTERM, after saving, requeue the SLURM batch job (``scontrol requeue``).
        grad_accumulation: Micro-batches per optimizer step (global batch = batch_size x data-parallel ranks x this).
        export: At the end, write the model in the source's format to ``out_dir/export`` (see the module docstring).
        export_max_shard_size: Largest safetensors file of a transformers export (larger models get an index).
        parallel: Sharding options (``--parallel.shard_size``, ``--parallel.activation_checkpointing``, ...).
        lora_r: Rank of LoRA adapters on every linear layer of the blocks, the base frozen (0: fine-tune every
            weight). Checkpoints then hold the adapters and their optimizer state only (resumed onto the base read
            from ``checkpoint_dir``), and the export is the adapters in the library's format: a peft adapter
            directory (``PeftModel.from_pretrained``) or litgpt's ``lit_model.pth.lora``.
        lora_alpha: LoRA's scaling numerator (the update is scaled by ``lora_alpha / lora_r``).
        accelerator: ``cpu``, ``cuda`` or ``auto``.
        devices: Ranks per node; ``auto`` takes torchrun's/srun's/mpirun's value, or ``fabric run --devices``.
        num_nodes: Nodes; unset takes the launcher's value (or ``fabric run --num-nodes``), else 1.
        precision: Fabric precision, e.g. ``bf16-mixed`` on GPUs (fp32 master weights); unset: ``32-true``.
        seed: Seed of the data order.
    """
    fmt = detect_format(checkpoint_dir)
    data = resolve_data(data)
    layers = ModuleListLayers()
    strategy = make_strategy(parallel, layers)
    devices, num_nodes = devices_and_nodes(devices, num_nodes)
    fabric = L.Fabric(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision
    )
    if not launched_by_fabric_cli():
        fabric.launch()  # under `fabric run`, Fabric() has set up the processes and launch() would raise
    say(fabric, f"{layout_line(strategy.topology)}, device {fabric.device}, precision {strategy.precision_name}")
    for directory in (out_dir, out_dir / "checkpoints"):  # unwritable: found now, not at the first save
        strategy.check_writable(directory)

    started = time.perf_counter()
    with fabric.init_module(empty_init=True):
        model = build_model(fmt, checkpoint_dir, lora_r, lora_alpha)
    layer_names = layers.find(model)
    tied = tied_aliases(model)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapters = set(adapter_keys(model))
    say(
        fabric,
        f"{fmt} model from '{checkpoint_dir}': {type(model).__name__}, {parameters:,} parameters, built on the meta"
        f" device; layers found for sharding (the layers of its nn.ModuleLists): {layers.count} x {layer_names}"
        + (", with activation checkpointing" if parallel.activation_checkpointing else "")
        + (
            f"; LoRA r={lora_r}: {trainable:,} trainable parameters in {len(adapters)} adapter tensors"
            if lora_r
            else ""
        ),
    )
    # LoRA: checkpoints hold the adapters (and their optimizer state) only; the base is read from checkpoint_dir
    adapters_only = {"model": lambda name, value: name in adapters} if lora_r else None
    tokenizer = load_tokenizer(fmt, checkpoint_dir, vocab_size_of(model))
    say(fabric, f"tokenizer: {tokenizer.describe()}")
    context = getattr(model.config, "block_size", None) or getattr(model.config, "max_position_embeddings", seq_len)
    if seq_len > context:
        raise ValueError(f"--seq_len {seq_len} exceeds the model's context length {context}")
    if seq_len % (2 * parallel.context_parallel_size) and parallel.context_parallel_size > 1:
        raise ValueError(
            f"--seq_len {seq_len} does not split into 2 x --parallel.context_parallel_size"
            f" ({parallel.context_parallel_size}) equal chunks: pass a multiple of {2 * parallel.context_parallel_size}"
        )
    train_tokens, val_tokens = train_and_validation_tokens(
        read_documents(data, text_key), tokenizer, val_fraction, seq_len
    )
    windows = validation_windows(val_tokens, seq_len, max_val_windows)
    say(
        fabric,
        f"data '{data}': {len(train_tokens):,} training tokens, {len(val_tokens):,} validation tokens"
        f" ({len(windows)} sequences of {seq_len} for the validation loss)",
    )

    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=learning_rate, weight_decay=weight_decay
        )
    )
    data_rank, data_ranks = data_parallel_rank(fabric)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0, "source": str(checkpoint_dir)}
    state.update(data_parallel_size=data_ranks, global_batch=batch_size * data_ranks * grad_accumulation)
    checkpoints = out_dir / "checkpoints"
    checkpoint = resume_from(fabric, checkpoints, resume)
    if checkpoint is not None:
        # a LoRA run's checkpoints hold its adapters only
        saved = {name: shape for name, shape in shapes.items() if name in adapters} if lora_r else shapes
        note = check_same_model(checkpoint, checkpoint_dir, saved, tied, chosen=resume not in (True, "true", "True"))
        if note:
            say(fabric, note)
        begun = time.perf_counter()
        if lora_r:  # an adapter-only checkpoint: the frozen base from its own checkpoint first
            fabric.load_raw(weights_of(fmt, checkpoint_dir), model)
        fabric.load(checkpoint, state, strict=not lora_r)
        say(fabric, f"resumed from {checkpoint} (step {state['step']}) in {time.perf_counter() - begun:.2f} s")
        grad_accumulation = keep_global_batch(fabric, state, batch_size, data_ranks, grad_accumulation)
    else:
        begun = time.perf_counter()
        fabric.load_raw(weights_of(fmt, checkpoint_dir), model)
        say(
            fabric,
            f"loaded {weights_of(fmt, checkpoint_dir)} into the shards (load_mode={parallel.load_mode}: each rank"
            f" reads only its own shard's elements) in {time.perf_counter() - begun:.2f} s",
        )
    memory, memory_label = peak_memory(fabric.device)
    say(
        fabric,
        f"ready in {time.perf_counter() - started:.1f} s; {memory_label}, max over ranks:"
        f" {_all_ranks_max(fabric, memory) / 2**20:,.0f} MiB",
    )

    def validate(step: int) -> float:
        begun = time.perf_counter()
        loss = evaluate(fabric, model, windows, batch_size)
        say(fabric, f"step {step}: val loss {loss:.6f} ({time.perf_counter() - begun:.2f} s)")
        return loss

    saved: list[Path] = []

    def save(step: int) -> Path:
        path = checkpoints / f"step-{step:06d}"
        begun = time.perf_counter()
        state["step"] = step
        if parallel.async_save and saved:
            strategy.wait_for_checkpoint()  # the previous one is committed: it may become `latest`
            retain(fabric, checkpoints, saved[-1], keep_last)
        fabric.save(path, state, filter=adapters_only)
        saved.append(path)
        if not parallel.async_save:
            retain(fabric, checkpoints, path, keep_last)
        verb = "saving in the background" if parallel.async_save else "saved"
        say(fabric, f"step {step}: {verb} {path} ({time.perf_counter() - begun:.2f} s)")
        return path

    initial_loss = validate(0) if state["step"] == 0 else None
    tokens_per_step = batch_size * seq_len * data_ranks * grad_accumulation
    window_seconds, window_steps = 0.0, 0  # training steps only: saves and validation are timed on their own
    preemption = Preemption(requeue=requeue)  # while training, SIGUSR1/SIGTERM stop at the next step boundary
    for step in range(state["step"] + 1, max_steps + 1):
        step_started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate * min(1.0, step / warmup_steps) if warmup_steps else learning_rate
        for micro in range(grad_accumulation):
            # the data of a micro-batch depends on its place in the global batch, not on the layout
            index = (step * grad_accumulation + micro) if grad_accumulation > 1 else step
            batch = train_batch(train_tokens, index, data_rank, batch_size, seq_len, seed).to(fabric.device)
            if parallel.context_parallel_size > 1:
                loss = context_parallel_loss(strategy, model, batch)
            else:
                loss = loss_sum(model, batch) / batch[:, 1:].numel()
            fabric.backward(loss / grad_accumulation)
        if grad_clip > 0:
            fabric.clip_gradients(model, optimizer, max_norm=grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        window_seconds, window_steps = window_seconds + time.perf_counter() - step_started, window_steps + 1
        if step % log_every == 0 or step == max_steps:
            seconds = window_seconds / window_steps
            # under context parallelism a rank's loss is its share of its group's mean: C x the mean over ranks
            mean_loss = fabric.all_reduce(loss.detach().float(), reduce_op="mean").item()
            mean_loss *= parallel.context_parallel_size
            say(
                fabric,
                f"step {step}/{max_steps}: train loss {mean_loss:.4f}, {seconds:.2f} s/step,"
                f" {tokens_per_step / seconds:,.0f} tokens/s (all ranks), {memory_label} max over ranks"
                f" {_all_ranks_max(fabric, peak_memory(fabric.device)[0]) / 2**20:,.0f} MiB",
            )
            window_seconds, window_steps = 0.0, 0
        if eval_every > 0 and step % eval_every == 0 and step != max_steps:
            validate(step)
        if save_every > 0 and step % save_every == 0 and step != max_steps:
            save(step)
        if step != max_steps and preemption.stop_requested(fabric):  # one all-reduce: every rank stops here
            if not saved or saved[-1].name != f"step-{step:06d}":
                save(step)
            strategy.wait_for_checkpoint()
            retain(fabric, checkpoints, saved[-1], keep_last)
            requeued = preemption.requeue(fabric)  # rank 0 runs scontrol and says so
            say(fabric, f"stopped at step {step} on a signal; {'requeued' if requeued else 'not requeued'}")
            preemption.close()
            return
    preemption.close()
    state["step"] = max(state["step"], max_steps)
    final = checkpoints / f"step-{max_steps:06d}"
    if why_incomplete(final) is not None:
        final = save(max_steps)
    final_loss = validate(max_steps)
    strategy.wait_for_checkpoint()  # a save still in the background: committed here, or its failure raised
    retain(fabric, checkpoints, final, keep_last)
    say(fabric, f"done: fine-tuned val loss {final_loss:.6f}")
    if export:
        validation = {
            "data": str(data.resolve()),
            "text_key": text_key,
            "val_fraction": val_fraction,
            "seq_len": seq_len,
        }
        validation.update(max_val_windows=max_val_windows, batch_size=batch_size)
        validation.update(val_loss=final_loss, val_loss_before=initial_loss)
        if lora_r:
            validation.update(lora=lora_settings(lora_r, lora_alpha))
            export_adapters_and_record(fabric, model, fmt, checkpoint_dir, out_dir, windows, validation, state["step"])
        else:
            export_and_record(
                fabric, model, final, fmt, checkpoint_dir, out_dir, windows, validation, export_max_shard_size, tied
            )


def export_and_record(
    fabric: L.Fabric,
    model: nn.Module,
    checkpoint: Path,
    fmt: Format,
    checkpoint_dir: Path,
    out_dir: Path,
    windows: torch.Tensor,
    validation: dict[str, Any],
    max_shard_size: str,
    tied: set[str],
) -> None:
    """Rank 0 exports the final checkpoint and records what the fine-tuned model computes, for the export's check.

    ``<out_dir>/export_check.pt`` holds the validation settings and loss (``validation``), and the fine-tuned model's
    logits for the first tokens of the first validation window: ``examples/check_export.py`` compares both with the
    export reloaded by the library that owns its format.

    The export reads the last *sharded* checkpoint (which the job writes anyway) in one process, one tensor at a time:
    rank 0's memory is bounded by the largest tensor, no rank all-gathers anything onto its device (a full export
    from the live model would gather every tensor, e.g. a 128k-row embedding, onto every GPU while the optimizer
    state is still there), and it can be repeated offline if it fails.
    """
    probe = windows[:1, : min(32, windows.shape[1] - 1)].to(fabric.device)
    logits = probe_logits(fabric, model, probe)
    probe = probe[:, : logits.shape[1]]
    outcome = "ok"
    error: BaseException | None = None
    if fabric.global_rank == 0:
        begun = time.perf_counter()
        try:
            written = export_model(checkpoint, fmt, checkpoint_dir, out_dir / "export", max_shard_size, tied)
            record = {"format": fmt, "export": str(out_dir / "export"), "tokens": probe.cpu(), "logits": logits}
            record.update(validation=validation, step=int(checkpoint.name.split("-")[1]), source=str(checkpoint_dir))
            torch.save(record, out_dir / EXPORT_CHECK)
            say(
                fabric,
                f"exported {checkpoint.name} to {out_dir / 'export'} ({fmt} format): {written}"
                f" in {time.perf_counter() - begun:.2f} s",
            )
        except Exception as caught:  # every rank must learn of it, or the others wait in the broadcast below
            error, outcome = caught, f"{type(caught).__name__}: {caught}"
    outcome = fabric.broadcast(outcome)
    if error is not None:
        raise error
    if outcome != "ok":
        raise RuntimeError(f"the export failed on rank 0: {outcome}")


def export_adapters_and_record(
    fabric: L.Fabric,
    model: nn.Module,
    fmt: Format,
    checkpoint_dir: Path,
    out_dir: Path,
    windows: torch.Tensor,
    validation: dict[str, Any],
    step: int,
) -> None:
    """LoRA: every rank exports the live model's adapters (each gathered whole; rank 0 writes) to
    ``<out_dir>/export``, a peft adapter directory or a directory with litgpt's ``lit_model.pth.lora``; rank 0
    records the fine-tuned logits for ``examples/check_export.py``, which loads the base from ``checkpoint_dir`` and
    the adapters with peft or litgpt."""
    from fabric_hsdp.adapters import export_litgpt_adapter, export_peft_adapter

    probe = windows[:1, : min(32, windows.shape[1] - 1)].to(fabric.device)
    logits = probe_logits(fabric, model, probe)
    probe = probe[:, : logits.shape[1]]
    begun = time.perf_counter()
    export_dir = out_dir / "export"
    if fmt == "transformers":
        export_peft_adapter(model, export_dir)
    else:
        if fabric.global_rank == 0:
            shutil.rmtree(export_dir, ignore_errors=True)
            export_dir.mkdir(parents=True)
        fabric.barrier()
        export_litgpt_adapter(model, export_dir / "lit_model.pth.lora")
    if fabric.global_rank == 0:
        record = {"format": fmt, "export": str(export_dir), "tokens": probe.cpu(), "logits": logits}
        record.update(validation=validation, step=step, source=str(checkpoint_dir))
        torch.save(record, out_dir / EXPORT_CHECK)
        written = sorted(path.name for path in export_dir.iterdir())
        say(fabric, f"exported the adapters to {export_dir} ({fmt}): {written} in {time.perf_counter() - begun:.2f} s")
    fabric.barrier()


@torch.no_grad()
def evaluate(fabric: L.Fabric, model: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over all validation windows, split over the ranks (each window counted once).

    Every rank runs the same number of forwards (FSDP gathers parameters collectively); a rank with fewer windows
    repeats one and counts it zero times. Under context parallelism each rank sums the loss over its part of each
    window and counts its part's tokens: the sums over all ranks hold every token once per context group.
    """
    model.eval()
    data_rank, data_ranks = data_parallel_rank(fabric)
    mine = windows[data_rank::data_ranks]
    forwards = math.ceil(math.ceil(len(windows) / data_ranks) / batch_size)
    total = torch.zeros(2, dtype=torch.float64, device=fabric.device)
    for index in range(forwards):
        batch = mine[index * batch_size : (index + 1) * batch_size]
        if len(batch):
            loss, tokens = windows_loss(fabric.strategy, model, batch.to(fabric.device))
            total[0] += loss
            total[1] += tokens
        else:  # under context parallelism the group's peers hold no window either: they run this forward together
            windows_loss(fabric.strategy, model, windows[:1].to(fabric.device))
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")  # ranks that share a batch count it alike: the ratio holds
    return (total[0] / total[1]).item()


def resume_from(fabric: L.Fabric, checkpoints: Path, resume: bool | str) -> Path | None:
    """The checkpoint to resume: ``--resume PATH`` (must be complete), the newest complete one, or None.

    Raises:
        FileNotFoundError: ``--resume PATH`` is not a complete checkpoint (the reason is in the message).
    """
    if resume is False or resume in ("false", "False"):
        return None
    if resume is not True and resume not in ("true", "True"):
        path = Path(resume)
        reason = why_incomplete(path)
        if reason is not None:
            raise FileNotFoundError(f"--resume '{path}' is not a checkpoint to resume from: {reason}")
        return path
    checkpoint, skipped = newest_complete(checkpoints)
    for line in skipped:
        say(fabric, line)
    return checkpoint


def check_same_model(
    checkpoint: Path,
    checkpoint_dir: Path,
    shapes: dict[str, tuple[int, ...]],
    tied: set[str] = frozenset(),
    chosen: bool = False,
) -> str | None:
    """Stop before resuming ``checkpoint`` if it holds another model than ``checkpoint_dir``'s; name both.

    Another model: other tensor names or shapes than ``shapes`` (the model's state dict; the second names of tied
    weights, ``tied``, may be absent), or, for the checkpoint found in ``--out_dir`` (not ``chosen`` with ``--resume
    PATH``), another ``--checkpoint_dir`` than the one it was saved fine-tuning. Returns a line for the log when a
    chosen checkpoint was saved from another directory with the same tensors, else ``None``.

    Raises:
        CheckpointError: the checkpoint is of another model (read on every rank alike: every rank raises it).
    """
    from fabric_hsdp.checkpoint import open_checkpoint
    from fabric_hsdp.errors import CheckpointError

    with open_checkpoint(checkpoint) as saved:
        stored = {name: tuple(saved.tensor_info(name).shape) for name in saved}
        source = saved.extras(lazy=True).get("source")
    ours = f"--checkpoint_dir '{checkpoint_dir}' ({len(shapes)} tensors)"
    theirs = f"'{source}'" if source else "a model it does not name"
    missing = [name for name in shapes if name not in stored and name not in tied]
    unexpected = [name for name in stored if name not in shapes]
    differences = [
        f"'{name}' {list(shapes[name])} in the model, {list(stored[name])} in the checkpoint"
        for name in shapes
        if name in stored and stored[name] != shapes[name]
    ]
    same_tensors = not (missing or unexpected or differences)
    same_directory = source is None or Path(source).resolve() == checkpoint_dir.resolve()
    if same_tensors and same_directory:
        return None
    if same_tensors and chosen:
        return f"resuming {checkpoint}, saved fine-tuning '{source}': the same tensor names and shapes as {ours}"
    found = []
    if missing:
        found.append(f"{len(missing)} of the model's tensors are not in it (e.g. '{missing[0]}')")
    if unexpected:
        found.append(f"it has {len(unexpected)} tensors the model does not (e.g. '{unexpected[0]}')")
    if differences:
        found.append(f"{len(differences)} differ in shape (e.g. {differences[0]})")
    what = "; ".join(found) or "the same tensor names and shapes, from another directory"
    anyway = f" If it is the same model, moved: --resume {checkpoint}." if same_tensors else ""
    raise CheckpointError(
        f"checkpoint '{checkpoint}' holds another model: it was saved fine-tuning {theirs} ({len(stored)} tensors),"
        f" not {ours}; {what}. Pass another --out_dir, --resume false to start from --checkpoint_dir's weights, or"
        f" the --checkpoint_dir it was saved from to go on with that model.{anyway}"
    )


def keep_global_batch(
    fabric: L.Fabric, state: dict[str, Any], batch_size: int, data_ranks: int, accumulate: int
) -> int:
    """The gradient accumulation that keeps the saved run's global batch on ``data_ranks`` ranks (or ``accumulate``).

    The global batch is ``batch_size x data-parallel ranks x accumulation``; a new layout (more nodes, tensor
    parallelism) changes the data-parallel ranks. The log says what changed either way.
    """
    saved_ranks, saved_batch = int(state["data_parallel_size"]), int(state["global_batch"])
    current = batch_size * data_ranks * accumulate
    if saved_ranks == data_ranks and saved_batch == current:
        return accumulate
    if saved_batch % (batch_size * data_ranks) == 0:
        adjusted = saved_batch // (batch_size * data_ranks)
        say(
            fabric,
            f"data-parallel ranks {saved_ranks} -> {data_ranks}: gradient accumulation {accumulate} -> {adjusted}"
            f" keeps the global batch of {saved_batch} sequences",
        )
        state["data_parallel_size"] = data_ranks
        return adjusted
    say(
        fabric,
        f"data-parallel ranks {saved_ranks} -> {data_ranks}: the global batch changes from {saved_batch} to"
        f" {current} sequences ({saved_batch} is no multiple of batch_size {batch_size} x {data_ranks} ranks; pass"
        " --batch_size and --grad_accumulation that multiply to it)",
    )
    state["data_parallel_size"], state["global_batch"] = data_ranks, current
    return accumulate


def retain(fabric: L.Fabric, checkpoints: Path, newest: Path, count: int) -> None:
    """Rank 0: point ``latest`` at ``newest`` and delete all but the newest ``count`` (after every rank saved)."""
    fabric.barrier()
    if fabric.global_rank == 0:
        point_latest(checkpoints, newest)
        for removed in keep_last(checkpoints, count):
            say(fabric, f"removed {removed} (--keep_last {count})")
    fabric.barrier()


def data_parallel_rank(fabric: L.Fabric) -> tuple[int, int]:
    """``(this rank's data-parallel index, data-parallel ranks)``: which data a rank sees, from the strategy.

    Under HSDP every rank is its own data-parallel rank; ranks that hold parts of the same layers (tensor parallelism)
    must see the same batch, and the strategy's ``distributed_sampler_kwargs`` says so.
    """
    sampler = fabric.strategy.distributed_sampler_kwargs
    return sampler["rank"], sampler["num_replicas"]


def _all_ranks_max(fabric: L.Fabric, value: int) -> int:
    return int(
        fabric.all_reduce(torch.tensor(value, dtype=torch.float64, device=fabric.device), reduce_op="max").item()
    )


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
