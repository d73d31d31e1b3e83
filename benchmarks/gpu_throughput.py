"""Training throughput on one device: this package's levers against torchtitan's own recipe, as the baseline.

Run: ``python benchmarks/gpu_throughput.py --out results.jsonl`` (one CUDA device; ``--tiny --device cpu`` rehearses
every variant in seconds). Each variant runs in its own process (its own compile caches and allocator peak) on the same
model, data and fused AdamW, streams its whole log to ``throughput-<variant>.log`` (beside ``--out``, or in
``--log_dir``) and appends one JSON line to ``--out`` as it finishes, so a timeout keeps what finished and the log of
what did not. Order: the most needed first (the baseline, then ``selective``, whose line is written before its saves).

- ``torchtitan``: the baseline, torchtitan's recipe written out (``_torchtitan.py``): its selective-AC op policy
  (recomputes every second matmul), ``block.compile(fullgraph=True)`` per block, ``fully_shard`` per block with
  ``MixedPrecisionPolicy(bf16, fp32)``, fused AdamW, no autocast;
- ``selective``: ``HybridFSDPStrategy(compile=True, activation_checkpointing_mode="selective")``, bf16-mixed; after
  its timed steps, in the same process (no second compile), two async ``fabric.save`` calls to a RAM-backed directory
  (``/dev/shm``), one at a time: the staging timed through the end of its device-to-host copies, the step right after
  a save with no sync between them, and the load checked against the state at the save (a ``save`` line);
- ``full``: the strategy with full activation checkpointing;
- ``float8``: ``selective`` with ``float8=True`` (torchao rowwise; CUDA SM 8.9+).

Each line records the device, the compile backend, graph breaks, recompiles and graphs. The headline is each of this
package's variants against ``torchtitan`` in tokens per second (1.0: as fast as torchtitan's recipe), printed only
when both sides compiled alike (same backend, no graph breaks, the same graphs and recompiles). MFU counts
6 x (non-embedding parameters) + 6 x layers x dim x sequence FLOPs per token: causal attention, half of the
12 x L x d x T that full attention costs (torchtitan's convention counts the full 12, ~13 % more at this size),
against the device's dense bf16 peak (by its name; ``--peak_tflops`` to override).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from _processes import last_error, run_logged  # noqa: E402

VARIANTS = ("torchtitan", "selective", "full", "float8")  # the baseline first: a ratio as soon as selective's steps end
BASELINE = "torchtitan"
# ~1.26B parameters (TinyLlama's shape), sequence 4096: the review's plan for one H200
MODEL = {"vocab_size": 32000, "dim": 2048, "n_layers": 22, "n_heads": 16, "hidden_dim": 5632, "max_seq_len": 4096}
TINY = {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 96, "max_seq_len": 32}
# dense bf16 TFLOPs by device name, the first match wins (NVIDIA's data sheets, without sparsity)
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0))
STALL = "GPU_THROUGHPUT_STALL"  # "variant:step": that variant hangs after that step (the rehearsal of a timeout)


def _say(line: str) -> None:
    print(line, flush=True)


def _config(args: argparse.Namespace) -> Any:
    from examples.tiny_llama import LlamaConfig

    return LlamaConfig(**(TINY if args.tiny else MODEL))


def flops_per_token(config: Any, parameters: int) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter, plus causal attention's scores and weighted sum
    (6 x layers x dim x sequence: half of full attention's 12, as a causal kernel skips the masked half)."""
    non_embedding = parameters - config.vocab_size * config.dim  # the embedding's lookup costs no matmul
    return 6 * non_embedding + 6 * config.n_layers * config.dim * config.max_seq_len


def _batches(args: argparse.Namespace, config: Any, device: Any, count: int) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, config.max_seq_len + 1)
    tokens = [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(count)]
    return [(row[:, :-1].to(device), row[:, 1:].to(device)) for row in tokens]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every stream of the device: the staging's side stream too


def _peak_bytes(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak resident set


def device_name(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()})"


def peak_tflops(name: str, override: float | None) -> float:
    if override is not None:
        return override
    for key, value in PEAK_TFLOPS:
        if key in name:
            return value
    return 989.0  # unknown: H100 SXM's, said so in the line (peak_tflops)


class CompileCounters:
    """Graph breaks, recompiles and graphs of this process's compiles (recompiles counted from dynamo's log)."""

    def __init__(self) -> None:
        import logging

        import torch

        self.recompiles = 0
        counter = self

        class Count(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                counter.recompiles += "Recompiling function" in record.getMessage()

        torch._logging.set_logs(recompiles=True)  # the reasons go to the variant's log too
        torch._logging.getArtifactLogger("torch._dynamo.guards", "recompiles").addHandler(Count())

    def figures(self) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        return {
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": self.recompiles,
            "graphs": counters["stats"]["unique_graphs"],
        }


def _strategy_run(args: argparse.Namespace, variant: str) -> tuple[Any, Any, Any, Any]:
    import lightning as L
    import torch

    from examples.tiny_llama import Block, Llama
    from fabric_hsdp import HybridFSDPStrategy

    compile_spec: Any = (
        False if args.backend == "none" else True if args.backend == "inductor" else {"backend": args.backend}
    )
    strategy = HybridFSDPStrategy(
        sharded_modules={Block},
        activation_checkpointing={Block},
        activation_checkpointing_mode="full" if variant == "full" else "selective",
        compile=compile_spec,
        float8=variant == "float8",
        async_save=args.save_dir is not None,
    )
    fabric = L.Fabric(accelerator=args.device, devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = Llama(_config(args))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    return fabric, model, optimizer, fabric.device


def _torchtitan_run(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """torchtitan's recipe (``_torchtitan.py``): its selective AC -> compile(fullgraph) -> fully_shard per block, the
    outer units, the root, fused AdamW (the model built on the device: one device holds a 1.3B model's fp32 weights)."""
    import _torchtitan
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from examples.tiny_llama import Llama

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
    compile_options = {"fullgraph": True, **({} if args.backend == "inductor" else {"backend": args.backend})}
    _torchtitan.set_compile_config()
    blocks = [_torchtitan.wrap_block(block) for block in model.layers]
    for block in blocks if args.backend != "none" else []:  # none: neither side compiles
        block.compile(**compile_options)
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy)
        model.layers[index] = block
    # torchtitan's outer units: the embedding; the norm and head, kept gathered for the backward that starts there
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=policy)
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return None, model, optimizer, device


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _step(fabric: Any, model: Any, optimizer: Any, batch: tuple[Any, Any]) -> Any:
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


def _stall_here(variant: str, step: int) -> None:
    if os.environ.get(STALL) == f"{variant}:{step}":
        _say(f"stalling after step {step} ({STALL}): the deadline must end this process")
        time.sleep(3600)


def run_variant(args: argparse.Namespace) -> None:
    """One variant in this process: warm-up steps (compile), timed steps, its JSON line; each step logged."""
    import statistics

    variant = args.variant
    counters = CompileCounters()
    name = device_name(args.device)
    _say(f"{variant}: pid {os.getpid()} on {name}, compile backend {args.backend}")
    start = time.perf_counter()
    if variant == BASELINE:
        fabric, model, optimizer, device = _torchtitan_run(args)
    else:
        fabric, model, optimizer, device = _strategy_run(args, variant)
    config = _config(args)
    batches = _batches(args, config, device, args.warmup + args.steps)
    _say(f"built in {time.perf_counter() - start:.1f} s")
    seconds, losses = [], []
    for index, batch in enumerate(batches, start=1):
        _sync(device)
        start = time.perf_counter()
        losses.append(float(_step(fabric, model, optimizer, batch)))
        _sync(device)
        seconds.append(time.perf_counter() - start)
        _say(f"step {index}: {seconds[-1]:.3f} s, loss {losses[-1]:.4f}")
        _stall_here(variant, index)
    step = statistics.median(seconds[args.warmup :])
    tokens = args.micro_batch * config.max_seq_len
    parameters = sum(p.numel() for p in model.parameters())
    peak = peak_tflops(name, args.peak_tflops)
    result = {
        "variant": variant,
        "device": name,
        "compile": args.backend,
        **counters.figures(),
        "tokens_per_s": round(tokens / step, 1),
        "mfu": round(flops_per_token(config, parameters) * tokens / step / (peak * 1e12), 4),
        "peak_tflops": peak,
        "step_s": round(step, 4),
        "first_step_s": round(seconds[0], 2),  # compile included
        "peak_gb": round(_peak_bytes(device) / 1e9, 2),
        "loss": [round(losses[0], 4), round(losses[-1], 4)],
        "parameters": parameters,
    }
    _append(args.out, result)
    _say(f"result: {json.dumps(result)}")
    if args.save_dir is not None:
        figures = {"variant": "save", "device": name, **_save_figures(args, fabric, model, optimizer, batches, step)}
        _append(args.out, figures)
        _say(f"save: {json.dumps(figures)}")


def _save_figures(args: Any, fabric: Any, model: Any, optimizer: Any, batches: list, step: float) -> dict[str, Any]:
    """Two async saves after the timed steps, one at a time, into ``--save_dir`` (RAM-backed: the figures are staging
    and overlap, not disk speed). The first is timed through the end of its device-to-host copies (``staged_s``, and
    the state's bytes over it); the second is followed at once, with no sync between, by a step: ``step_after_s``
    against the median step shows what the copies cost the training that overlaps them. Then the load is checked
    against the state at the second save."""
    state = {"model": model, "optimizer": optimizer}
    state_bytes = sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        value.to_local().numel() * value.element_size()
        for entry in optimizer.state.values()
        for value in entry.values()
        if hasattr(value, "to_local")
    )
    directory = Path(args.save_dir)
    _sync(fabric.device)
    start = time.perf_counter()
    fabric.save(directory / "save-1", state)
    issued = time.perf_counter() - start
    _sync(fabric.device)  # the copies on the staging stream included
    staged = time.perf_counter() - start
    fabric.strategy.wait_for_checkpoint()
    written = time.perf_counter() - start
    _say(f"save 1: issued in {issued:.3f} s, staged in {staged:.3f} s, written in {written:.3f} s")
    shutil.rmtree(directory / "save-1")  # one checkpoint at a time in RAM

    sums = {name: t.to_local().double().sum().item() for name, t in model.state_dict().items()}
    _sync(fabric.device)
    start = time.perf_counter()
    fabric.save(directory / "save-2", state)
    returned = time.perf_counter()
    _step(fabric, model, optimizer, batches[0])  # no sync before it: the copies overlap it; the shards change after
    _sync(fabric.device)
    step_after = time.perf_counter() - returned
    fabric.strategy.wait_for_checkpoint()
    _say(f"save 2: issued in {returned - start:.3f} s, the step right after {step_after:.3f} s (median {step:.3f} s)")
    fabric.load(directory / "save-2", state)
    loaded = {name: t.to_local().double().sum().item() for name, t in model.state_dict().items()}
    wrong = [name for name in sums if sums[name] != loaded[name]]
    if wrong:
        raise AssertionError(f"{len(wrong)} tensors differ from the state at the save, e.g. {wrong[:3]}")
    return {
        "state_gb": round(state_bytes / 1e9, 3),
        "issued_s": round(issued, 4),
        "staged_s": round(staged, 4),
        "staged_gb_per_s": round(state_bytes / 1e9 / staged, 2),
        "written_s": round(written, 3),
        "step_after_s": round(step_after, 4),
        "step_s": round(step, 4),
        "load_exact": True,
        "rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
    }


def _float8_skip_reason(args: argparse.Namespace) -> str | None:
    from fabric_hsdp.setup.float8 import float8_unsupported_reason

    return "float8 needs CUDA" if args.device != "cuda" else float8_unsupported_reason()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a JSON line per variant is appended here")
    parser.add_argument("--log_dir", type=Path, help="where throughput-<variant>.log go (default: beside --out)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--no_save", action="store_true", help="no async-save figures after the selective steps")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model at sequence 32 (the CPU rehearsal)")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend for both sides (aot_eager: no code generation;"
        " none: no compile on either side)",
    )  # fmt: skip
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak (default: by device name)")
    parser.add_argument("--budget", type=float, default=230.0, help="seconds for all variants")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # inside a variant's process
    parser.add_argument("--save_dir", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.variant:
        run_variant(args)
        return 0

    deadline = time.monotonic() + args.budget
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    least = 5 if args.tiny else 20  # seconds a variant needs at least to be worth starting
    failed = 0
    for variant in args.variants:
        reason = _float8_skip_reason(args) if variant == "float8" else None
        left = deadline - time.monotonic()
        if reason is None and left < least:
            reason = "out of time"
        if reason is not None:
            _append(args.out, {"variant": variant, "skipped": reason})
            _say(f"SKIP  {variant:<12} {reason}")
            continue
        failed += _run_one(args, variant, left, log_dir / f"throughput-{variant}.log")
    _say(headline(args.out))
    return 1 if failed else 0


def _run_one(args: argparse.Namespace, variant: str, left: float, log: Path) -> int:
    """Run one variant's process with its log streamed to ``log``; returns 1 if it failed."""
    save = variant == "selective" and not args.no_save
    shm = Path("/dev/shm")  # RAM-backed where there is one
    with tempfile.TemporaryDirectory(prefix="throughput-save-", dir=shm if shm.is_dir() else None) as save_dir:
        command = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        command += ["--save_dir", save_dir] if save else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        code, seconds = run_logged(command, log, left, env, cwd=REPO_ROOT)
    written = {line["variant"] for line in _lines(args.out)}
    text = log.read_text()
    if code == 0:
        result = [line for line in _lines(args.out) if line["variant"] == variant][-1]
        _say(f"PASS  {variant:<12} {_summary(result)} [{seconds:.0f} s]")
        if save:
            _say(f"PASS  {'save':<12} {_save_summary([x for x in _lines(args.out) if x['variant'] == 'save'][-1])}")
        return 0
    error = f"ended at the deadline after {seconds:.0f} s" if code is None else last_error(text)
    steps = sum(line.startswith("step ") for line in text.splitlines())
    for name in [variant] * (variant not in written) + ["save"] * (save and "save" not in written):
        _append(args.out, {"variant": name, "error": error, "steps_done": steps, "log": str(log)})
        _say(f"FAIL  {name:<12} {error} after {steps} steps [{seconds:.0f} s] (its log: {log})")
    return 1


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _append(path: Path, line: dict[str, Any]) -> None:
    with path.open("a") as file:
        file.write(json.dumps(line) + "\n")


def _summary(result: dict[str, Any]) -> str:
    return (
        f"{result['tokens_per_s']:.0f} tokens/s, MFU {100 * result['mfu']:.1f} % (causal), step {result['step_s']:.3f}"
        f" s, first {result['first_step_s']:.1f} s, peak {result['peak_gb']:.2f} GB, compile {result['compile']}:"
        f" {result['graphs']} graphs, {result['graph_breaks']} breaks, {result['recompiles']} recompiles"
    )


def _save_summary(save: dict[str, Any]) -> str:
    return (
        f"{save['state_gb']} GB staged in {save['staged_s']:.3f} s ({save['staged_gb_per_s']} GB/s through the end of"
        f" the copies; fabric.save returned after {save['issued_s']:.3f} s), the step right after a save"
        f" {save['step_after_s']:.3f} s vs {save['step_s']:.3f} s, load exact"
    )


def compiled_differently(ours: dict[str, Any], baseline: dict[str, Any]) -> str | None:
    """Why two variants' compiles differ (a ratio between them would measure that), or None when alike."""
    keys = ("compile", "graph_breaks", "graphs", "recompiles")
    if any(ours[key] != baseline[key] for key in keys) or ours["graph_breaks"]:
        return ", ".join(f"{key} {ours[key]} vs {baseline[key]}" for key in keys)
    return None


def headline(path: Path) -> str:
    """Each of this package's variants against torchtitan's recipe, when both compiled alike."""
    results = {line["variant"]: line for line in _lines(path) if "tokens_per_s" in line}
    if BASELINE not in results:
        return f"throughput: no ratio (the {BASELINE} baseline did not finish)"
    baseline = results[BASELINE]
    lines, ratios = (
        [f"throughput against torchtitan's recipe ({baseline['device']}, compile {baseline['compile']}):"],
        {},
    )
    for variant in (name for name in VARIANTS if name != BASELINE and name in results):
        differ = compiled_differently(results[variant], baseline)
        if differ is None:
            ratios[variant] = results[variant]["tokens_per_s"] / baseline["tokens_per_s"]
            lines.append(f"  ours {variant} / {BASELINE} = {ratios[variant]:.2f}")
        else:
            lines.append(f"  ours {variant}: no ratio, compiled differently from {BASELINE} ({differ})")
    if ratios:
        best = max(ratios, key=ratios.get)
        lines.append(f"  best lever: {best} at {ratios[best]:.2f} x torchtitan's tokens/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
