"""Memory and time of loading a consolidated (raw) state dict into a meta-initialised sharded model, per rank.

The file is ``torch.save`` of a flat fp32 state dict of the LLaMA-shaped model from ``config_for_parameters(125)``
(126M parameters, 504 MB; largest tensor the 32000 x 512 embedding, 62.5 MiB). On 2 simulated nodes x 2 CPU ranks,
each variant runs in fresh processes: build the model under ``fabric.init_module(empty_init=True)``,
``fabric.setup_module``, then load the file:

* ``slice`` / ``turns`` / ``rank0``: ``HybridFSDPStrategy(load_mode=...)`` and ``fabric.load_raw(path, model)``;
* ``lightning``: Lightning's ``ModelParallelStrategy`` (``fully_shard`` each layer + root over its data-parallel
  mesh, FSDP over the 4 ranks) and ``fabric.load_raw(path, model)``: Lightning's current best for a raw file
  (``torch.load(mmap=True)`` on every rank, then ``set_model_state_dict(broadcast_from_rank0=True)`` per tensor);
* ``naive``: what users did before (see /work/shared/seeds): ``torch.load(path, map_location="cpu")`` on every rank,
  then ``set_model_state_dict(model, state, full_state_dict=True)`` (each rank keeps its slice), under our strategy;
* ``turns-legacy``: ``load_mode="turns"`` on the same state dict saved in torch's legacy (non-zip) format, the case
  turns exist for: such a file cannot be read piecewise, so each reader holds all of it during its turn;
* ``lightning-hsdp`` (only with ``--variants``): Lightning's ``load_raw`` with ``fully_shard`` over its whole 2 x 2
  mesh (HSDP, our topology);
* ``slice-tp``: ``HybridFSDPStrategy(tensor_parallel_size=2)`` (plan ``"auto"``, the model's ``_tp_plan``), mesh
  ``(replicate, shard, tensor) = (2, 1, 2)``: each node holds one copy of the model, split by tensor parallelism
  between its 2 ranks, the same shard size per rank as the TP=1 ``slice`` row (a user adding one argument), so the
  two rows differ only in the boxes a rank reads (half the columns of the row-wise ``wo``/``w2``, half the rows of
  the rest); ``fabric.load_raw(path, model)`` in slice mode;
* ``lightning-tp``: Lightning's ``ModelParallelStrategy(parallelize_fn, data_parallel_size=2,
  tensor_parallel_size=2)`` with a user ``parallelize_fn`` (``parallelize_module`` with the same plan written with
  torch's styles, then ``fully_shard`` of each layer and the root on the data-parallel mesh) and its
  ``fabric.load_raw(path, model)``. Lightning has no replicate dim: its ranks hold a quarter of the model each, ours
  (``slice-tp``) half, so ours reads twice the bytes per rank;
* ``slice-tp-world`` (only with ``--variants``): ``slice-tp`` with ``shard_size="world"``, mesh ``(1, 2, 2)``: the
  same layout as ``lightning-tp`` (FSDP across the nodes over the TP-split tensors, ``_StridedShard`` placements).

Memory, per rank, relative to the process's own value just before the load call: a background thread reads
``/proc/self/status`` every 5 ms (``RssAnon``, ``RssFile``, ``RssShmem``); "peak anon" is the largest ``RssAnon``
seen minus the one just before. Anonymous memory has no kernel high-water mark, hence the sampling; it is exact
as long as the sampler gets the GIL, which the loaders release in their reads and copies. "Peak RSS" (anonymous
plus file pages, e.g. an mmap of the checkpoint) is exact: ``VmHWM`` after writing ``5`` to ``/proc/self/clear_refs``
just before the load, minus ``VmRSS`` then; the sampled anon+file+shmem peak is printed next to it to show how
closely the sampler tracks the true peak. The page cache is dropped before each variant (root only) so reads are
cold. Every load is checked value-exact against the file afterwards, twice: each rank's local shard against the
file's box for it (``global_box(tensor).slices()``), and every tensor gathered whole (``DTensor.full_tensor()``,
torch's own redistribution, independent of our box arithmetic) against the file's tensor.

Targets:

* ``slice``: peak anon per rank <= 1.1 x its own shard + the largest tensor + 96 MiB; wall time (slowest rank)
  <= 0.5 x Lightning's. The same for ``slice-tp`` (and ``slice-tp-world``) against ``lightning-tp``.
* ``turns`` (and ``turns-legacy``): never more than one reader's copy per node: the ranks of a node read one after
  another (their read intervals, recorded around our ``_load_slices``, do not overlap) and the node's summed anon
  above baseline, over time, stays within the largest single rank's peak (+10% + 8 MiB for sampling jitter). The
  table also shows what each rank still held while the other rank of its node was reading.

Run: ``python benchmarks/load_memory.py`` (about 2 minutes here), ``--quick`` (25M parameters, about a minute).
"""

from __future__ import annotations

import argparse
import bisect
import gc
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import (  # noqa: E402 (after the sys.path line)
    MIB,
    RANKS_PER_NODE,
    VariantFailed,
    build_model,
    describe_config,
    drop_page_cache,
    machine_load,
    make_fabric,
    model_config,
    release,
    run_ranks,
    tensor_shapes,
    timed,
)

RANK_FUNCTION = "benchmarks.load_memory:load_and_measure"
# name -> (label, strategy, our load_mode or None, which file)
VARIANTS = {
    "slice": ("ours slice", "ours", "slice", "zip"),
    "turns": ("ours turns", "ours", "turns", "zip"),
    "rank0": ("ours rank0", "ours", "rank0", "zip"),
    "lightning": ("Lightning load_raw", "lightning", None, "zip"),
    "naive": ("naive torch.load", "ours", None, "zip"),
    "turns-legacy": ("ours turns, legacy file", "ours", "turns", "legacy"),
    "lightning-hsdp": ("Lightning-HSDP load_raw", "lightning-hsdp", None, "zip"),
    "slice-tp": ("ours slice TP=2", "ours", "slice", "zip"),
    "lightning-tp": ("Lightning load_raw TP=2", "lightning-tp", None, "zip"),
    "slice-tp-world": ("ours slice TP=2 (1,2,2)", "ours", "slice", "zip"),
}
# Our strategy's arguments besides load_mode, per variant
STRATEGY_OPTIONS: dict[str, dict[str, Any]] = {
    "slice-tp": {"tensor_parallel_size": 2},
    "slice-tp-world": {"tensor_parallel_size": 2, "shard_size": "world"},
}
# Variants with the memory and time targets -> the Lightning variant their time is compared with
TARGETS = {"slice": "lightning", "slice-tp": "lightning-tp", "slice-tp-world": "lightning-tp"}
DEFAULT_VARIANTS = ("slice", "turns", "rank0", "lightning", "naive", "turns-legacy", "slice-tp", "lightning-tp")
SAMPLE_SECONDS = 0.005


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def read_status() -> dict[str, int]:
    """``RssAnon``, ``RssFile``, ``RssShmem``, ``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    wanted = ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM")
    with open("/proc/self/status") as file:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in file if line.startswith(wanted)}


class MemorySampler(threading.Thread):
    """Reads ``/proc/self/status`` every ``interval`` seconds into ``samples``: (monotonic s, anon, file+shmem)."""

    def __init__(self, interval: float = SAMPLE_SECONDS) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []
        self._stop_event = threading.Event()

    def sample(self) -> None:
        status = read_status()
        self.samples.append((time.monotonic(), status["RssAnon"], status["RssFile"] + status["RssShmem"]))

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


def _record_reads(intervals: list[tuple[float, float]]) -> None:
    """Record when this rank reads the file in our slice/turns loader (instrumentation of a private function; for
    the other variants the whole load call counts as the read)."""
    from fabric_hsdp.checkpoint.training import raw_load as loading

    original = loading._load_slices

    def load_slices(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            intervals.append((started, time.monotonic()))

    loading._load_slices = load_slices


def _naive_load(path: str, model: Any) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = torch.load(path, map_location="cpu", weights_only=True)
    set_model_state_dict(getattr(model, "module", model), state, options=StateDictOptions(full_state_dict=True))


def _check_against_file(path: str, model: Any) -> list[str]:
    """Names of the model tensors whose local shard differs from the file's slice (read after the measurement)."""
    import torch
    from torch.distributed.tensor import DTensor

    from fabric_hsdp.checkpoint.core.boxes import global_box

    expected = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    wrong = []
    for name, tensor in getattr(model, "module", model).state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if name not in expected or not torch.equal(local, expected[name][global_box(tensor).slices()]):
            wrong.append(name)
    return wrong


def _check_gathered(path: str, model: Any) -> list[str]:
    """Names of the model tensors that, gathered whole by DTensor (a collective: every rank calls this), differ from
    the file's tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    expected = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    wrong = []
    for name, tensor in getattr(model, "module", model).state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if name not in expected or not torch.equal(full, expected[name]):
            wrong.append(name)
    return wrong


def load_and_measure(
    variant: str, path: str, reference: str, millions: float, num_nodes: int, devices: int
) -> dict[str, Any]:
    """Set up the meta-initialised model, load ``path`` the ``variant`` way, check the values against ``reference``
    (the zip file, which can be memory-mapped); return time and memory figures."""
    from torch.distributed.tensor import DTensor

    _, strategy, load_mode, _ = VARIANTS[variant]
    options = {"load_mode": load_mode} if load_mode else {}
    options.update(STRATEGY_OPTIONS.get(variant, {}))
    fabric = make_fabric(strategy, num_nodes, devices, **options)
    mesh = fabric.strategy.device_mesh
    mesh_text = f"{tuple(mesh.shape)} {mesh.mesh_dim_names}"
    model = build_model(fabric, strategy, millions)
    tensors = getattr(model, "module", model).state_dict().values()
    shard = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)
    reads: list[tuple[float, float]] = []
    _record_reads(reads)
    load = (lambda: _naive_load(path, model)) if variant == "naive" else (lambda: fabric.load_raw(path, model))

    gc.collect()
    fabric.barrier()
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # VmHWM := VmRSS now, so the high-water mark below is the load's
    before = read_status()
    sampler = MemorySampler()
    sampler.sample()
    sampler.start()
    started = time.monotonic()
    seconds, cpu, _ = timed(fabric, load)
    ended = time.monotonic()
    sampler.stop()
    after = read_status()
    fabric.barrier()
    wrong = _check_against_file(reference, model)
    wrong_gathered = _check_gathered(reference, model)
    release(fabric, [model])
    if not reads:
        reads = [(started, ended)]
    return {
        "seconds": seconds,
        "cpu": cpu,
        "shard": shard,
        "before": before,
        "after": after,
        "peak_anon": max(anon for _, anon, _ in sampler.samples) - before["RssAnon"],
        "peak_sampled_total": max(anon + file for _, anon, file in sampler.samples)
        - before["RssAnon"]
        - before["RssFile"]
        - before["RssShmem"],
        "peak_rss": after["VmHWM"] - before["VmRSS"],
        "samples": [(t, anon - before["RssAnon"]) for t, anon, _ in sampler.samples],
        "reads": reads,
        "wrong": wrong,
        "wrong_gathered": wrong_gathered,
        "mesh": mesh_text,
    }


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


def _write_checkpoint(files: dict[str, Path], millions: float) -> None:
    import torch

    from examples.tiny_llama import Llama

    torch.manual_seed(0)
    model = Llama(model_config(millions))
    torch.save(model.state_dict(), files["zip"])
    torch.save(model.state_dict(), files["legacy"], _use_new_zipfile_serialization=False)
    del model
    gc.collect()


def _node_peak(ranks: list[dict[str, Any]]) -> float:
    """Largest sum over the ranks of one node of their anon above baseline, on the union of their sample times."""
    times = sorted({t for rank in ranks for t, _ in rank["samples"]})
    series = [([t for t, _ in rank["samples"]], [value for _, value in rank["samples"]]) for rank in ranks]
    peak = 0.0
    for t in times:
        total = 0
        for stamps, values in series:
            index = bisect.bisect_right(stamps, t) - 1
            total += values[index] if index >= 0 else 0
        peak = max(peak, total)
    return peak


def _overlap(ranks: list[dict[str, Any]]) -> float:
    """Seconds during which two ranks of a node were reading the file at the same time."""
    intervals = sorted(interval for rank in ranks for interval in rank["reads"])
    overlap, reach = 0.0, -math.inf
    for start, end in intervals:
        overlap += max(0.0, min(end, reach) - start)
        reach = max(reach, end)
    return overlap


def _held_while_others_read(rank: dict[str, Any], members: list[dict[str, Any]]) -> float:
    """Most anon above baseline ``rank`` held while another rank of its node was reading the file."""
    others = [interval for member in members if member is not rank for interval in member["reads"]]
    during = [value for t, value in rank["samples"] if any(start <= t <= end for start, end in others)]
    return max(during) if during else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Per-rank time and memory of loading a raw state dict into a meta-initialised 2x2 sharded model:"
        " our load modes vs Lightning's fabric.load_raw vs naive torch.load on every rank.",
        epilog="Prints a per-rank table with the targets and pass/MISS per row; exits 1 if a variant fails or loads"
        " wrong values.",
    )
    parser.add_argument("--quick", action="store_true", help="25M-parameter model (a smoke run of about a minute)")
    parser.add_argument("--millions", type=float, help="model size in millions of parameters (default 125, quick 25)")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all but lightning-hsdp)",
    )
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before each variant")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the variants this many times, in reverse order every other time; wall times are medians over the"
        " repeats, the per-rank table shows each variant's repeat with the highest peak anon (default 1)",
    )
    parser.add_argument("--timeout", type=float, help="seconds per variant before its ranks are killed")
    parser.add_argument("--dir", default="/tmp", help="where the temporary directory goes (default /tmp)")
    args = parser.parse_args(argv)
    args.millions = args.millions or (25.0 if args.quick else 125.0)
    timeout = args.timeout or (240.0 if args.quick else 600.0)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    work = Path(tempfile.mkdtemp(prefix="fabric_hsdp_load_mem_", dir=args.dir))
    try:
        files = {"zip": work / "llama.pth", "legacy": work / "llama-legacy.pth"}
        _write_checkpoint(files, args.millions)
        path = files["zip"]
        shapes = tensor_shapes(args.millions)
        largest = max(math.prod(shape) for shape in shapes.values()) * 4
        print(
            f"file: {path.name}, torch.save of the flat state dict, {path.stat().st_size / MIB:.1f} MiB (turns-legacy:"
            f" the same with _use_new_zipfile_serialization=False); model {describe_config(args.millions)}"
        )
        print(f"machine: {machine_load()} (start)")
        runs: dict[str, list[list[dict[str, Any]]]] = {variant: [] for variant in variants}
        cold: dict[str, bool] = {}
        for repeat in range(args.repeat):
            for variant in variants if repeat % 2 == 0 else list(reversed(variants)):
                cold[variant] = (False if args.warm else drop_page_cache()) and cold.get(variant, True)
                runs[variant].append(
                    run_ranks(
                        RANK_FUNCTION,
                        {
                            "variant": variant,
                            "path": str(files[VARIANTS[variant][3]]),
                            "reference": str(path),
                            "millions": args.millions,
                        },
                        timeout=timeout,
                        out_dir=work / f"launch-{variant}-{repeat}",
                    )
                )
            if args.repeat > 1:
                print(f"machine: {machine_load()} (after repeat {repeat + 1} of {args.repeat})")
        print(f"machine: {machine_load()} (end)")
        return _report(runs, cold, largest)
    except VariantFailed as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _highest_peak(ranks: list[dict[str, Any]]) -> int:
    return max(rank["peak_anon"] for rank in ranks)


def _report(runs: dict[str, list[list[dict[str, Any]]]], cold: dict[str, bool], largest: int) -> int:
    if all(cold.values()):
        print("page cache: dropped before every variant (cold reads)")
    else:
        print(f"page cache: dropped before {[v for v, c in cold.items() if c]} only; the others read warm")
    repeats = max(len(ranks_per_run) for ranks_per_run in runs.values())
    # a run's wall time is its slowest rank's; with repeats, the median over them
    walls = {variant: [max(rank["seconds"] for rank in ranks) for ranks in runs_] for variant, runs_ in runs.items()}
    wall = {variant: statistics.median(values) for variant, values in walls.items()}
    results = {variant: max(runs_, key=_highest_peak) for variant, runs_ in runs.items()}
    if repeats > 1:
        print(f"{repeats} repeats: per-rank rows are each variant's repeat with the highest peak anon")
    lightning_wall = wall.get("lightning")
    print(
        f"\n{'variant':<24}{'rank':>5}{'load s':>8}{'anon before':>12}{'peak anon':>11}{'anon after':>11}"
        f"{'peak RSS':>10}{'(sampled)':>10}{'shard':>8}  target"
    )
    ok = True
    for variant, ranks in results.items():
        label = VARIANTS[variant][0]
        for rank_index, rank in enumerate(ranks):
            verdict = ""
            retained = rank["after"]["RssAnon"] - rank["before"]["RssAnon"]
            if variant in TARGETS:  # targets are for the default file
                budget = 1.1 * rank["shard"] + largest + 96 * MIB
                passed = rank["peak_anon"] <= budget
                verdict = f"peak anon <= 1.1 x shard + largest + 96 MiB = {budget / MIB:.0f} MiB: "
                verdict += "pass" if passed else "MISS"
            print(
                f"{label:<24}{rank_index:>5}{rank['seconds']:>8.2f}{rank['before']['RssAnon'] / MIB:>11.0f}M"
                f"{rank['peak_anon'] / MIB:>10.0f}M{retained / MIB:>10.0f}M"
                f"{rank['peak_rss'] / MIB:>9.0f}M"
                f"{rank['peak_sampled_total'] / MIB:>9.0f}M{rank['shard'] / MIB:>7.0f}M  {verdict}"
            )
        for repeat, ranks_of_run in enumerate(runs[variant]):
            for rank_index, rank in enumerate(ranks_of_run):
                if rank["wrong"]:
                    ok = False
                    print(
                        f"FAILED: {label} (repeat {repeat + 1}) rank {rank_index} loaded wrong values into"
                        f" {rank['wrong'][:3]}"
                    )
                if rank["wrong_gathered"]:
                    ok = False
                    print(
                        f"FAILED: {label} (repeat {repeat + 1}), gathered on rank {rank_index}: tensors differ from"
                        f" the file: {rank['wrong_gathered'][:3]}"
                    )
    print(
        "(MiB; peak anon, anon after and peak RSS are over the rank's own value just before the load; peak RSS counts"
        " file pages too, (sampled) is the thread's view of it; 'load s' is the call)"
    )

    print(
        "all loads value-exact (each rank's shard against its box of the file, and every tensor gathered whole)"
        if ok
        else "some loads were NOT value-exact (above)"
    )

    tensor_parallel_wall = wall.get("lightning-tp")
    print(f"\n{'variant':<24}{'wall s':>8}{'vs Lightning':>14}{'vs Lightning TP=2':>19}  mesh / target")
    for variant, seconds in wall.items():
        ratio = seconds / lightning_wall if lightning_wall else float("nan")
        tensor_parallel_ratio = seconds / tensor_parallel_wall if tensor_parallel_wall else float("nan")
        verdict = results[variant][0]["mesh"]
        anchor = TARGETS.get(variant)
        if anchor and wall.get(anchor):
            anchor_ratio = seconds / wall[anchor]
            verdict += f"; <= 0.5 x {VARIANTS[anchor][0]}: {'pass' if anchor_ratio <= 0.5 else 'MISS'}"
        print(f"{VARIANTS[variant][0]:<24}{seconds:>8.2f}{ratio:>13.2f}x{tensor_parallel_ratio:>18.2f}x  {verdict}")
    if repeats > 1:
        spread = ", ".join(f"{VARIANTS[v][0]} {min(w):.2f}..{max(w):.2f}" for v, w in walls.items())
        print(f"(wall s: the slowest rank's load call, median of {repeats} repeats; min..max: {spread})")
    else:
        print("(wall s: the slowest rank's load call)")

    turns = [variant for variant in results if VARIANTS[variant][2] == "turns"]
    if turns:
        print(
            f"\n{'turns, per node':<30}{'node peak':>10}{'one reader':>11}{'overlap s':>10}  target: one reader's copy"
            " per node (no overlap, node peak <= 1.1 x one reader + 8 MiB)"
        )
    for variant in turns:
        ranks = results[variant]
        for node in range(len(ranks) // RANKS_PER_NODE):
            members = ranks[node * RANKS_PER_NODE : (node + 1) * RANKS_PER_NODE]
            node_peak = _node_peak(members)
            reader = max(rank["peak_anon"] for rank in members)
            overlap = _overlap(members)
            passed = overlap == 0 and node_peak <= 1.1 * reader + 8 * MIB
            first = node * RANKS_PER_NODE
            held = ", ".join(
                f"rank {first + i}: {_held_while_others_read(r, members) / MIB:.0f}M" for i, r in enumerate(members)
            )
            print(
                f"{VARIANTS[variant][0] + ', node ' + str(node):<30}{node_peak / MIB:>9.0f}M{reader / MIB:>10.0f}M"
                f"{overlap:>10.2f}  {'pass' if passed else 'MISS'} (held while the other reads: {held})"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
