"""Training throughput on one device: the strategy's levers against a hand-written torchtitan-style loop.

Run: ``python benchmarks/gpu_throughput.py --out results.jsonl`` (one CUDA device; ``--tiny --device cpu`` rehearses
every variant in seconds). Each variant runs in its own process (its own compile caches and allocator peak) on the same
model, data and AdamW, and appends one JSON line to ``--out`` as it finishes, so a timeout keeps what finished:

- ``selective``: ``HybridFSDPStrategy(compile=True, activation_checkpointing_mode="selective")``, bf16-mixed;
- ``full``: the same with full activation checkpointing;
- ``handwritten``: what torchtitan does, written out: ``checkpoint_wrapper`` with the same selective policy around
  each block, ``block.compile()``, ``fully_shard`` per block with ``MixedPrecisionPolicy(bf16, fp32)``, no autocast;
- ``float8``: ``selective`` with ``float8=True`` (torchao rowwise; CUDA SM 8.9+);
- ``save``: ``selective``'s model after its steps, two async ``fabric.save`` calls: the time each blocks the step,
  D2H GB/s, the step after a save against a normal step, and the load checked against the state at the save.

The headline is ``selective`` / ``handwritten`` tokens per second: 1.0 means the strategy costs nothing over the
hand-written loop. MFU counts 6 x (non-embedding parameters) + 12 x layers x dim x sequence FLOPs per token against
the device's dense bf16 peak (``--peak_tflops``, H200: 989).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VARIANTS = ("selective", "handwritten", "full", "float8", "save")
# ~1.26B parameters (TinyLlama's shape), sequence 4096: the review's plan for one H200
MODEL = {"vocab_size": 32000, "dim": 2048, "n_layers": 22, "n_heads": 16, "hidden_dim": 5632, "max_seq_len": 4096}
TINY = {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 96, "max_seq_len": 32}


def _config(args: argparse.Namespace) -> Any:
    from examples.tiny_llama import LlamaConfig

    return LlamaConfig(**(TINY if args.tiny else MODEL))


def _batches(args: argparse.Namespace, config: Any, device: Any, count: int) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, config.max_seq_len + 1)
    tokens = [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(count)]
    return [(row[:, :-1].to(device), row[:, 1:].to(device)) for row in tokens]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak resident set


def _strategy_run(args: argparse.Namespace, variant: str) -> tuple[Any, Any, Any, Any]:
    import lightning as L
    import torch

    from examples.tiny_llama import Block, Llama
    from fabric_hsdp import HybridFSDPStrategy

    compile_spec: Any = True if args.backend == "inductor" else {"backend": args.backend}
    strategy = HybridFSDPStrategy(
        sharded_modules={Block},
        activation_checkpointing={Block},
        activation_checkpointing_mode="full" if variant == "full" else "selective",
        compile=compile_spec,
        float8=variant == "float8",
        async_save=variant == "save",
    )
    fabric = L.Fabric(accelerator=args.device, devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = Llama(_config(args))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    return fabric, model, optimizer, fabric.device


def _handwritten_run(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """torchtitan's recipe, by hand: AC wrapper -> compile -> fully_shard per block, the outer units, the root
    (the model built on the device: one device holds a 1.3B model's fp32 weights)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from examples.tiny_llama import Llama
    from fabric_hsdp.parallelize import selective_checkpoint_contexts

    device = torch.device(args.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(_config(args))
    compile_options = {} if args.backend == "inductor" else {"backend": args.backend}
    for index, block in enumerate(model.layers):
        block = checkpoint_wrapper(block, context_fn=selective_checkpoint_contexts, preserve_rng_state=False)
        block.compile(**compile_options)
        fully_shard(block, mesh=mesh, mp_policy=policy)
        model.layers[index] = block
    # torchtitan's outer units: the embedding; the norm and head, kept gathered for the backward that starts there
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=policy)
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return None, model, optimizer, device


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _step(fabric: Any, model: Any, optimizer: Any, batch: tuple[Any, Any]) -> float:
    import torch

    inputs, targets = batch
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    if fabric is not None:
        fabric.backward(loss)
    else:
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: warm-up steps (compile), timed steps; returns its figures."""
    import statistics

    import torch
    import torch._dynamo

    variant = args.variant
    if variant == "handwritten":
        fabric, model, optimizer, device = _handwritten_run(args)
    else:
        fabric, model, optimizer, device = _strategy_run(args, variant)
    config = _config(args)
    batches = _batches(args, config, device, args.warmup + args.steps)
    seconds, losses = [], []
    for batch in batches:
        _sync(device)
        start = time.perf_counter()
        losses.append(float(_step(fabric, model, optimizer, batch)))
        _sync(device)
        seconds.append(time.perf_counter() - start)
    step = statistics.median(seconds[args.warmup :])
    tokens = args.micro_batch * config.max_seq_len
    parameters = sum(p.numel() for p in model.parameters())
    non_embedding = parameters - config.vocab_size * config.dim  # the embedding's lookup costs no matmul
    flops_per_token = 6 * non_embedding + 12 * config.n_layers * config.dim * config.max_seq_len
    result = {
        "variant": variant,
        "tokens_per_s": round(tokens / step, 1),
        "mfu": round(flops_per_token * tokens / step / (args.peak_tflops * 1e12), 4),
        "step_s": round(step, 4),
        "first_step_s": round(seconds[0], 2),  # compile included
        "peak_gb": round(_peak_bytes(device) / 1e9, 2),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "loss": [round(losses[0], 4), round(losses[-1], 4)],
        "parameters": parameters,
    }
    if variant == "save":
        result.update(_save_figures(args, fabric, model, optimizer, batches, step))
    return result


def _save_figures(args: Any, fabric: Any, model: Any, optimizer: Any, batches: list, step: float) -> dict[str, Any]:
    """Two async saves after the timed steps: the time each blocks (staging the state to the host: ``d2h_gb_per_s``
    is the state's bytes over it), the step right after it, the load against the state at the save."""
    state = {"model": model, "optimizer": optimizer}
    state_bytes = sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        value.to_local().numel() * value.element_size()
        for entry in optimizer.state.values()
        for value in entry.values()
        if hasattr(value, "to_local")
    )
    figures: dict[str, Any] = {"state_gb": round(state_bytes / 1e9, 2)}
    for index in (1, 2):
        sums = {name: t.to_local().double().sum().item() for name, t in model.state_dict().items()}
        _sync(fabric.device)
        start = time.perf_counter()
        fabric.save(Path(args.save_dir) / f"save-{index}", state)
        blocked = time.perf_counter() - start
        _sync(fabric.device)
        start = time.perf_counter()
        _step(fabric, model, optimizer, batches[index % len(batches)])  # the shards change under the staged copy
        _sync(fabric.device)
        after = time.perf_counter() - start
        fabric.strategy.wait_for_checkpoint()
        figures[f"save{index}"] = {
            "blocked_s": round(blocked, 3),
            "d2h_gb_per_s": round(state_bytes / 1e9 / blocked, 2),
            "step_after_s": round(after, 4),
            "step_s": round(step, 4),
        }
        figures[f"save{index}_sums"] = sums
    fabric.load(Path(args.save_dir) / "save-2", state)
    loaded = {name: t.to_local().double().sum().item() for name, t in model.state_dict().items()}
    saved = figures.pop("save2_sums")
    figures.pop("save1_sums")
    figures["load_exact"] = loaded == saved
    figures["rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    if not figures["load_exact"]:
        wrong = [name for name in saved if saved[name] != loaded[name]]
        raise AssertionError(f"{len(wrong)} tensors differ from the state at the save, e.g. {wrong[:3]}")
    return figures


def _float8_skip_reason(args: argparse.Namespace) -> str | None:
    from fabric_hsdp.float8 import float8_unsupported_reason

    return "float8 needs CUDA" if args.device != "cuda" else float8_unsupported_reason()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a JSON line per variant is appended here")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model at sequence 32 (the CPU rehearsal)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--peak_tflops", type=float, default=989.0, help="dense bf16 peak (H200/H100 SXM: 989)")
    parser.add_argument("--budget", type=float, default=230.0, help="seconds for all variants")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # inside a variant's process
    parser.add_argument("--save_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        result = run_variant(args)
        with args.out.open("a") as file:
            file.write(json.dumps(result) + "\n")
        return 0

    import tempfile

    deadline = time.monotonic() + args.budget
    failed = 0
    for variant in args.variants:
        reason = _float8_skip_reason(args) if variant == "float8" else None
        left = deadline - time.monotonic()
        if reason is None and left < 20:
            reason = "out of time"
        if reason is not None:
            _append(args.out, {"variant": variant, "skipped": reason})
            print(f"SKIP  {variant:<12} {reason}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix=f"throughput-{variant}-") as save_dir:
            command = [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--save_dir", save_dir]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
            start = time.monotonic()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=left, env=env, cwd=REPO_ROOT)
                output, code = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired:
                output, code = f"timed out after {left:.0f} s", None
        seconds = time.monotonic() - start
        if code == 0:
            result = json.loads(args.out.read_text().splitlines()[-1])
            print(f"PASS  {variant:<12} {_summary(result)} [{seconds:.0f} s]", flush=True)
        else:
            failed += 1
            error = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
            _append(args.out, {"variant": variant, "error": error[0][:300]})
            print(f"FAIL  {variant:<12} {error[0][:300]} [{seconds:.0f} s]", flush=True)
            if os.environ.get("GPU_CHECK_VERBOSE"):
                print(output[-6000:], flush=True)
    print(_headline(args.out), flush=True)
    return 1 if failed else 0


def _append(path: Path, line: dict[str, Any]) -> None:
    with path.open("a") as file:
        file.write(json.dumps(line) + "\n")


def _summary(result: dict[str, Any]) -> str:
    text = (
        f"{result['tokens_per_s']:.0f} tokens/s, MFU {100 * result['mfu']:.1f} %, step {result['step_s']:.3f} s,"
        f" first {result['first_step_s']:.1f} s, peak {result['peak_gb']:.2f} GB, {result['graphs']} graphs"
    )
    if "save1" in result:
        first, second = result["save1"], result["save2"]
        text += (
            f"; saves of {result['state_gb']} GB blocked {first['blocked_s']:.2f} s then {second['blocked_s']:.2f} s,"
            f" step after {second['step_after_s']:.3f} s vs {second['step_s']:.3f} s, load exact"
        )
    return text


def _headline(path: Path) -> str:
    lines = map(json.loads, path.read_text().splitlines())
    results = {line["variant"]: line for line in lines if "tokens_per_s" in line}
    if "selective" in results and "handwritten" in results:
        ratio = results["selective"]["tokens_per_s"] / results["handwritten"]["tokens_per_s"]
        return f"throughput: ours (compile + selective AC) / hand-written torchtitan-style loop = {ratio:.2f}"
    return "throughput: no ratio (the selective or hand-written variant did not finish)"


if __name__ == "__main__":
    sys.exit(main())
