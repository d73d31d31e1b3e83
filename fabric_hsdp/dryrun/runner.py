"""Run a user's Fabric script as one rank of a cluster, in this process, and report what that rank would use."""

from __future__ import annotations

import contextlib
import os
import runpy
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from fabric_hsdp.dryrun.fake import fake_process_group
from fabric_hsdp.dryrun.report import DryRunReport, build_report
from fabric_hsdp.dryrun.session import DryRunSession, StepLimitReached
from fabric_hsdp.dryrun.world import DryRunWorld

_OTHER_LAUNCHERS = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "LSB_", "JSM_", "LT_", "TORCHELASTIC_")


class ScriptFailedError(RuntimeError):
    """The user's script raised (or exited non-zero) during the dry run."""


def dry_run(
    script: str | Path,
    script_args: Sequence[str] = (),
    *,
    num_nodes: int,
    devices_per_node: int,
    rank: int,
    max_steps: int = 1,
    scratch: str | Path | None = None,
    keep_files: bool = False,
    save_after_stop: bool | None = None,
    no_compute: bool = False,
) -> DryRunReport:
    """Run ``script`` with ``script_args`` as rank ``rank`` of ``num_nodes`` x ``devices_per_node``, stopping after
    ``max_steps`` optimizer steps (0: at the model's first forward, after set-up and loads); return the report.

    When the script did not save before the limit, ``save_after_stop`` saves this rank's share of the model and
    optimizer into scratch, as its save would (a 70B's share is GBs): default on after at least one step, off with
    ``max_steps=0`` (set-up and loads only).

    With ``no_compute`` the training steps run on tensors that carry shapes but no data (torch's ``FakeTensorMode``)
    and every allocation they make is counted (:mod:`fabric_hsdp.dryrun.counted`): a 70B rank's step in minutes
    instead of days of CPU matmuls. Set-up and loads stay real; the step's peak is the resident memory at its start
    plus the counted peak. Nothing is saved after the first counted forward (the tensors hold no data).

    The script runs unchanged as ``__main__`` with torchrun's variables for that rank and torch's fake process group:
    every collective returns at once without data, while shapes, placements, allocations and file reads are real.

    Raises:
        ValueError: A rank outside the world, ``max_steps`` < 0, ``save_after_stop`` with ``no_compute``, or a
            script that never set up a ``HybridFSDPStrategy`` with ``fabric.launch()``.
        FileNotFoundError: No such script.
        ScriptFailedError: The script failed; the message is its error (a layout that does not divide, an OOM...).
    """
    world = DryRunWorld(num_nodes, devices_per_node, rank)
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
        raise ValueError(f"--max_steps {max_steps!r} must be 0 (set-up and load only) or a positive integer.")
    if no_compute and save_after_stop:
        raise ValueError(
            "--save_after_stop with --no_compute: the counted steps leave tensors without data, nothing to save"
            " (drop --save_after_stop, or run the step for real without --no_compute)"
        )
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no such script: '{script}'")
    scratch_dir = Path(scratch) if scratch is not None else Path(tempfile.mkdtemp(prefix="fabric-hsdp-dryrun-"))
    session = DryRunSession(world, max_steps, scratch_dir, no_compute=no_compute)
    try:
        with _as_rank(world, script, script_args), fake_process_group(), session.hooks():
            try:
                runpy.run_path(str(script), run_name="__main__")
            except StepLimitReached:
                pass
            except SystemExit as done:
                if done.code not in (0, None):
                    raise ScriptFailedError(f"{script.name} exited with status {done.code}") from None
            except Exception as error:
                if session.strategy is None and "`.launch()`" in str(error):
                    raise ValueError(_never_launched(script, session)) from None
                raise ScriptFailedError(f"{script.name}: {type(error).__name__}: {error}") from error
            finally:
                session.stop_counting()
            if session.strategy is None:
                raise ValueError(_never_launched(script, session))
            if save_after_stop is None:
                save_after_stop = max_steps > 0 and not no_compute
            if save_after_stop and session.steps >= max_steps:
                session.save_after_stop()
            report = build_report(session)
            _teardown(session)
    finally:
        if not keep_files and scratch is None:
            shutil.rmtree(scratch_dir, ignore_errors=True)
    return report


def _never_launched(script: Path, session: DryRunSession) -> str:
    if session.fabric is None:
        found = "it built no Fabric"
    elif type(session.fabric.strategy).__name__ == "HybridFSDPStrategy":
        found = "it built a Fabric with HybridFSDPStrategy but did not call fabric.launch()"
    else:
        found = f"its Fabric uses {type(session.fabric.strategy).__name__}"
    return (
        f"{script.name} never set up a HybridFSDPStrategy with fabric.launch() ({found}). A dry run runs a Fabric"
        " script that calls L.Fabric(strategy=HybridFSDPStrategy(...)) (or strategy='hsdp') and fabric.launch()."
    )


def _teardown(session: DryRunSession) -> None:
    # the report is made; a failing teardown under the fake group changes nothing
    with contextlib.suppress(Exception):
        session.strategy.teardown()


@contextmanager
def _as_rank(world: DryRunWorld, script: Path, script_args: Sequence[str]) -> Iterator[None]:
    """torchrun's variables for the rank, ``sys.argv``/``sys.path`` as ``python SCRIPT ARGS`` sets them; restored."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    saved_env = dict(os.environ)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_ranks = (getattr(rank_zero_only, "rank", 0), getattr(utils_rank_zero_only, "rank", 0))
    for name in list(os.environ):  # another launcher's variables would describe this login shell, not the rank
        if name.startswith(_OTHER_LAUNCHERS):
            del os.environ[name]
    os.environ.update(world.launcher_variables())
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
        rank_zero_only.rank, utils_rank_zero_only.rank = saved_ranks
