"""Files written atomically: a crash mid-write leaves the previous complete file in place, never a
truncated one. Low level (no other mlcls import), for the engine's checkpoints and results and the data
tools' sidecar files alike."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

# errno values of a full disk or an exhausted quota
_FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFullError(RuntimeError):
    """A file cannot be written for lack of space; the previous version of the file is intact."""


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, flush it to disk, rename it over ``path``.

    A full disk raises :class:`DiskFullError` naming ``path`` and the free space, ``path`` unchanged.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are for the whole group to read
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        raise_if_disk_full(exc, path)
        raise


def raise_if_disk_full(exc: BaseException, path: Path) -> None:
    """Raise :class:`DiskFullError` for ``path`` if ``exc`` says the disk (or the quota) is full."""
    if isinstance(exc, OSError) and exc.errno in _FULL_DISK_ERRNOS:
        free = shutil.disk_usage(path.parent).free
        raise DiskFullError(
            f"cannot write {path}: no space left on the device ({free / 2**20:.1f} MiB free in "
            f"{path.parent}); the previous {path.name}, if any, is unchanged",
        ) from exc


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))
