"""The local half of expert parallelism on one device: one mixture-of-experts layer's experts, forward and backward,
as one rank runs them under FSDP only and under expert parallelism over 8 ranks (EP8).

Run: ``python benchmarks/gpu_experts.py --out experts.jsonl`` (one CUDA device; ``--tiny --device cpu`` rehearses it
in seconds). One GPU cannot run EP between ranks: NCCL refuses two ranks on one device, and one rank of EP is FSDP.
What one device can measure is what a rank computes and holds between the two all-to-alls:

- ``fsdp``: all ``E`` experts of the layer, as FSDP gathers them (bf16, the param dtype of bf16-mixed), on the rank's
  own ``T`` tokens with their top-``k`` routing: ``T k`` rows over ``E`` experts;
- ``ep8``: the rank's ``E / 8`` experts, on the ``T k`` rows the exchange brings it when the routing is uniform (each
  of the 8 ranks sends it the rows for its experts), called as the strategy calls the model's forward (each row's
  local expert, weight 1), then weighted and summed into tokens in fp32 as ``combine`` does.

The model is one layer of Qwen3-30B-A3B (hidden 2048, 128 experts of intermediate 768, top-8) at 4096 tokens per
rank, with transformers' own ``grouped_mm`` experts forward. Both sides multiply the same ``T k`` rows, so the FLOPs
per rank are the same; what differs is the rows per expert (``T k / E`` against ``8 T k / E``: bigger groups for the
grouped GEMM) and the gathered weights and their gradients (``1 / 8`` of them). The all-to-alls, their overlap and
the load imbalance of a real router are not measured here. Routing is uniform at random (seed 0), the same on both
sides. Each variant runs in its own process (its own allocator peak) and streams its log to
``experts-<variant>.log``; its JSON line goes to ``--out`` as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from _processes import last_error, run_logged  # noqa: E402

VARIANTS = ("fsdp", "ep8")  # the anchor first
EXPERT_PARALLEL_SIZE = 8
# one layer of Qwen3-30B-A3B (its published config), 4096 tokens per rank
SHAPE = {"hidden": 2048, "experts": 128, "top_k": 8, "intermediate": 768, "tokens": 4096}
TINY = {"hidden": 64, "experts": 16, "top_k": 4, "intermediate": 32, "tokens": 64}


def _say(line: str) -> None:
    print(line, flush=True)


def local_experts(variant: str, experts: int) -> int:
    """The experts one rank holds gathered in ``variant``."""
    return experts // EXPERT_PARALLEL_SIZE if variant == "ep8" else experts


def _experts_module(shape: dict[str, int], count: int, device: Any) -> Any:
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=shape["hidden"],
        num_experts=count,
        num_experts_per_tok=shape["top_k"],
        moe_intermediate_size=shape["intermediate"],
    )
    config._experts_implementation = "grouped_mm"  # what from_pretrained(experts_implementation="grouped_mm") sets
    with torch.device(device):
        experts = Qwen3MoeExperts(config).to(torch.bfloat16)
    generator = torch.Generator(device).manual_seed(0)
    for param in experts.parameters():
        param.data.normal_(0.0, 0.02, generator=generator)
    return experts


def _grouped_mm_path() -> str:
    """Which grouped GEMM transformers' ``grouped_mm`` forward calls with these torch and transformers."""
    import torch
    from transformers.utils.import_utils import is_grouped_mm_available

    if not is_grouped_mm_available():
        return "transformers' fallback loop (torch < 2.9)"
    return "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "torch._grouped_mm"


def _routing(shape: dict[str, int], device: Any) -> tuple[Any, Any]:
    """Each token's ``k`` distinct experts, uniform at random, and softmax weights (seed 0, the same on both sides)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(shape["tokens"], shape["experts"], generator=generator)
    top_scores, top_index = scores.topk(shape["top_k"], dim=-1)
    return top_index.to(device), top_scores.softmax(-1).to(device)


def run_variant(args: argparse.Namespace) -> None:
    import torch

    variant, shape = args.variant, TINY if args.tiny else SHAPE
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    _say(f"{variant}: pid {os.getpid()} on {name}, {json.dumps(shape)}")
    count = local_experts(variant, shape["experts"])
    experts = _experts_module(shape, count, device)
    top_index, top_weights = _routing(shape, device)
    tokens, top_k = shape["tokens"], shape["top_k"]
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, shape["hidden"], generator=generator).to(device, torch.bfloat16).requires_grad_()
    grad_out = torch.randn(tokens, shape["hidden"], generator=generator).to(device, torch.bfloat16)
    # the rows an EP rank receives, sorted by expert as dispatch sends them; local ids as the strategy passes them
    order = torch.argsort(top_index.reshape(-1), stable=True)
    token_of_row = order // top_k
    local_ids = (top_index.reshape(-1)[order] % count).unsqueeze(-1)
    row_weights = top_weights.reshape(-1)[order].float().unsqueeze(-1)
    ones = torch.ones(local_ids.shape[0], 1, dtype=torch.bfloat16, device=device)

    def forward() -> torch.Tensor:
        if variant == "fsdp":
            return experts(hidden, top_index, top_weights.to(torch.bfloat16))
        out = experts(hidden[token_of_row], local_ids, ones)
        summed = torch.zeros(tokens, shape["hidden"], dtype=torch.float32, device=device)
        return summed.index_add_(0, token_of_row, out.float() * row_weights).to(torch.bfloat16)

    weight_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for index in range(1, args.warmup + args.steps + 1):
        _sync(device)
        start = time.perf_counter()
        forward().backward(grad_out)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        for param in [*experts.parameters(), hidden]:
            param.grad = None  # FSDP frees the unsharded gradients after their reduce-scatter
        _say(f"step {index}: {seconds[-1]:.4f} s")
    step = statistics.median(seconds[args.warmup :])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_bytes()
    result = {
        "variant": variant,
        "device": name,
        "experts": count,
        "of_experts": shape["experts"],
        "rows": int(local_ids.shape[0]),
        "rows_per_expert": round(local_ids.shape[0] / count, 1),
        "tokens_per_s": round(tokens / step, 1),
        "step_s": round(step, 5),
        "first_step_s": round(seconds[0], 3),
        "weights_bytes": weight_bytes,
        "weights_gb": round(weight_bytes / 1e9, 3),
        "peak_gb": round(peak / 1e9, 3),
        "peak_is": "max_memory_allocated" if device.type == "cuda" else "the process's peak RSS (CPU: no meaning)",
        "grouped_mm": _grouped_mm_path(),
    }
    _append(args.out, result)
    _say(f"result: {json.dumps(result)}")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _append(path: Path, line: dict[str, Any]) -> None:
    with path.open("a") as file:
        file.write(json.dumps(line) + "\n")


def headline(path: Path) -> str:
    """EP8's local half against FSDP's: tokens/s, peak memory, gathered weights."""
    results = {line["variant"]: line for line in _lines(path) if "tokens_per_s" in line}
    if not all(variant in results for variant in VARIANTS):
        return "experts: no comparison (a variant did not finish)"
    fsdp, ep = results["fsdp"], results["ep8"]
    return (
        f"experts, one layer's local half ({ep['device']}): ep8 / fsdp tokens/s = "
        f"{ep['tokens_per_s'] / fsdp['tokens_per_s']:.2f} ({ep['rows_per_expert']:.0f} vs"
        f" {fsdp['rows_per_expert']:.0f} rows per expert); peak {ep['peak_gb']:.3f} vs {fsdp['peak_gb']:.3f} GB"
        f" ({ep['peak_is']}); gathered weights {ep['weights_bytes'] / 1e9:.4g} vs {fsdp['weights_bytes'] / 1e9:.4g} GB"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a JSON line per variant is appended here")
    parser.add_argument("--log_dir", type=Path, help="where experts-<variant>.log go (default: beside --out)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 16 experts, 64 tokens (the CPU rehearsal)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=40.0, help="seconds for both variants")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # inside a variant's process
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.variant:
        run_variant(args)
        return 0
    deadline = time.monotonic() + args.budget
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    failed = 0
    for variant in VARIANTS:
        left = deadline - time.monotonic()
        if left < 5:
            _append(args.out, {"variant": variant, "skipped": "out of time"})
            _say(f"SKIP  {variant:<6} out of time")
            continue
        log = log_dir / f"experts-{variant}.log"
        command = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        code, seconds = run_logged(command, log, left, env, cwd=REPO_ROOT)
        if code == 0:
            result = [line for line in _lines(args.out) if line["variant"] == variant][-1]
            _say(
                f"PASS  {variant:<6} {result['experts']} of {result['of_experts']} experts,"
                f" {result['tokens_per_s']:.0f} tokens/s, step {result['step_s']:.4f} s,"
                f" peak {result['peak_gb']:.3f} GB [{seconds:.0f} s]"
            )
            continue
        failed = 1
        error = f"ended at the deadline after {seconds:.0f} s" if code is None else last_error(log.read_text())
        _append(args.out, {"variant": variant, "error": error, "log": str(log)})
        _say(f"FAIL  {variant:<6} {error} [{seconds:.0f} s] (its log: {log})")
    _say(headline(args.out))
    return failed


if __name__ == "__main__":
    sys.exit(main())
