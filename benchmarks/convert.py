"""Conversion speed and peak memory of ``fabric_hsdp.checkpoint`` against torch's own converters, same run.

Builds a ~0.5 GiB LLaMA-shaped fp32 checkpoint (random tensors, dim 1024) under /tmp, then measures each
conversion in a fresh subprocess: seconds, the subprocess's resident memory right after imports (footprint) and its
peak (VmHWM, reset after imports). Anchors: ``torch_save_to_dcp`` / ``dcp_to_torch_save`` (and, for DCP ->
safetensors, torch's DCP load of the whole state dict + ``safetensors.torch.save_file``), and the disk's raw write
speed from ``dd ... oflag=direct``.

Targets: ours peak over footprint <= largest tensor + 64 MiB; ours time <= 0.5x torch's.

Each pair (ours, anchor) runs alternately ``--repeats`` times; best and median seconds are reported, since on a
shared machine the spread is large.

Run: ``python benchmarks/convert.py [--repeats 3] [--keep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _status() -> dict[str, int]:
    with open("/proc/self/status") as file:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in file if line.startswith(("VmRSS", "VmHWM"))}


def _worker(case: str, source: str, dest: str) -> None:
    """Run one conversion in this (fresh) process and print its figures as JSON."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    from fabric_hsdp.checkpoint.writers.convert import convert_checkpoint

    def torch_dcp_to_safetensors(source: str, dest: str) -> None:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state_dict: dict = {}
        reader = FileSystemReader(source)
        _load_state_dict(state_dict, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        save_file(state_dict, dest)

    run = {
        "ours": lambda: convert_checkpoint(source, dest),
        "torch_save_to_dcp": lambda: torch_save_to_dcp(source, dest),
        "dcp_to_torch_save": lambda: dcp_to_torch_save(source, dest),
        "torch_load+save_file": lambda: torch_dcp_to_safetensors(source, dest),
    }[case]
    footprint = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # VmHWM := current RSS, so the peak is the conversion's
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "footprint": footprint, "hwm": _status()["VmHWM"]}))


def _build_checkpoint(path: Path) -> tuple[int, int]:
    import torch

    generator = torch.Generator().manual_seed(0)
    dim, hidden, vocab, layers = 1024, 2816, 32000, 6
    state = {"transformer.wte.weight": torch.randn(vocab, dim, generator=generator)}
    for i in range(layers):
        prefix = f"transformer.h.{i}."
        state[prefix + "norm_1.weight"] = torch.randn(dim, generator=generator)
        state[prefix + "attn.qkv.weight"] = torch.randn(3 * dim, dim, generator=generator)
        state[prefix + "attn.proj.weight"] = torch.randn(dim, dim, generator=generator)
        state[prefix + "norm_2.weight"] = torch.randn(dim, generator=generator)
        state[prefix + "mlp.fc_1.weight"] = torch.randn(hidden, dim, generator=generator)
        state[prefix + "mlp.fc_2.weight"] = torch.randn(hidden, dim, generator=generator)
        state[prefix + "mlp.proj.weight"] = torch.randn(dim, hidden, generator=generator)
    state["transformer.ln_f.weight"] = torch.randn(dim, generator=generator)
    state["lm_head.weight"] = torch.randn(vocab, dim, generator=generator)
    torch.save(state, path)
    return sum(t.nbytes for t in state.values()), max(t.nbytes for t in state.values())


def _disk_write_speed(directory: Path) -> float:
    """Bytes/s of ``dd if=/dev/zero bs=1M count=512 oflag=direct`` into ``directory``."""
    target = directory / "dd.bin"
    result = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=512", "oflag=direct"], capture_output=True, text=True
    )
    target.unlink(missing_ok=True)
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr)
    if result.returncode != 0 or not match:
        raise RuntimeError(f"dd failed: {result.stderr.strip()}")
    return int(match.group(1)) / float(match.group(2))


def _warm(path: Path) -> None:
    for file in [path] if path.is_file() else sorted(path.iterdir()):
        with open(file, "rb") as stream:
            while stream.read(64 * MIB):
                pass


def _run_once(case: str, source: Path, dest: Path) -> dict[str, float]:
    if dest.is_dir():
        shutil.rmtree(dest)
    dest.unlink(missing_ok=True)
    subprocess.run(["sync"], check=True)  # earlier runs' dirty pages must not slow this one
    _warm(source)  # every run starts with its input in the page cache, whatever ran before
    result = subprocess.run(
        [sys.executable, __file__, "--worker", case, str(source), str(dest)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    if result.returncode != 0:
        raise RuntimeError(f"{case} {source.name} -> {dest.name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _measure_pair(pair: list[tuple[str, Path, Path]], repeats: int) -> list[dict[str, Any]]:
    """Run ours and the anchor alternately ``repeats`` times, so a change in machine load hits both alike."""
    runs: list[list[dict[str, float]]] = [[] for _ in pair]
    for _ in range(repeats):
        for index, (case, source, dest) in enumerate(pair):
            runs[index].append(_run_once(case, source, dest))
    summary = []
    for (case, _, _), figures in zip(pair, runs):
        seconds = sorted(run["seconds"] for run in figures)
        worst = max(figures, key=lambda run: run["hwm"] - run["footprint"])
        summary.append(
            {
                "case": case,
                "best": seconds[0],
                "median": statistics.median(seconds),
                "footprint": worst["footprint"],
                "hwm": worst["hwm"],
            }
        )
    return summary


def _check_equal(reference: Path, produced: Path) -> bool:
    import torch

    from fabric_hsdp.checkpoint import open_checkpoint

    expected = torch.load(reference, mmap=True, weights_only=True)
    with open_checkpoint(produced) as source:
        return sorted(source.keys()) == sorted(expected) and all(
            torch.equal(source.read(name), tensor) for name, tensor in expected.items()
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per case, alternating with the anchor")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--worker", nargs=3, metavar=("CASE", "SOURCE", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(*args.worker)
        return
    work = Path(tempfile.mkdtemp(prefix="fabric_hsdp_bench_", dir="/tmp"))
    try:
        total, largest = _build_checkpoint(work / "llama.pth")
        disk = _disk_write_speed(work)
        print(f"checkpoint: {total / MIB:.0f} MiB fp32, largest tensor {largest / MIB:.0f} MiB")
        print(f"disk: dd if=/dev/zero bs=1M count=512 oflag=direct writes {disk / MIB:.0f} MiB/s")
        print(f"load average before: {' '.join(f'{load:.1f}' for load in os.getloadavg())} on {os.cpu_count()} CPUs")
        # Both DCP -> X pairs read the same DCP directory (the one torch wrote), so their inputs are identical.
        pairs = [
            (
                "pth -> DCP",
                [
                    ("ours", work / "llama.pth", work / "ours_dcp"),
                    ("torch_save_to_dcp", work / "llama.pth", work / "torch_dcp"),
                ],
            ),
            (
                "DCP -> pth",
                [
                    ("ours", work / "torch_dcp", work / "ours.pth"),
                    ("dcp_to_torch_save", work / "torch_dcp", work / "torch.pth"),
                ],
            ),
            (
                "DCP -> safetensors",
                [
                    ("ours", work / "torch_dcp", work / "ours.safetensors"),
                    ("torch_load+save_file", work / "torch_dcp", work / "torch.safetensors"),
                ],
            ),
        ]
        results = [(conversion, _measure_pair(pair, args.repeats)) for conversion, pair in pairs]
        print(f"load average after: {' '.join(f'{load:.1f}' for load in os.getloadavg())}")
        target = largest + 64 * MIB
        header = f"{'conversion':<20}{'impl':<22}{'best s':>7}{'median':>7}{'MiB/s':>7}{'footprint':>10}{'VmHWM':>7}"
        print(f"\n{header}{'peak-fp':>8}  memory target")
        for conversion, figures in results:
            for run in figures:
                peak = run["hwm"] - run["footprint"]
                mark = ("ok" if peak <= target else "MISSED") if run["case"] == "ours" else ""
                print(
                    f"{conversion:<20}{run['case']:<22}{run['best']:>7.2f}{run['median']:>7.2f}"
                    f"{total / run['best'] / MIB:>7.0f}{run['footprint'] / MIB:>9.0f}M{run['hwm'] / MIB:>6.0f}M"
                    f"{peak / MIB:>7.0f}M  {mark}"
                )
        print(f"\nmemory target: peak over footprint <= {target / MIB:.0f} MiB (largest tensor + 64 MiB)")
        print(f"disk limit: {total / disk:.2f} s to write {total / MIB:.0f} MiB at dd's {disk / MIB:.0f} MiB/s")
        for conversion, (ours, theirs) in results:
            best, median = ours["best"] / theirs["best"], ours["median"] / theirs["median"]
            memory = (ours["hwm"] - ours["footprint"]) / max(1, theirs["hwm"] - theirs["footprint"])
            verdict = "ok" if best <= 0.5 else "MISSED (target <= 0.5x)"
            print(
                f"{conversion:<20} time ours/{theirs['case']}: best {best:.2f}x, median {median:.2f}x {verdict};"
                f" peak memory {memory:.2f}x"
            )
        same = _check_equal(work / "llama.pth", work / "ours.pth") and _check_equal(
            work / "llama.pth", work / "ours.safetensors"
        )
        print(f"outputs bit-exact against the source: {same}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
