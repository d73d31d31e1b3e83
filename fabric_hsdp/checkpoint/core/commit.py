"""Make a checkpoint visible at its path all at once: the atomic swap of a sharded save, and atomic file outputs.

Every rank writes into a hidden pending sibling (``.NAME.saving-<id>``). Only after all ranks have finished does rank
0 swap it into place with one atomic ``renameat2(RENAME_EXCHANGE)`` (or a plain ``rename`` when nothing is there
yet), then deletes the previous checkpoint that the swap moved into the pending name. A process killed at any moment
therefore leaves at ``path`` either the previous checkpoint or the new one. Filesystems without ``RENAME_EXCHANGE``
fall back to two renames, with the previous checkpoint parked as ``.NAME.previous-<id>`` in between.

:class:`PendingSave` is one sharded save's pending directory from its creation to its commit or discard.
:func:`atomic_output` gives single-process writers (conversion, full exports) the same guarantee for a file or a
directory: they write into a hidden sibling, which is fsync'ed and renamed into place only on success.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fabric_hsdp.checkpoint.core import watchdog
from fabric_hsdp.checkpoint.core.progress import log_throughput
from fabric_hsdp.errors import SaveError, write_error

_logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_PENDING = ".saving-"
_PREVIOUS = ".previous-"
_OUTPUT_PENDING = ".tmp-"  # atomic_output's: .NAME.tmp-<id>/NAME
_OWNER = ".owner"


def pending_path(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` to write into (same directory, so the final rename stays atomic)."""
    return path.parent / f".{path.name}{_PENDING}{uuid.uuid4().hex[:12]}"


def leftovers(path: Path) -> list[Path]:
    """Pending or parked siblings of ``path`` left by saves that were killed."""
    if not path.parent.is_dir():
        return []
    prefixes = (f".{path.name}{_PENDING}", f".{path.name}{_PREVIOUS}")
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefixes))


def parked_copies(path: Path) -> list[Path]:
    """Previous checkpoints of ``path`` parked by a fallback swap that was interrupted (oldest first)."""
    return [p for p in leftovers(path) if _PREVIOUS in p.name]


def remove_leftovers(path: Path) -> None:
    """Clean up after killed saves of ``path`` (called by rank 0 before a new save).

    Pending directories are deleted. A parked previous checkpoint (a save killed between the two renames of the
    fallback swap) is the only copy when ``path`` is missing: it is renamed back to ``path``; otherwise deleted.
    """
    for stale in leftovers(path):
        if _PREVIOUS in stale.name and not os.path.lexists(path):
            _logger.info("restoring %s to %s, parked by an interrupted save", stale, path)
            os.rename(stale, path)
            continue
        _logger.info("removing %s, left by an interrupted save", stale)
        remove_path(stale)


def check_shared(marker: Path, path: Path, timeout: float = 10.0) -> None:
    """Raise unless this rank sees ``marker``, a file rank 0 wrote into the pending directory of ``path``.

    Every rank writes its shards into that directory and rank 0 commits it: on a path local to each node, the
    other nodes' shards would stay behind in their own copies and the checkpoint would fail only at load. Waits up
    to ``timeout`` seconds (a shared filesystem may show a new file late) and returns at once in the usual case.

    Raises:
        FileNotFoundError: This rank does not see the file; the message says why that matters and what to do.
    """
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if time.monotonic() > deadline:
            raise FileNotFoundError(
                f"checkpoint '{path}' is not on a directory shared by every node: this rank (host"
                f" {socket.gethostname()}) does not see '{marker.name}' that rank 0 wrote into the pending directory"
                f" '{marker.parent}' {timeout:.0f} s ago, so its shards would be lost. Save to a filesystem every"
                " node mounts (NFS, Lustre, GPFS), or save a full checkpoint (state_dict_type='full': rank 0"
                " writes, load it with load_mode='rank0')."
            )
        time.sleep(0.1)


def discard(pending: Path) -> None:
    """Delete the pending directory of a save that failed (and nothing else: a parked checkpoint stays)."""
    remove_path(pending)


def commit_and_log(pending: Path, path: Path, started: float, verb: str) -> None:
    """Rank 0, once every rank has written: :func:`commit` ``pending`` to ``path`` (an ``OSError`` becomes a
    ``SaveError`` naming ``path``), then log the save's size and throughput since ``started`` (``time.monotonic()``)."""
    try:
        commit(pending, path)
    except OSError as error:
        raise write_error(path, error) from None
    log_throughput(verb, path, time.monotonic() - started)


class PendingSave:
    """The pending directory of one sharded save of ``path``: every rank writes into it, rank 0 creates it, commits it
    to ``path`` once all have written, or discards it (leaving the previous checkpoint at ``path`` untouched).

    ``broadcast`` hands rank 0's object to every rank (its pending name is the one all write into). The methods
    that change the directory act on rank 0 only: call them on every rank, each at the same point.
    """

    def __init__(self, path: Path, broadcast: Callable[[Any], Any], rank: int) -> None:
        self.path = path
        self.rank = rank
        self.directory = Path(broadcast(pending_path(path)))
        self.started = time.monotonic()

    def create(self, write_marker: Callable[[Path], None]) -> None:
        """Rank 0: clean up after killed saves of ``path``, make the directory and ``write_marker(directory)``, the
        file every rank then checks for (:meth:`check_shared`). An ``OSError`` becomes a ``SaveError`` naming
        ``path``, not the hidden directory."""
        if self.rank != 0:
            return
        try:
            remove_leftovers(self.path)
            self.directory.mkdir(parents=True)
        except OSError as error:
            raise write_error(self.path, error, creating=True) from None
        try:
            write_marker(self.directory)
        except OSError as error:
            discard(self.directory)
            raise write_error(self.path, error) from None

    def check_shared(self, marker: str) -> None:
        """Raise unless this rank sees ``marker`` that rank 0 wrote (see :func:`check_shared`)."""
        check_shared(self.directory / marker, self.path)

    def commit(self, verb: str) -> None:
        """Rank 0, once every rank has written: the atomic commit, then the save's size and throughput logged."""
        if self.rank == 0:
            commit_and_log(self.directory, self.path, self.started, verb)

    def discard(self) -> None:
        """Rank 0: delete the pending directory of a save that failed."""
        if self.rank == 0:
            discard(self.directory)


def commit(pending: Path, path: Path) -> None:
    """Put ``pending`` at ``path`` atomically and delete what was there before. Call on one rank, after a barrier.

    The files inside were already synced by the ranks that wrote them (DCP's ``sync_files``); this syncs the
    directory entries so the rename cannot be persisted before them.
    """
    if pending.is_dir():
        fsync_path(pending)
    if not os.path.lexists(path):
        os.rename(pending, path)
    elif _exchange(pending, path):
        remove_path(pending)  # now holds the previous checkpoint
    else:
        parked = path.parent / f".{path.name}{_PREVIOUS}{uuid.uuid4().hex[:12]}"
        os.rename(path, parked)
        try:
            os.rename(pending, path)
        except BaseException:
            os.rename(parked, path)  # the previous checkpoint back where it was
            raise
        remove_path(parked)
    fsync_path(path.parent)


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


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree, if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries); a stuck one is seen by the I/O watchdog."""
    with watchdog.doing_io("writing", str(path)):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync a file, or every file and directory under a directory (so the names are durable too)."""
    if not path.is_dir():
        fsync_path(path)
        return
    for root, _, names in os.walk(path):
        for name in names:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def remove_stale_outputs(dest: Path) -> list[Path]:
    """Delete the pending directories of killed earlier writes of ``dest`` (``kill -9``, a node lost); return them.

    A pending directory whose writer still runs on this host (its ``.owner`` names a live process), or was started on
    another host (which this one cannot check), is left alone and reported.
    """
    if not dest.parent.is_dir():
        return []
    removed = []
    for stale in sorted(dest.parent.glob(f".{glob.escape(dest.name)}{_OUTPUT_PENDING}*")):
        owner = _owner(stale)
        if owner is not None:
            _logger.warning(
                "'%s' is being written by %s (pending '%s'); if that write is over, remove the pending directory",
                dest,
                owner,
                stale,
            )
            continue
        size = sum(f.stat().st_size for f in stale.rglob("*") if f.is_file() and not f.is_symlink())
        _logger.info("removing '%s' (%s), left by an interrupted write of '%s'", stale, _size(size), dest)
        remove_path(stale)
        removed.append(stale)
    return removed


def _owner(pending: Path) -> str | None:
    """Who may still write ``pending`` (``"process N on this host"``, ``"a process on host H"``), else None."""
    try:
        host, pid = (pending / _OWNER).read_text().split()
        if host != socket.gethostname():
            return f"process {pid} on host {host}"
        if int(pid) == os.getpid():
            return None
        os.kill(int(pid), 0)
    except PermissionError:  # alive, another user's
        return f"process {pid} on this host"
    except (OSError, ValueError):  # no owner file (or unreadable), or the process is gone
        return None
    return f"process {pid} on this host"


def _size(count: int) -> str:
    from fabric_hsdp.units import format_binary_bytes

    return format_binary_bytes(count)


def check_writable(directory: Path) -> None:
    """Create ``directory`` if missing, and a file in it (removed again): what a save does there, checked early.

    Raises:
        SaveError: ``directory`` or a file in it cannot be created, naming the directory that refused and why.
    """
    probe = directory / f".write-check-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        if error.errno == errno.ENOTDIR or (directory.exists() and not directory.is_dir()):
            blocking = next((part for part in [directory, *directory.parents] if part.is_file()), directory)
            problem = f"'{blocking}' is a file, not a directory ({reason})"
        elif directory.is_dir():
            problem = f"cannot create a file in it ({reason})"
        else:
            problem = f"cannot create it ({reason})"
        raise SaveError(
            f"cannot save checkpoints in '{directory}': {problem}. Found before training: choose a directory every"
            " rank can write, or change its permissions."
        ) from None


def check_destination(dest: Path, overwrite: bool) -> None:
    """Raise unless ``dest`` can be created: absent (or ``overwrite``), in a directory that exists.

    Raises:
        FileExistsError: ``dest`` exists and ``overwrite`` is false.
        NotADirectoryError: ``dest``'s parent is a file.
        FileNotFoundError: ``dest``'s parent directory does not exist.
    """
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise FileExistsError(f"'{dest}' already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    if dest.parent.exists() and not dest.parent.is_dir():
        raise NotADirectoryError(f"cannot write '{dest}': '{dest.parent}' is a file, not a directory")
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"cannot write '{dest}': directory '{dest.parent}' does not exist")


@contextmanager
def atomic_output(dest: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write ``dest`` at (a file or a directory); it becomes ``dest`` only on success.

    The temporary path is ``<dest's parent>/.<name>.tmp-<random>/<name>``, so it is on the same filesystem and
    keeps ``dest``'s name (torch records the file name inside its archives). On any exception, ``KeyboardInterrupt``
    included, everything written is removed and ``dest`` is left as it was. The result is fsync'ed before the
    rename, so a crash cannot leave a half-written file under the final name.

    Raises:
        FileExistsError: ``dest`` exists and ``overwrite`` is false.
        FileNotFoundError: ``dest``'s parent directory does not exist.
        NotADirectoryError: ``dest``'s parent is a file.
        SaveError: the pending sibling cannot be created (the directory is not writable: read-only, no permission)
            or the result cannot be renamed to ``dest``; the message names ``dest``, not the hidden pending path.
        OSError: writing failed (e.g. a full disk), re-raised naming ``dest``.
    """
    dest = Path(dest)
    check_destination(dest, overwrite)
    parent = dest.parent
    remove_stale_outputs(dest)
    pending = parent / f".{dest.name}{_OUTPUT_PENDING}{uuid.uuid4().hex[:12]}"
    try:
        pending.mkdir()
        (pending / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")  # who writes it, for the next writer
    except OSError as error:
        remove_path(pending)
        raise write_error(dest, error, creating=True) from None
    except BaseException:  # a signal handled as the mkdir returned: the directory may exist already
        remove_path(pending)
        raise
    try:
        try:
            yield pending / dest.name
        except OSError as error:
            inside = error.filename is not None and str(error.filename).startswith(str(pending))
            if (error.filename is None or inside) and error.errno is not None:  # e.g. a full disk: name the output
                raise type(error)(error.errno, error.strerror, str(dest)) from error
            raise
        result = pending / dest.name
        if not (result.exists() or result.is_symlink()):
            raise RuntimeError(f"nothing was written for '{dest}'")
        fsync_tree(result)
        try:
            commit(result, dest)  # one rename, or one atomic exchange with the dest it replaces
        except OSError as error:
            raise write_error(dest, error) from None
    finally:
        remove_path(pending)
