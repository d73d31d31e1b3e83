"""The fine-tune job's checkpoints over a long run: which one to resume, a ``latest`` pointer, keeping the last k.

``<dir>/step-<N>`` are sharded DCP checkpoints. A save is atomic (the directory appears complete or not at all), but
a directory can still be incomplete: copied by hand, partly deleted, written by another tool, or its files lost on a
node-local disk. :func:`resume_candidates` lists them newest first and says why each incomplete one is skipped;
:func:`point_latest` replaces ``<dir>/latest`` (a symlink to the newest complete one) atomically; :func:`keep_last`
deletes all but the newest ``k`` (never the one ``latest`` points to).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")
LATEST = "latest"


def why_incomplete(path: Path) -> str | None:
    """Why ``path`` is not a whole DCP checkpoint (its ``.metadata`` or a file it names missing), or None."""
    from fabric_hsdp.checkpoint.formats.dcp_metadata import check_complete

    try:
        check_complete(path)
    except (OSError, ValueError) as error:  # FileNotFoundError, CheckpointError (a ValueError) and the like
        return str(error)
    return None


def steps(directory: Path) -> list[tuple[int, Path]]:
    """``(N, step-<N>)`` in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), entry) for entry in directory.iterdir() if (m := CHECKPOINT_NAME.match(entry.name))]
    return sorted(found, reverse=True)


def newest_complete(directory: Path) -> tuple[Path | None, list[str]]:
    """The newest complete ``step-<N>``, and one line per newer one skipped, with the reason."""
    skipped = []
    for _, path in steps(directory):
        reason = why_incomplete(path)
        if reason is None:
            return path, skipped
        skipped.append(f"skipped {path.name}: {reason}")
    return None, skipped


def point_latest(directory: Path, checkpoint: Path) -> None:
    """Make ``directory/latest`` a symlink to ``checkpoint`` in one rename (readers see the old or the new one)."""
    target = directory / LATEST
    if target.is_dir() and not target.is_symlink():
        raise FileExistsError(f"'{target}' is a directory, not the symlink this job keeps there; move it away")
    staging = directory / f".{LATEST}.tmp-{uuid.uuid4().hex[:12]}"
    os.symlink(checkpoint.name, staging)
    os.replace(staging, target)


def keep_last(directory: Path, count: int) -> list[Path]:
    """Delete all but the newest ``count`` checkpoints (0: keep all); never the one ``latest`` points to."""
    if count <= 0:
        return []
    pointed = (directory / LATEST).resolve() if (directory / LATEST).is_symlink() else None
    removed = []
    for _, path in steps(directory)[count:]:
        if pointed is not None and path.resolve() == pointed:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
