"""``fabric-hsdp dryrun``: its arguments and what it prints. ``fabric_hsdp.cli`` dispatches to it and reports errors.

Not jsonargparse: everything after SCRIPT belongs to the script (``--their --own args``), as with ``python SCRIPT``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

DRYRUN_HELP = """Run a Fabric script as one rank of a cluster, in this process, before queueing for the cluster.

torchrun's variables are set for --rank of --num_nodes x --devices_per_node and the process group is torch's fake
one: every collective returns at once without data, while shapes, placements, allocations and checkpoint reads are
real. Every rank's device is this machine's (cuda:0, or the CPU where there is no GPU). The script stops after
--max_steps optimizer steps; a sharded save writes this rank's files to a scratch directory and commits nothing
(when the script has not saved by then, the dry run saves once for it: --no-save_after_stop skips that, and with
--max_steps 0 it is skipped unless --save_after_stop).
The report: the mesh and this rank's coordinates, peak memory per phase, bytes read and written, the planner's
prediction beside the measured peak. Collectives carry no data: losses are not meaningful.
--no_compute runs the training steps on tensors with shapes and no data (torch's FakeTensorMode) and counts every
allocation they make: a step of a 70B rank in minutes on a CPU, where computing it would take days. Set-up and loads
stay real; the step's figure is then counted allocations (resident memory at its start + the steps' peak of
allocated tensor bytes), not measured memory, and nothing is saved after the first counted forward.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line through the CLI's error path, not argparse's exit(2)
        raise ValueError(f"dryrun: {message} (see fabric-hsdp dryrun --help)")


def dryrun_parser() -> argparse.ArgumentParser:
    """The ``dryrun`` subcommand's parser; options go before SCRIPT, the script's own arguments after it."""
    parser = _Parser(prog="fabric-hsdp dryrun", description=DRYRUN_HELP, allow_abbrev=False)
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes of the cluster to pretend (default 1)")
    parser.add_argument("--devices_per_node", type=int, default=8, help="ranks per node (default 8)")
    parser.add_argument("--rank", type=str, default="0", help="the global rank to play, or all-kinds (default 0)")
    parser.add_argument(
        "--max_steps",
        type=int,
        default=1,
        help="stop after this many optimizer steps (default 1; 0: at the first forward, after set-up and loads)",
    )
    parser.add_argument(
        "--save_after_stop",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="when the script has not saved by the step limit, save this rank's share into scratch as its save would"
        " (GBs at 70B; default: on with --max_steps >= 1, off with 0)",
    )
    parser.add_argument(
        "--no_compute",
        action="store_true",
        help="run the steps on tensors without data and count their allocations (fast; no save after the steps)",
    )
    parser.add_argument("--scratch", type=str, default=None, help="where saves go (default: a temporary directory)")
    parser.add_argument("--keep_files", action="store_true", help="keep the scratch directory's files")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--json_file", type=str, default=None, help="also write the report as JSON to this file")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("script", type=str, help="the Fabric script, run as `python SCRIPT ARGS` would")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def run_dryrun(args: argparse.Namespace) -> None:
    """Run the dry run(s) ``args`` ask for and print the report(s)."""
    from fabric_hsdp.dryrun.world import ALL_KINDS, DryRunWorld, parse_rank

    rank = parse_rank(args.rank)
    if rank == ALL_KINDS:
        _run_all_kinds(args)
        return
    DryRunWorld(args.num_nodes, args.devices_per_node, rank)  # a rank outside the world: before any import
    from fabric_hsdp.dryrun.runner import dry_run

    report = dry_run(
        args.script,
        args.script_args,
        num_nodes=args.num_nodes,
        devices_per_node=args.devices_per_node,
        rank=rank,
        max_steps=args.max_steps,
        scratch=args.scratch,
        keep_files=args.keep_files,
        save_after_stop=args.save_after_stop,
        no_compute=args.no_compute,
    )
    document = json.dumps(report.as_dict(), indent=2)
    if args.json_file:
        Path(args.json_file).write_text(document)
    print(document if args.json else report.text())


def _run_all_kinds(args: argparse.Namespace) -> None:
    """Rank 0 first (it tells the mesh), then one rank per distinct role, each in its own process (clean figures)."""
    from fabric_hsdp.dryrun.world import DryRunWorld, rank_kinds

    DryRunWorld(args.num_nodes, args.devices_per_node, 0)
    first = _one_rank_in_a_process(args, 0)
    kinds = rank_kinds(tuple(first["mesh_shape"]), args.devices_per_node)
    reports = {0: first}
    for rank in kinds:
        if rank not in reports:
            reports[rank] = _one_rank_in_a_process(args, rank)
    if args.json:
        print(json.dumps([dict(reports[rank], kind=kinds[rank]) for rank in kinds], indent=2))
        return
    from fabric_hsdp.units import format_binary_bytes as size

    print(f"dry run of {len(kinds)} kinds of rank of {first['world_size']} (mesh {tuple(first['mesh_shape'])}):")
    print("  rank  coordinates      params held   step peak  planned  ratio  read at load  save share  kind")
    for rank, kind in kinds.items():
        report = reports[rank]
        planned = report["planned"]["total"] if report["planned"] else 0
        ratio = f"{report['measured_over_planned']:.2f}x" if report["measured_over_planned"] else "-"
        read = report["checkpoint_read"]
        share = sum(save["expected_share"] for save in report["saves"])
        print(
            f"  {rank:>4}  {str(tuple(report['coordinates'])):<15}  {report['local_parameters']:>12,}"
            f"  {size(report['step_peak']):>9}  {size(planned):>7}  {ratio:>5}  {size(read):>12}  {size(share):>10}"
            f"  {kind}"
        )
    print(f"  {first['losses']}")


def _one_rank_in_a_process(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fabric-hsdp-dryrun-report-") as directory:
        report_file = Path(directory) / "report.json"
        _run_rank_process(args, rank, report_file)
        return json.loads(report_file.read_text())


def _run_rank_process(args: argparse.Namespace, rank: int, report_file: Path) -> None:
    command = [sys.executable, "-m", "fabric_hsdp", "dryrun", "--json_file", str(report_file), "--rank", str(rank)]
    command += ["--num_nodes", str(args.num_nodes), "--devices_per_node", str(args.devices_per_node)]
    command += ["--max_steps", str(args.max_steps)] + ["--no_compute"] * bool(args.no_compute)
    if args.save_after_stop is not None:
        command.append("--save_after_stop" if args.save_after_stop else "--no-save_after_stop")
    if args.scratch:
        command += ["--scratch", str(Path(args.scratch) / f"rank{rank}")]
    command += [args.script, *args.script_args]
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"rank {rank}: {last.removeprefix('fabric-hsdp: error: ')}")
