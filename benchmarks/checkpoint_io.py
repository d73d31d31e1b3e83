"""Sharded checkpoint save/load throughput: ``HybridFSDPStrategy`` against Lightning's ``ModelParallelStrategy``.

A LLaMA-shaped fp32 model (default ``config_for_parameters(125)``: 126M parameters, 504 MB) with AdamW state (one
real training step, so ``exp_avg``/``exp_avg_sq`` add 1 GB; 1.51 GB on disk) on 2 simulated nodes x 2 CPU ranks
(gloo). Variants, each in fresh processes:

* ``ours``: ``HybridFSDPStrategy()`` (shard within a node, replicate across the 2 nodes), default sharded save;
* ``ours-async``: the same with ``async_save=True``: the save figure is the time ``fabric.save`` blocks (shards
  copied to CPU memory); the time until the checkpoint is committed (``wait_for_checkpoint()``) is printed below the
  table, with the process's peak resident memory from just before ``fabric.save`` until the commit (``VmHWM``
  reset through ``/proc/self/clear_refs``, less file pages mapped meanwhile; glibc told to return freed buffers of
  128 KiB and more at once, so memory the training step freed does not hide the save's) as a fraction of the
  rank's state: at most 1/R + 10 % (0.55 at R = 2) besides the file writer's two 16 MiB buffers (a fixed cost, 0.21
  of the state at ``--quick``, 0.04 at the default size), else the run fails;
* ``ours-split`` (only with ``--variants``): the same with ``split_replica_reads=True``: each replica reads half of
  its shards and all-gathers the other half over gloo;
* ``lightning``: ``ModelParallelStrategy(parallelize_fn)`` with ``parallelize_fn`` = ``fully_shard`` each layer,
  then the root, over ``device_mesh["data_parallel"]``, sized ``data_parallel=4, tensor_parallel=1`` (FSDP over all
  ranks). Lightning's default sizes (data_parallel = 2 nodes, tensor_parallel = 2) would leave the TP dim unused:
  its two ranks hold the same shard but never average gradients, so they drift apart after one step and the DCP
  checkpoint (which keeps one copy of duplicated chunks) cannot restore both;
* ``lightning-hsdp``: the same ``parallelize_fn`` over Lightning's whole 2-D mesh (2 x 2), which FSDP2 runs as HSDP:
  the same topology as ours, so each rank holds and loads as many bytes as ours (twice as many as ``lightning``).

For each: ``fabric.save(dir, {"model", "optimizer", "step"})``; drop the page cache (``sync; echo 3 >
/proc/sys/vm/drop_caches``, root only); ``fabric.load(dir, state)`` into a fresh meta-initialised model and a fresh
optimizer on the same topology (1st load, cold), checked bit-exact against the saved model and optimizer shards; the
same load again (2nd load, warm: file pages cached).

Each call is timed on every rank after a barrier; the figure is the slowest rank's. MB/s = bytes of the checkpoint
directory on disk / those seconds (MB = 10^6 bytes). The disk's limits: ``dd if=/dev/zero of=<same dir>/ddtest bs=1M
count=1024 oflag=direct`` (write) and reading that file back with ``iflag=direct`` (read), before and after the
variants, the faster of each used. CPU seconds (user + system, summed over the ranks) are printed too: on a shared
machine they move far less than wall seconds. By default every variant runs twice, the order reversed in the second
round (ours, Lightning, Lightning-HSDP, then back), and the ratios use each variant's best MB/s.

Target: ours >= Lightning (ratio of MB/s >= 1.0) for the save and both loads.

Run: ``python benchmarks/checkpoint_io.py`` (about 8 minutes here), ``--quick`` (25M parameters, one round, about a
minute).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import (  # noqa: E402 (after the sys.path line)
    MB,
    VARIANT_NAMES,
    VariantFailed,
    build_model,
    describe_config,
    disk_speed,
    drop_page_cache,
    machine_load,
    make_fabric,
    release,
    run_ranks,
    timed,
)

RANK_FUNCTION = "benchmarks.checkpoint_io:save_and_load"
NAMES = {
    **VARIANT_NAMES,
    "ours-async": "HybridFSDPStrategy async_save",
    "ours-split": "HybridFSDPStrategy split reads",
}
OPTIONS = {"ours-async": {"async_save": True}, "ours-split": {"split_replica_reads": True}}
PHASES = ("save", "cold", "warm")
SEQ_LEN = 32
ASYNC_PEAK_BOUND = 1.1 / 2  # an async save's peak host memory, as a fraction of the rank's state: 1/R + 10 %, R = 2


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def _local_tensors(model: Any, optimizer: Any) -> dict[str, Any]:
    """Every local shard of the model and of the optimizer state, by name, as raw bytes views (NaN-safe equality)."""
    import torch
    from torch.distributed.tensor import DTensor

    def raw(tensor: Any) -> Any:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.detach().reshape(-1).view(torch.uint8)

    names = {id(param): name for name, param in model.named_parameters()}
    out = {f"model.{name}": raw(tensor) for name, tensor in model.state_dict().items()}
    for param, entries in optimizer.state.items():
        for key, value in entries.items():
            out[f"optimizer.{names[id(param)]}.{key}"] = raw(value)
    return out


def _train_step(fabric: Any, model: Any, optimizer: Any) -> None:
    import torch

    from examples.tiny_llama import loss_fn

    config = getattr(model, "module", model).config
    generator = torch.Generator().manual_seed(fabric.global_rank)
    tokens = torch.randint(0, config.vocab_size, (1, SEQ_LEN + 1), generator=generator)
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def save_and_load(variant: str, millions: float, workdir: str, drop_cache: bool, num_nodes: int, devices: int) -> dict:
    """Train one step, save, drop the page cache, load twice into a fresh model; return this rank's figures."""
    import torch

    from fabric_hsdp.checkpoint.core.fileio import DirectFileWriter

    background = variant == "ours-async"
    options = OPTIONS.get(variant, {})
    if options:
        variant = "ours"
    if background:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: freed large buffers go back at once
    fabric = make_fabric(variant, num_nodes, devices, **options)
    model = build_model(fabric, variant, millions)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train_step(fabric, model, optimizer)
    path = Path(workdir) / f"checkpoint-{variant}"
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now: the peak below is the save's
    before = _memory_status()
    save_seconds, save_cpu, _ = timed(
        fabric, lambda: fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    )
    # async_save: fabric.save returned once the shards were copied; the write goes on until committed
    wait_seconds, wait_cpu, _ = timed(fabric, fabric.strategy.wait_for_checkpoint) if background else (0.0, 0.0, None)
    after = _memory_status()  # the save's peak, the kept staging block included
    peak_bytes = after["VmHWM"] - before["VmRSS"] - max(0, after["RssFile"] - before["RssFile"])
    writer_bytes = 2 * DirectFileWriter.BLOCK if background else 0  # its two aligned buffers (one writing thread)
    saved_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if fabric.global_rank == 0 else 0
    dropped = drop_page_cache() if drop_cache and fabric.global_rank == 0 else False
    fabric.barrier()

    fresh = build_model(fabric, variant, millions)
    fresh_optimizer = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    cold_seconds, cold_cpu, _ = timed(fabric, lambda: fabric.load(path, state))
    expected, loaded = _local_tensors(model, optimizer), _local_tensors(fresh, fresh_optimizer)
    differ = sorted(expected.keys() ^ loaded.keys())
    differ += [name for name in expected if name in loaded and not torch.equal(expected[name], loaded[name])]
    differ += [] if state["step"] == 1 else [f"step={state['step']!r}"]
    warm_seconds, warm_cpu, _ = timed(fabric, lambda: fabric.load(path, state))
    local_bytes = sum(t.numel() for t in loaded.values())
    release(fabric, [model, fresh])
    return {
        "save": save_seconds,
        "committed": save_seconds + wait_seconds,
        "cold": cold_seconds,
        "warm": warm_seconds,
        "cpu": {"save": save_cpu + wait_cpu, "cold": cold_cpu, "warm": warm_cpu},
        "bytes": saved_bytes,
        "dropped": dropped,
        "exact": not differ,
        "differ": differ,
        "local_bytes": local_bytes,
        "peak_bytes": peak_bytes,
        "writer_bytes": writer_bytes,
    }


def _memory_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM`` and ``RssFile`` of this process (``/proc/self/status``), in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssFile"):
            values[key] = int(rest.split()[0]) * 1024
    return values


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


def _run_variant(variant: str, args: argparse.Namespace, work: Path, timeout: float) -> dict[str, Any]:
    ranks = run_ranks(
        RANK_FUNCTION,
        {"variant": variant, "millions": args.millions, "workdir": str(work), "drop_cache": not args.warm},
        timeout=timeout,
        out_dir=work / f"launch-{variant}-{time.monotonic_ns()}",
    )
    shutil.rmtree(work / f"checkpoint-{variant}", ignore_errors=True)
    figures = {phase: max(rank[phase] for rank in ranks) for phase in (*PHASES, "committed")}
    figures.update(
        bytes=ranks[0]["bytes"],
        dropped=ranks[0]["dropped"],
        exact=all(rank["exact"] for rank in ranks),
        differ=sorted({name for rank in ranks for name in rank["differ"]}),
        local_bytes=[rank["local_bytes"] for rank in ranks],
        peak_fraction=max(rank["peak_bytes"] / rank["local_bytes"] for rank in ranks),
        # what scales with the state: the peak less the file writer's fixed buffers
        state_peak_fraction=max((rank["peak_bytes"] - rank["writer_bytes"]) / rank["local_bytes"] for rank in ranks),
        cpu={phase: sum(rank["cpu"][phase] for rank in ranks) for phase in PHASES},
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Sharded save/load MB/s of HybridFSDPStrategy vs Lightning's ModelParallelStrategy, 2x2 CPU ranks.",
        epilog="Prints one row per variant and repeat, the ratios ours/Lightning and ours/disk, and exits 1 if a"
        " variant fails, a load is not bit-exact, or an async save's peak host memory is over 1/R + 10 %.",
    )
    parser.add_argument("--quick", action="store_true", help="25M-parameter model (a smoke run of about a minute)")
    parser.add_argument("--millions", type=float, help="model size in millions of parameters (default 125, quick 25)")
    parser.add_argument(
        "--repeats",
        type=int,
        help="rounds of all variants, the order reversed each round; each variant's best is used (default 2, quick 1)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(name for name in NAMES if name != "ours-split"),
        help=f"comma-separated subset of {', '.join(NAMES)} (default: all; ratios need ours and an anchor)",
    )
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before the first load")
    parser.add_argument("--timeout", type=float, help="seconds per variant before its ranks are killed")
    parser.add_argument("--dir", default="/tmp", help="where the temporary directory goes (default /tmp)")
    args = parser.parse_args(argv)
    args.millions = args.millions or (25.0 if args.quick else 125.0)
    args.repeats = args.repeats or (1 if args.quick else 2)
    timeout = args.timeout or (300.0 if args.quick else 900.0)
    order = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not order or any(v not in NAMES for v in order):
        parser.error(f"--variants takes names from {list(NAMES)}, got {args.variants!r}")

    work = Path(tempfile.mkdtemp(prefix="fabric_hsdp_ckpt_io_", dir=args.dir))
    try:
        print(f"model: {describe_config(args.millions)}, AdamW state, 2 nodes x 2 CPU ranks (gloo)")
        print(f"machine: {machine_load()} (start)")
        disk = [disk_speed(work)]
        runs: list[tuple[str, int, dict[str, Any]]] = []
        for repeat in range(args.repeats):
            for variant in order if repeat % 2 == 0 else order[::-1]:
                runs.append((variant, repeat + 1, _run_variant(variant, args, work, timeout)))
        disk.append(disk_speed(work))
        print(f"machine: {machine_load()} (end)")
        return _report(runs, disk)
    except VariantFailed as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _report(runs: list[tuple[str, int, dict[str, Any]]], disk: list[tuple[float, float]]) -> int:
    size = runs[0][2]["bytes"]
    dropped = all(figures["dropped"] for _, _, figures in runs)
    write_limit, read_limit = max(write for write, _ in disk), max(read for _, read in disk)
    print(f"checkpoint on disk: {size / MB:.1f} MB (model + AdamW exp_avg/exp_avg_sq/step + meta.pt)")
    print(
        "disk: dd if=/dev/zero of=<dir>/ddtest bs=1M count=1024 oflag=direct: "
        + ", ".join(f"{write / MB:.0f}" for write, _ in disk)
        + f" MB/s (before, after): write limit {write_limit / MB:.0f} MB/s; the same file read back with"
        " iflag=direct: " + ", ".join(f"{read / MB:.0f}" for _, read in disk) + f" MB/s: read limit"
        f" {read_limit / MB:.0f} MB/s"
    )
    first = "cold (page cache dropped after the save)" if dropped else "NOT cold (not dropped: --warm, or no root)"
    print(f"1st load: {first}; 2nd load: warm (same load again, file pages cached)")
    print()
    header = f"{'variant':<31}{'run':>4}{'save s':>8}{'MB/s':>7}{'1st load s':>12}{'MB/s':>7}{'2nd load s':>12}"
    print(f"{header}{'MB/s':>7}  exact")
    best: dict[str, dict[str, float]] = {}
    for variant, repeat, figures in runs:
        rates = {phase: size / figures[phase] / MB for phase in PHASES}
        for phase, rate in rates.items():
            best.setdefault(variant, {})[phase] = max(best.get(variant, {}).get(phase, 0.0), rate)
        print(
            f"{NAMES[variant]:<31}{repeat:>4}{figures['save']:>8.2f}{rates['save']:>7.0f}"
            f"{figures['cold']:>12.2f}{rates['cold']:>7.0f}{figures['warm']:>12.2f}{rates['warm']:>7.0f}"
            f"  {figures['exact']}"
        )
    print("(seconds: max over the 4 ranks of the fabric.save / fabric.load call, started after a barrier)")
    for variant, repeat, figures in runs:
        if variant == "ours-async":
            print(
                f"{NAMES[variant]} run {repeat}: fabric.save returned after {figures['save']:.2f} s, the checkpoint"
                f" was committed after {figures['committed']:.2f} s ({size / figures['committed'] / MB:.0f} MB/s);"
                f" peak resident memory from before the save to the commit: {figures['peak_fraction']:.2f} of the"
                f" rank's state (largest rank), {figures['state_peak_fraction']:.2f} less the file writer's two"
                f" buffers (at most {ASYNC_PEAK_BOUND:.2f}: 1/R + 10 % at R = 2)"
            )
    print(f"\n{'CPU s, sum of 4 ranks':<31}{'run':>4}{'save':>8}{'1st load':>10}{'2nd load':>10}{'MB per rank':>13}")
    for variant, repeat, figures in runs:
        cpu = figures["cpu"]
        per_rank = max(figures["local_bytes"]) / MB
        print(
            f"{NAMES[variant]:<31}{repeat:>4}{cpu['save']:>8.1f}{cpu['cold']:>10.1f}{cpu['warm']:>10.1f}"
            f"{per_rank:>13.0f}"
        )
    print("(MB per rank: model + optimizer bytes one rank holds and must load; CPU s barely depend on other jobs)")
    columns = f"{'ours/Lightning':>15}{'target':>9}{'':>6}{'ours/Lightning-HSDP':>21}{'ours/disk':>11}"
    print(f"\n{'ratio of best MB/s':<20}{columns}")
    for variant, phase, label, limit in (
        ("ours", "save", "save", write_limit),
        ("ours", "cold", "1st load", read_limit),
        ("ours", "warm", "2nd load", read_limit),
        ("ours-async", "save", "async save returns", write_limit),
        ("ours-split", "cold", "split: 1st load", read_limit),
        ("ours-split", "warm", "split: 2nd load", read_limit),
    ):
        if variant not in best:
            continue
        ours = best.get(variant, {}).get(phase, math.nan)
        ratio = ours / best.get("lightning", {}).get(phase, math.nan)
        hsdp = ours / best.get("lightning-hsdp", {}).get(phase, math.nan)
        verdict = "pass" if ratio >= 1.0 else "MISS" if ratio < 1.0 else "-"
        print(f"{label:<20}{ratio:>15.3f}{'>= 1.00':>9}{verdict:>6}{hsdp:>21.3f}{ours * MB / limit:>11.2f}")
    print("(ours/disk: against dd's write limit for the save, its direct-read limit for the loads)")
    ok = True
    for variant, repeat, figures in runs:
        if not figures["exact"]:
            differ = figures["differ"]
            print(
                f"FAILED: {NAMES[variant]} run {repeat}: the load did not restore {len(differ)} saved shard(s)"
                f" bit-exactly, e.g. {differ[:4]}",
                file=sys.stderr,
            )
            ok = False
        if variant == "ours-async" and figures["state_peak_fraction"] > ASYNC_PEAK_BOUND:
            print(
                f"FAILED: {NAMES[variant]} run {repeat}: the save's peak host memory less the file writer's"
                f" buffers was {figures['state_peak_fraction']:.2f} of the rank's state, over {ASYNC_PEAK_BOUND:.2f}"
                " (1/R + 10 %)",
                file=sys.stderr,
            )
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
