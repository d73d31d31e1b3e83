"""Make a checkpoint visible at its path all at once, and tell a complete DCP directory from a broken one.

Every rank writes into a hidden staging sibling (``.NAME.saving-<id>``). Only after all ranks have finished does rank
0 swap it into place with one atomic ``renameat2(RENAME_EXCHANGE)`` (or a plain ``rename`` when nothing is there
yet), then deletes the previous checkpoint that the swap moved into the staging name. A process killed at any moment
therefore leaves at ``path`` either the previous checkpoint or the new one. Filesystems without ``RENAME_EXCHANGE``
fall back to two renames, with the previous checkpoint parked as ``.NAME.previous-<id>`` in between.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

_logger = logging.getLogger("fabric_hsdp")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_STAGING = ".saving-"
_PREVIOUS = ".previous-"


def staging_path(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` to write into (same directory, so the final rename stays atomic)."""
    return path.parent / f".{path.name}{_STAGING}{uuid.uuid4().hex[:12]}"


def leftovers(path: Path) -> list[Path]:
    """Staging or parked siblings of ``path`` left by saves that were killed."""
    if not path.parent.is_dir():
        return []
    prefixes = (f".{path.name}{_STAGING}", f".{path.name}{_PREVIOUS}")
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefixes))


def remove_leftovers(path: Path) -> None:
    """Clean up after killed saves of ``path`` (called by rank 0 before a new save).

    Staging directories are deleted. A parked previous checkpoint (a save killed between the two renames of the
    fallback swap) is the only copy when ``path`` is missing: it is renamed back to ``path``; otherwise deleted.
    """
    for stale in leftovers(path):
        if _PREVIOUS in stale.name and not os.path.lexists(path):
            _logger.info("fabric_hsdp: restoring %s to %s, parked by an interrupted save", stale, path)
            os.rename(stale, path)
            continue
        _logger.info("fabric_hsdp: removing %s, left by an interrupted save", stale)
        _remove(stale)


def discard(staged: Path) -> None:
    """Delete the staging directory of a save that failed (and nothing else: a parked checkpoint stays)."""
    _remove(staged)


def commit(staged: Path, path: Path) -> None:
    """Put ``staged`` at ``path`` atomically and delete what was there before. Call on one rank, after a barrier.

    The files inside were already synced by the ranks that wrote them (DCP's ``sync_files``); this syncs the
    directory entries so the rename cannot be persisted before them.
    """
    if staged.is_dir():
        _fsync(staged)
    if not os.path.lexists(path):
        os.rename(staged, path)
    elif _exchange(staged, path):
        _remove(staged)  # now holds the previous checkpoint
    else:
        parked = path.parent / f".{path.name}{_PREVIOUS}{uuid.uuid4().hex[:12]}"
        os.rename(path, parked)
        try:
            os.rename(staged, path)
        except BaseException:
            os.rename(parked, path)  # the previous checkpoint back where it was
            raise
        _remove(parked)
    _fsync(path.parent)


def _exchange(first: Path, second: Path) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"could not swap '{first}' into '{second}': {os.strerror(code)}")


def check_complete_dcp(path: Path, *, weights_only: bool = True) -> Any:
    """Raise ``FileNotFoundError``/``ValueError`` naming what is missing if ``path`` is not a whole DCP checkpoint.

    Returns:
        Its DCP ``Metadata`` (read to check the shards against it).
    """
    from fabric_hsdp.checkpoint._dcp import read_metadata

    if not path.exists():
        hint = ""
        parked = [p for p in leftovers(path) if _PREVIOUS in p.name]
        if parked:
            hint = f" A save was interrupted while swapping; the previous checkpoint is intact at '{parked[-1]}'."
        raise FileNotFoundError(f"checkpoint '{path}' does not exist.{hint}")
    metadata_file = path / ".metadata"
    if not metadata_file.is_file():
        shards = sorted(p.name for p in path.glob("*.distcp"))
        raise ValueError(
            f"checkpoint '{path}' is incomplete: it has no DCP '.metadata' file"
            + (f" (but {len(shards)} shard file(s), e.g. '{shards[0]}')" if shards else "")
            + ". It was not written by a finished save; load the previous checkpoint instead."
        )
    metadata = read_metadata(path, weights_only=weights_only)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"'{name}' is missing")
        elif file.stat().st_size < size:
            problems.append(f"'{name}' is truncated ({file.stat().st_size} of {size} bytes)")
    if problems:
        more = f"; {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ValueError(
            f"checkpoint '{path}' is incomplete: {', '.join(problems[:5])}{more}. Its shards do not match its"
            " '.metadata'; load the previous checkpoint instead."
        )
    return metadata


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def _fsync(path: Path) -> None:
    """fsync a file or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
