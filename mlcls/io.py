"""Files written atomically (a crash mid-write leaves the previous complete file), and files read only
when regular and within a cap (:func:`open_regular`, the one door). No other mlcls import."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml

_FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# The temporary files atomic writes make beside ``<name>``, which a process killed mid-write leaves behind:
# ``.<name>.<random>.tmp`` (:func:`atomic_write`) and ``.<name>.link.tmp`` (:func:`atomic_link`).
_TEMPORARY_NAME = re.compile(r"\..+\.[A-Za-z0-9_]+\.tmp")


class DiskFullError(RuntimeError):
    """A file cannot be written for lack of space; the previous version of the file is intact."""


class NotRegularFileError(OSError):
    """A path read as a data file names something else: a folder, a pipe, a device or a socket."""


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class FileTooLargeError(ValueError):
    """A file is larger than the cap for what it holds; nothing of it was read."""


class UnsafeFileError(ValueError):
    """A file's structure asks for more than it holds (a YAML alias, a compressed checkpoint member)."""


MiB = 2**20
GiB = 2**30

# Caps for files whose content mlcls reads whole. A legitimate file of each kind is far below its cap.
CAPS = {
    "config": 4 * MiB,  # a run's config.yaml, a dataset YAML
    "results": 64 * MiB,  # results.json (per-class AP, the history)
    "lock": 64 * 1024,  # a run directory's .lock (host, pid, start time)
    "class list": 64 * MiB,  # a file of class names, one a line
    "manifest": 256 * MiB,  # a pack's manifest.json and classes.json
    "image": 256 * MiB,  # one encoded image
    "annotation": 16 * MiB,  # one image's annotation file (a VOC XML)
    "label file": 8 * GiB,  # a dataset's annotation JSON, CSV or list
    "predictions": 4 * GiB,  # val_predictions.npz
    "checkpoint": 64 * GiB,  # a checkpoint or a released weights file
    "word vectors": 8 * GiB,  # a GloVe / fastText text file, streamed (glove.840B.300d.txt is 5.6 GB)
}


def _describe(size: int) -> str:
    return f"{size / MiB:.1f} MiB" if size >= MiB else f"{size} bytes"


def open_regular(
    path: str | Path, mode: str = "rb", *, max_bytes: int | None = None, what: str = "file", **kwargs
) -> IO:
    """``open(path, mode, **kwargs)`` for reading: the one way mlcls opens a file it did not write. Refused
    with :class:`NotRegularFileError` unless a regular file (after links), :class:`FileTooLargeError` over
    ``max_bytes``.

    A named file may be a pipe or a device (``/dev/zero``) that would block the reader or never end. It is
    opened once, without blocking, and judged by that descriptor: a link flipped meanwhile slips nothing in.
    """
    if any(flag in mode for flag in "wax+"):
        raise ValueError(f"open_regular reads files; mode {mode!r} writes")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            named = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
            raise NotRegularFileError(f"{path} is {named}; expected a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileTooLargeError(
                f"{path} is {_describe(info.st_size)}; a {what} of at most {_describe(max_bytes)} expected"
            )
        os.set_blocking(fd, True)
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` (also while it grows)."""
    with open_regular(path, max_bytes=max_bytes, what=what) as f:
        return read_capped(f, max_bytes, str(path), what)


def read_capped(stream: IO[bytes], max_bytes: int, name: str, what: str = "file") -> bytes:
    """The bytes of the open ``stream`` (a file that may grow, an HTTP body, a command's output) named
    ``name``; :class:`FileTooLargeError` once it holds more than ``max_bytes``."""
    data, left = bytearray(), max_bytes + 1  # in blocks: ``read(max_bytes + 1)`` allocates the whole cap
    while left and (block := stream.read(min(left, 1 << 20))):  # a read of n bytes allocates n first
        data += block
        left -= len(block)
    if len(data) > max_bytes:
        raise FileTooLargeError(f"{name} holds over {_describe(max_bytes)}; a {what} expected")
    return bytes(data)


def read_text(path: str | Path, what: str, max_bytes: int | None = None, errors: str = "strict") -> str:
    """The UTF-8 text of the regular file ``path``, capped at ``max_bytes`` (default: ``CAPS[what]``)."""
    cap = CAPS[what] if max_bytes is None else max_bytes
    return read_regular_bytes(path, cap, what).decode("utf-8", errors=errors)


def read_json(path: str | Path, what: str, max_bytes: int | None = None) -> Any:
    """The JSON content of the regular file ``path``, capped as :func:`read_text` (JSON has no references:
    what it builds is bounded by its size); too deep a nesting is a :class:`ValueError`."""
    text = read_text(path, what, max_bytes)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path} nests deeper than a {what} can") from None


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: a few kilobytes of aliases expand into gigabytes."""

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise UnsafeFileError(
                f"YAML alias *{event.anchor} at line {event.start_mark.line + 1}; aliases are not read"
            )
        return super().compose_node(parent, index)


def load_yaml_text(text: str, source: str = "YAML") -> Any:
    """YAML ``text`` read as plain data, aliases refused (:class:`UnsafeFileError`)."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader
    except UnsafeFileError as exc:
        raise UnsafeFileError(f"{source}: {exc}") from None
    except RecursionError:
        raise ValueError(f"{source} nests too deep") from None


def read_yaml(path: str | Path, what: str = "config", max_bytes: int | None = None) -> Any:
    """The YAML content of the regular file ``path`` as plain data, capped, aliases refused."""
    return load_yaml_text(read_text(path, what, max_bytes), str(path))


def open_checkpoint(path: str | Path, what: str = "checkpoint") -> IO[bytes]:
    """The regular file ``path`` opened for ``torch.load``, once its zip members have been checked.

    ``torch.save`` stores its members uncompressed; a deflated member, one whose declared size differs from
    its bytes, members declaring more than the file holds, or no zip archive at all is refused
    (:class:`UnsafeFileError`). What ``torch.load`` then builds is bounded by the file's size.
    """
    file = open_regular(path, "rb", max_bytes=CAPS["checkpoint"], what=what)
    try:
        size = os.fstat(file.fileno()).st_size
        try:
            with zipfile.ZipFile(file) as archive:  # a file object passed in is left open
                members = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise UnsafeFileError(
                f"{path} is not a {what} written by torch.save (not a zip archive: {exc})"
            ) from None
        declared = 0
        for member in members:
            if member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
                raise UnsafeFileError(
                    f"{path}: member {member.filename!r} is compressed ({_describe(member.compress_size)} "
                    f"declaring {_describe(member.file_size)}); torch.save stores members uncompressed"
                )
            declared += member.file_size
        if declared > size:
            raise UnsafeFileError(
                f"{path}: its members declare {_describe(declared)} in a file of {_describe(size)}"
            )
        file.seek(0)
        return file
    except BaseException:
        file.close()
        raise


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, synced, renamed over ``path`` with the replaced
    file's permissions (new: ``0o666 & ~umask``); a full disk is a :class:`DiskFullError`, ``path`` intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # never the special bits: ``path`` may link to another user's file, and the new one is ours
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)  # the only way to read it; set back at once
        os.umask(umask)
        mode = 0o666 & ~umask
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


def atomic_link(src: Path, dst: Path) -> None:
    """Make ``dst`` the same file as ``src`` atomically (a hard link where possible, else a copy)."""
    tmp = dst.with_name(f".{dst.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(exc, dst)
        raise


def raise_if_disk_full(exc: BaseException, path: Path) -> None:
    """Raise :class:`DiskFullError` for ``path`` if ``exc`` or an error in its ``__cause__`` /
    ``__context__`` chain (torch's failed write wraps the ``OSError``) says the disk or quota is full."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_DISK_ERRNOS:
            free = shutil.disk_usage(path.parent).free / MiB
            raise DiskFullError(
                f"cannot write {path}: no space left on the device ({free:.1f} MiB free in {path.parent}); "
                f"the previous {path.name}, if any, is unchanged",
            ) from exc
        pending += [error.__cause__, error.__context__]


def sweep_temporary_files(directory: Path) -> list[Path]:
    """Remove (and return) the temporary files a killed write left in ``directory``, not its subfolders;
    only for a directory no other process writes into (a live write's file would go too)."""
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.iterdir()):
        if _TEMPORARY_NAME.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))
