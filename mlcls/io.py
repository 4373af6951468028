"""Files written atomically: a crash mid-write leaves the previous complete file in place, never a
truncated one; and data files read only when they are regular files (:func:`open_regular`). Low level (no
other mlcls import), for the engine's checkpoints and results and the data tools' files alike."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

# errno values of a full disk or an exhausted quota
_FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# The temporary files atomic writes make beside ``<name>``: ``.<name>.<random>.tmp`` (:func:`atomic_write`)
# and ``.<name>.link.tmp`` (a link made atomically, mlcls.engine.checkpoint). A process killed mid-write
# leaves one behind.
_TEMPORARY_NAME = re.compile(r"\..+\.[A-Za-z0-9_]+\.tmp")


class DiskFullError(RuntimeError):
    """A file cannot be written for lack of space; the previous version of the file is intact."""


class NotRegularFileError(OSError):
    """A path read as a data file names something else: a folder, a pipe, a device or a socket."""


# What a path that is not a regular file names, for the message of NotRegularFileError.
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: str | Path, mode: str = "rb", **kwargs) -> IO:
    """``open(path, mode, **kwargs)`` for reading, refused with :class:`NotRegularFileError` unless ``path``
    (after symbolic links) is a regular file.

    A dataset's lists and annotations, a CSV or a local shard are named by a config -- or by a checkpoint
    from someone else, read by ``mlcls-eval``. A pipe, a terminal or a device there (``/dev/stdin``,
    ``/dev/zero``) would block the reader or never end. The path is opened without blocking (a pipe with no
    writer opens at once), its type read from the open file, and only a regular file is read on.
    A missing path raises :class:`FileNotFoundError`, as ``open`` does.
    """
    if any(flag in mode for flag in "wax+"):
        raise ValueError(f"open_regular reads files; mode {mode!r} writes")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            named = next((name for test, name in _KINDS if test(kind)), "not a regular file")
            raise NotRegularFileError(f"{path} is {named}; expected a regular file")
        os.set_blocking(fd, True)
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | Path) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`)."""
    with open_regular(path) as f:
        return f.read()


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, flush it to disk, rename it over ``path``.

    The file keeps the permissions of the ``path`` it replaces; a new one gets those of the umask
    (``0o666 & ~umask``), as ``open(path, "w")`` would give it. A full disk raises :class:`DiskFullError`
    naming ``path`` and the free space, ``path`` unchanged.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        raise_if_disk_full(exc, path)
        raise


def _mode_for(path: Path) -> int:
    """The permission bits ``path`` has, or for a new file ``0o666`` less the process's umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # the only way to read it; set back at once
        os.umask(umask)
        return 0o666 & ~umask


def raise_if_disk_full(exc: BaseException, path: Path) -> None:
    """Raise :class:`DiskFullError` for ``path`` if ``exc``, or an error it was raised from or while
    handling (its ``__cause__`` and ``__context__``, as torch's ``RuntimeError`` of a failed write carries
    the ``OSError``), says the disk (or the quota) is full."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_DISK_ERRNOS:
            free = shutil.disk_usage(path.parent).free
            raise DiskFullError(
                f"cannot write {path}: no space left on the device ({free / 2**20:.1f} MiB free in "
                f"{path.parent}); the previous {path.name}, if any, is unchanged",
            ) from exc
        pending += [error.__cause__, error.__context__]


def sweep_temporary_files(directory: Path) -> list[Path]:
    """Remove from ``directory`` (not its subfolders) the temporary files of atomic writes that a killed
    process left behind (``.<name>.<random>.tmp``, ``.<name>.link.tmp``); return the files removed.

    Only for a directory no other process writes into at the same time: a live write's file would go too.
    """
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.iterdir()):
        if _TEMPORARY_NAME.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))
