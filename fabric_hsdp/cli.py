"""The ``fabric-hsdp`` command: argument parsing and error reporting; the work is in ``fabric_hsdp.checkpoint``.

Exit codes: 0 success, 1 failure while working (e.g. disk full), 2 bad input (missing file, not a checkpoint,
truncated file, existing output without ``--overwrite``, bad arguments), 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM: ``scancel``, a time limit); interrupted or terminated, nothing is left at the destination.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended
_BAD_INPUT = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)

_CONVERT_HELP = """Convert a checkpoint, one tensor at a time; DEST appears only once complete.

SOURCE: a torch file (.pth/.pt/.bin/.ckpt; state dict or Fabric/Lightning checkpoint), a .safetensors file,
a Hugging Face directory or a DCP directory. DEST format: --to, else from its name: .pth/.pt/.bin/.ckpt = torch
file, .safetensors = one safetensors file, anything else = DCP directory.
"""


def build_parser() -> Any:
    """The ``fabric-hsdp`` argument parser (jsonargparse, so ``--config`` files work)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="fabric-hsdp",
        description="Checkpoints and layouts for fabric-hsdp. `fabric-hsdp run [fabric run's options] SCRIPT`"
        " launches a script like Lightning's `fabric run`, with --strategy hsdp (see `fabric-hsdp run --help`)."
        " `fabric-hsdp dryrun --num_nodes N --devices_per_node M --rank R SCRIPT [ARGS]` runs it as one rank of"
        " that cluster in this process (see `fabric-hsdp dryrun --help`).",
        exit_on_error=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML/JSON file with the arguments")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    subcommands = parser.add_subcommands(dest="command")

    convert = ArgumentParser(description=_CONVERT_HELP, exit_on_error=False)
    convert.add_argument("--config", action=ActionConfigFile, help="YAML/JSON file with the arguments")
    convert.add_argument("source", type=str, help="checkpoint to read")
    convert.add_argument("dest", type=str, help="output path (must not exist unless --overwrite)")
    convert.add_argument("--to", type=str | None, choices=["dcp", "torch", "safetensors"], help="output format")
    convert.add_argument(
        "--dtype", type=str | None, help="cast float tensors: bf16, fp16, fp32 (or torch's names: bfloat16, ...)"
    )
    convert.add_argument(
        "--key_map",
        type=list[str] | str | None,
        help="rename tensors: OLD=NEW renames a prefix, OLD= strips it, !OLD drops keys; comma-separated",
    )
    convert.add_argument(
        "--max_shard_size", type=str, default="5GB", help="largest safetensors shard of a directory output"
    )
    convert.add_argument(
        "--model_only",
        action="store_true",
        help="write the model tensors alone (a flat state dict, e.g. litgpt's lit_model.pth), without optimizer state",
    )
    convert.add_argument(
        "--hf_config",
        type=str | None,
        help="config.json (or its directory) to copy into a Hugging Face directory DEST, for from_pretrained",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    convert.add_argument(
        "--unsafe_pickle", action="store_true", help="unpickle without weights_only (trusted files only)"
    )
    convert.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    subcommands.add_subcommand("convert", convert, help="convert a checkpoint to DCP, a torch file or safetensors")

    inspect = ArgumentParser(description="Describe a checkpoint without reading tensor data.", exit_on_error=False)
    inspect.add_argument("--config", action=ActionConfigFile, help="YAML/JSON file with the arguments")
    inspect.add_argument("path", type=str, help="checkpoint file or directory")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    inspect.add_argument("--unsafe_pickle", action="store_true", help="unpickle without weights_only (trusted only)")
    inspect.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    subcommands.add_subcommand("inspect", inspect, help="show format, tensor count, sizes, dtypes and first keys")

    from fabric_hsdp.planning.command import plan_parser

    subcommands.add_subcommand("plan", plan_parser(), help="which shard_size fits a model; memory and traffic")
    return parser


def _print_inspection(info: dict[str, Any]) -> None:
    from fabric_hsdp.units import format_binary_bytes as format_bytes

    dtypes = ", ".join(f"{dtype} x{count}" for dtype, count in info["dtypes"].items())
    print(f"{info['path']}: {info['format']}")
    print(f"  tensors: {info['tensors']}  parameters: {info['parameters']:,}  size: {format_bytes(info['bytes'])}")
    print(f"  dtypes: {dtypes or '-'}")
    if info["largest"]:
        largest = info["largest"]
        print(f"  largest: {largest['name']} {largest['shape']} {format_bytes(largest['bytes'])}")
    for entry in info["first_keys"]:
        print(f"    {entry['name']}  {entry['shape']}  {entry['dtype']}")
    if info["tensors"] > len(info["first_keys"]):
        print(f"    ... {info['tensors'] - len(info['first_keys'])} more")
    for key, extra in info["extras"].items():
        if "value" in extra:
            print(f"  extra {key!r}: {extra['value']!r} ({extra['type']})")
        else:
            print(f"  extra {key!r}: {extra['type']}, {extra['tensors']} tensors, {format_bytes(extra['bytes'])}")
    if info["format"] == "dcp" and info["model_key"]:
        key = info["model_key"]
        print(
            f"  layout: model tensors stored as '{key}.<name>' (Lightning's layout, what fabric.load(path,"
            f" {{'{key}': model}}) reads); torch's dcp_to_torch_save returns {{'{key}': {{...}}, ...}}"
        )
    if "dcp" in info:
        dcp = info["dcp"]
        files = ", ".join(f"{entry['name']} ({format_bytes(entry['bytes'])})" for entry in dcp["files"])
        print(f"  dcp files: {files or '-'}")
        print(f"  chunked tensors: {dcp['chunked_tensors']} (at most {dcp['max_chunks']} chunks per tensor)")


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and not isinstance(error, _BAD_INPUT):
        text = error.strerror + (f": '{error.filename}'" if error.filename else "")
    else:
        text = str(error) or type(error).__name__
    if isinstance(error, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]
    return " ".join(text.split())


def _run(command: str, args: Any) -> None:
    if command == "plan":
        from fabric_hsdp.planning.command import run_plan

        return run_plan(args)
    from fabric_hsdp.checkpoint.writers.convert import convert_checkpoint, inspect_checkpoint

    if command == "convert":
        convert_checkpoint(
            args.source,
            args.dest,
            to=args.to,
            dtype=args.dtype,
            key_map=args.key_map,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            weights_only=not args.unsafe_pickle,
            model_only=args.model_only,
            hf_config=args.hf_config,
        )
    else:
        info = inspect_checkpoint(args.path, weights_only=not args.unsafe_pickle)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_inspection(info)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fabric-hsdp``; returns the exit code."""
    from jsonargparse import ArgumentError

    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["run"]:  # `fabric run`'s options: Lightning's own parser reads them
        from fabric_hsdp.run import main as run_main

        return run_main(arguments[1:])
    if arguments[:1] == ["dryrun"]:  # everything after SCRIPT is the script's: argparse's REMAINDER reads it
        from fabric_hsdp.dryrun.command import dryrun_parser, run_dryrun

        try:
            dryrun_args = dryrun_parser().parse_args(arguments[1:])
        except ValueError as error:
            print(f"fabric-hsdp: error: {_one_line(error)}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except SystemExit as done:  # --help
            return int(done.code or 0)
        return _report_errors(lambda: run_dryrun(dryrun_args), dryrun_args.debug)
    parser = build_parser()
    try:
        config = parser.parse_args(arguments)
    except ArgumentError as error:
        print(f"fabric-hsdp: error: {_one_line(error)} (see fabric-hsdp --help)", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = config[config.command]
    return _report_errors(lambda: _run(config.command, args), bool(config.debug or args.debug))


def _report_errors(work: Callable[[], None], debug: bool) -> int:
    """Run ``work`` with the package's log on stderr; one line per error, the exit code by its kind."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fabric-hsdp: %(message)s"))
    logger = logging.getLogger("fabric_hsdp")
    # The command owns stderr while it runs: its handler replaces any the package set up, so lines are not doubled.
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    terminated: list[int] = []
    previous = _terminate_like_interrupt(terminated)
    try:
        work()
    except KeyboardInterrupt:
        print("fabric-hsdp: interrupted; nothing was written", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of our output went away (`fabric-hsdp inspect x | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as error:
        if debug:
            traceback.print_exc()
        print(f"fabric-hsdp: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(error, _BAD_INPUT) else EXIT_FAILURE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        logger.handlers, logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
    return EXIT_OK


def _terminate_like_interrupt(terminated: list[int]) -> Any:
    """SIGTERM (``scancel``, a job's time limit, ``kill``) unwinds like Ctrl-C, so a pending save's directory is
    removed; returns the previous handler (None where signals cannot be set: not the main thread)."""

    def handler(signum: int, frame: Any) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None
