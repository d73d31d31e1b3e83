"""Train a small LLaMA-style model with ``HybridFSDPStrategy``: sharded checkpoints, resume, raw-weight init.

Runs on CPU with no arguments (a 4-layer model on ``examples/data/tiny.txt``, byte-level tokens, under a minute):

    # one node, two ranks
    fabric run --accelerator cpu --devices 2 examples/train.py
    # two simulated nodes x two ranks on this machine: start both (two shells), same port
    fabric run --accelerator cpu --devices 2 --num-nodes 2 --node-rank 0 --main-address 127.0.0.1 --main-port 29500 \
        examples/train.py
    fabric run --accelerator cpu --devices 2 --num-nodes 2 --node-rank 1 --main-address 127.0.0.1 --main-port 29500 \
        examples/train.py
    # torchrun (or SLURM's srun): --devices/--num_nodes default to what the launcher started
    torchrun --nproc-per-node 2 examples/train.py
    # plain python: Fabric starts the --devices processes itself
    python examples/train.py --devices 2 --accelerator cpu

Every ``--save_every`` steps (and at the end) it writes ``<out_dir>/step-<N>``, a sharded DCP directory written by all
ranks in parallel. Started again with the same ``--out_dir`` it resumes from the newest one, on any topology.
``--init_from PATH`` fills the freshly sharded model from consolidated weights (a state-dict ``.pth``, a
``.safetensors`` file, a Hugging Face directory or a DCP directory) without a full copy per rank (``--load_mode``).

Options: ``python examples/train.py --help``; a YAML file: ``--config examples/configs/tiny.yaml``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import lightning as L
import torch

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES.parent))  # `examples.tiny_llama` without installing the examples

from examples.launching import (  # noqa: E402
    devices_and_nodes,
    latest_checkpoint,
    launched_by_fabric_cli,
    say,
    write_report,
)
from examples.tiny_llama import Block, Llama, LlamaConfig, loss_fn  # noqa: E402
from fabric_hsdp import HybridFSDPStrategy  # noqa: E402


def load_tokens(data: str, vocab_size: int) -> torch.Tensor:
    """Byte-level tokens of a text file (vocab 256), or ``"synthetic"``: 64 Ki random tokens from a fixed seed."""
    if data == "synthetic":
        return torch.randint(0, vocab_size, (1 << 16,), generator=torch.Generator().manual_seed(1234))
    path = Path(data)
    if not path.is_absolute() and not path.exists():
        path = EXAMPLES.parent / path
    if not path.is_file():
        raise FileNotFoundError(f"--data {data!r}: no such file. Pass a text file or --data synthetic.")
    if vocab_size < 256:
        raise ValueError(f"byte-level tokens need --model.vocab_size >= 256, got {vocab_size}")
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def batch_for(tokens: torch.Tensor, step: int, rank: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Random windows that depend only on (seed, step, rank), so a resumed run sees the data it would have seen."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[start : start + seq_len + 1] for start in starts.tolist()])


def main(
    out_dir: Path = Path("out/train"),
    data: str = "examples/data/tiny.txt",
    model: LlamaConfig = LlamaConfig(n_layers=4),  # noqa: B008 - a frozen default, jsonargparse copies it
    max_steps: int = 40,
    batch_size: int = 8,
    seq_len: int = 64,
    learning_rate: float = 3e-3,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    log_every: int = 10,
    save_every: int = 20,
    async_save: bool = False,
    resume: bool = True,
    init_from: Path | None = None,
    load_mode: Literal["slice", "turns", "rank0"] = "slice",
    shard_size: Literal["node", "world"] | int = "node",
    activation_checkpointing: bool = False,
    accelerator: str = "auto",
    devices: int | str = "auto",
    num_nodes: int | None = None,
    precision: str | None = None,
    seed: int = 42,
    report_dir: Path | None = None,
) -> None:
    """Train the tiny LLaMA with HSDP.

    Args:
        out_dir: Where ``step-<N>`` checkpoints go; resumes from the newest one found here.
        data: A text file (byte-level tokens, relative paths are also tried from the repository root) or
            ``synthetic``.
        model: The model's shape (``--model.dim``, ``--model.n_layers``, ...).
        max_steps: Optimizer steps in total (a resumed run continues up to this number).
        batch_size: Sequences per rank per step.
        seq_len: Tokens per sequence (at most ``model.max_seq_len``).
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        grad_clip: Clip the gradient norm to this; 0 turns clipping off.
        log_every: Print the loss every this many steps.
        save_every: Save a sharded checkpoint every this many steps (0: only at the end).
        async_save: Write checkpoints in the background while training goes on (``fabric.save`` returns once the
            shards are copied to CPU memory); each appears in ``out_dir`` when complete.
        resume: Resume from the newest checkpoint in ``out_dir`` if there is one.
        init_from: Consolidated weights to start from (``.pth`` state dict, ``.safetensors``, HF or DCP directory);
            ignored when resuming.
        load_mode: How ``--init_from`` is read: ``slice`` (each rank reads its own shard), ``turns`` (local ranks
            take turns) or ``rank0`` (rank 0 reads and sends). See docs/loading.md.
        shard_size: ``node`` (HSDP: shard within a node), ``world`` (FSDP over all ranks) or a number of ranks.
        activation_checkpointing: Recompute each transformer block's activations in backward.
        accelerator: ``cpu``, ``cuda`` or ``auto``.
        devices: Ranks per node; ``auto`` takes torchrun's/srun's value, or the ``fabric run --devices`` value.
        num_nodes: Nodes; unset takes torchrun's/srun's value (or ``fabric run --num-nodes``), else 1.
        precision: Fabric precision, e.g. ``bf16-mixed`` on GPUs; unset = ``32-true``.
        seed: Seed of the initial weights and of the data order.
        report_dir: Each rank writes ``rank<R>.json`` here: the launcher and cluster environment, its ranks, host,
            device and mesh coordinates, at start-up and again at the end. For checking a new cluster's launch.
    """
    if seq_len > model.max_seq_len:
        raise ValueError(f"--seq_len {seq_len} exceeds --model.max_seq_len {model.max_seq_len}")
    devices, num_nodes = devices_and_nodes(devices, num_nodes)
    strategy = HybridFSDPStrategy(
        sharded_modules={Block},
        shard_size=shard_size,
        activation_checkpointing={Block} if activation_checkpointing else None,
        load_mode=load_mode,
        async_save=async_save,
    )
    fabric = L.Fabric(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision
    )
    if not launched_by_fabric_cli():
        fabric.launch()
    say(
        fabric,
        f"{fabric.world_size} ranks = {fabric.strategy.num_nodes} node(s) x {strategy.topology.ranks_per_node},"
        f" mesh (replicate, shard) = {strategy.topology.mesh_shape}, device {fabric.device}",
    )

    strategy.check_writable(out_dir)  # unwritable: found now, not at the first save
    tokens = load_tokens(data, model.vocab_size)
    split = int(len(tokens) * 0.9)
    train_tokens, val_tokens = tokens[:split], tokens[split:]

    fabric.seed_everything(seed)
    with fabric.init_module(empty_init=True):
        net = Llama(model)
    net = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(net.parameters(), lr=learning_rate, weight_decay=weight_decay)
    )
    say(fabric, f"model: {sum(p.numel() for p in net.parameters()):,} parameters (global), {model}")

    state = {"model": net, "optimizer": optimizer, "step": 0, "config": asdict(model)}
    checkpoint = latest_checkpoint(out_dir) if resume else None
    if checkpoint is not None:
        started = time.perf_counter()
        remainder = fabric.load(checkpoint, state)
        say(
            fabric,
            f"resumed from {checkpoint} (step {state['step']}) in {time.perf_counter() - started:.2f} s"
            + (f"; not restored: {sorted(remainder)}" if remainder else "")
            + ("; --init_from ignored" if init_from else ""),
        )
    elif init_from is not None:
        started = time.perf_counter()
        fabric.load_raw(init_from, net)
        say(fabric, f"initialised from {init_from} (load_mode={load_mode}) in {time.perf_counter() - started:.2f} s")
    resumed_from = state["step"]
    if report_dir is not None:
        write_report(report_dir, fabric, strategy, resumed_from=resumed_from, finished=False)

    def save(step: int) -> None:
        path = out_dir / f"step-{step:06d}"
        started = time.perf_counter()
        state["step"] = step
        fabric.save(path, state)
        seconds = time.perf_counter() - started
        if async_save:
            say(fabric, f"step {step}: saving {path} in the background (fabric.save returned in {seconds:.2f} s)")
        else:
            say(fabric, f"step {step}: saved {path} in {seconds:.2f} s")

    if state["step"] == 0:
        say(fabric, f"step 0: val loss {evaluate(fabric, net, val_tokens, batch_size, seq_len, seed):.4f}")
    tokens_per_step = batch_size * seq_len * fabric.world_size
    window_started, window_steps = time.perf_counter(), 0
    for step in range(state["step"] + 1, max_steps + 1):
        batch = batch_for(train_tokens, step, fabric.global_rank, batch_size, seq_len, seed).to(fabric.device)
        loss = loss_fn(net(batch[:, :-1]), batch[:, 1:])
        fabric.backward(loss)
        if grad_clip > 0:
            fabric.clip_gradients(net, optimizer, max_norm=grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        window_steps += 1
        if step % log_every == 0 or step == max_steps:
            mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
            seconds = time.perf_counter() - window_started
            say(
                fabric,
                f"step {step}/{max_steps}: train loss {mean_loss:.4f},"
                f" {window_steps * tokens_per_step / seconds:,.0f} tokens/s",
            )
            window_started, window_steps = time.perf_counter(), 0
        if save_every > 0 and step % save_every == 0 and step != max_steps:
            save(step)
    if state["step"] < max_steps:
        save(max_steps)
    val_loss = evaluate(fabric, net, val_tokens, batch_size, seq_len, seed)
    say(fabric, f"done: val loss {val_loss:.4f}")
    strategy.wait_for_checkpoint()  # a save still in the background: committed here, or its failure raised
    if report_dir is not None:
        facts = {"resumed_from": resumed_from, "finished": True, "step": max_steps, "val_loss": val_loss}
        write_report(report_dir, fabric, strategy, **facts)


@torch.no_grad()
def evaluate(
    fabric: L.Fabric, net: torch.nn.Module, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> float:
    """Mean loss on a fixed set of held-out windows, averaged over ranks."""
    net.eval()
    batch = batch_for(tokens, -1, fabric.global_rank, batch_size, seq_len, seed).to(fabric.device)
    loss = loss_fn(net(batch[:, :-1]), batch[:, 1:])
    net.train()
    return fabric.all_reduce(loss, reduce_op="mean").item()


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
