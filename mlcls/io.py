"""Files written atomically (a crash mid-write leaves the previous complete file), and files read only
when regular and within a cap (:func:`open_regular`, the one door). No other mlcls import.

A file is read no further than the size ``fstat`` gave when the door opened it, plus one byte to see it
grow: a file that grows is refused, and so is one that declares 0 bytes and streams anyway (``/proc`` and
``/sys`` files). A whole file is read into one buffer of that size: reading a file of N bytes holds N bytes
(its text, decoded by :func:`read_text`, N to 4 N more). A checkpoint of N bytes (:mod:`mlcls.torchfile`)
holds at most N plus 16 MiB (its ``data.pkl``) plus under 200 MiB (what that pickle's capped opcodes build).
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import shutil
import stat
import tempfile
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
    "caption": 1 * MiB,  # one image's caption file (its tags: a few hundred bytes)
    "label file": 8 * GiB,  # a dataset's annotation JSON, CSV or list
    "predictions": 4 * GiB,  # val_predictions.npz
    "checkpoint": 64 * GiB,  # a checkpoint or a released weights file
    "checkpoint pickle": 16 * MiB,  # its data.pkl (an mlcls run's: 45 kB for 330 tensors)
    "word vectors": 8 * GiB,  # a GloVe / fastText text file, streamed (glove.840B.300d.txt is 5.6 GB)
}


def describe_size(size: int) -> str:
    """``size`` bytes as a message says it: ``"3.0 MiB"``, ``"512 bytes"``."""
    return f"{size / MiB:.1f} MiB" if size >= MiB else f"{size} bytes"


class _DeclaredFile(io.FileIO):
    """The regular file open on ``fd``, read no further than the ``size`` it declared when opened plus one
    byte: reading that byte is a :class:`FileTooLargeError` (the file grew), whichever method reads."""

    def __init__(self, fd: int, size: int, name: str, what: str) -> None:
        super().__init__(fd, "rb")
        self.declared, self.shown, self.what = size, name, what

    def _left(self) -> int:
        return max(self.declared + 1 - self.tell(), 0)

    def _checked(self, result: Any) -> Any:
        if self.tell() > self.declared:
            raise FileTooLargeError(
                f"{self.shown} grew past the {describe_size(self.declared)} it had when opened; "
                f"a {self.what} that stays as it is expected"
            )
        return result

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view, view.cast("B")[: self._left()] as part:
            return self._checked(super().readinto(part))

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        return self._checked(super().read(min(size, self._left())))

    def readall(self) -> bytes:
        """The rest of the file, read into one buffer of its declared size (plus the byte that shows growth)
        and returned without a copy (``BytesIO.getvalue`` hands over its buffer)."""
        left, filled = self._left(), 0
        buffer = io.BytesIO()
        if left:
            buffer.seek(left - 1)
            buffer.write(b"\0")
        with buffer.getbuffer() as view:
            while filled < left:
                with view[filled:] as part:
                    count = super().readinto(part)
                if not count:
                    break
                filled += count
        self._checked(None)
        buffer.truncate(filled)
        return buffer.getvalue()


def _streams(fd: int) -> bool:
    """Whether the file open on ``fd``, which declares 0 bytes, yields some anyway (a ``/proc`` or ``/sys``
    file): 8 bytes asked at offset 0 (``/proc/*/pagemap`` reads only in 8-byte records; an error is as
    telling as data)."""
    try:
        return bool(os.pread(fd, 8, 0))
    except OSError:
        return True


def open_regular(
    path: str | Path, mode: str = "rb", *, max_bytes: int | None = None, what: str = "file", **kwargs
) -> IO:
    """``open(path, mode, **kwargs)`` for reading: the one way mlcls opens a file it did not write. Refused
    with :class:`NotRegularFileError` unless a regular file (after links) that holds the size it declares,
    :class:`FileTooLargeError` over ``max_bytes``.

    A named file may be a pipe or a device (``/dev/zero``) that would block the reader or never end. It is
    opened once, without blocking, and judged by that descriptor: a link flipped meanwhile slips nothing in.
    Its size is read once (``fstat``), and nothing reads past it (plus the byte that shows growth).
    """
    if any(flag in mode for flag in "wax+"):
        raise ValueError(f"open_regular reads files; mode {mode!r} writes")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO and stat.S_ISSOCK(os.stat(path).st_mode):  # a socket cannot be opened
            raise NotRegularFileError(f"{path} is a socket; expected a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            named = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
            raise NotRegularFileError(f"{path} is {named}; expected a regular file")
        if info.st_size == 0 and _streams(fd):
            raise NotRegularFileError(
                f"{path} declares 0 bytes and yet streams (a /proc or /sys file); expected a regular file"
            )
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileTooLargeError(
                f"{path} is {describe_size(info.st_size)}; a {what} of at most {describe_size(max_bytes)} "
                "expected"
            )
        os.set_blocking(fd, True)
        raw = _DeclaredFile(fd, info.st_size, str(path), what)
    except BaseException:
        os.close(fd)
        raise
    try:
        buffered = io.BufferedReader(raw)
        return buffered if "b" in mode else io.TextIOWrapper(buffered, **kwargs)
    except BaseException:
        raw.close()
        raise


def read_regular_bytes(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``, in one buffer of its size."""
    with open_regular(path, max_bytes=max_bytes, what=what) as f:
        return f.read()


def read_capped(stream: IO[bytes], max_bytes: int, name: str, what: str = "file") -> bytes:
    """The bytes of the open ``stream`` of unknown size (an HTTP body, a command's output) named ``name``;
    :class:`FileTooLargeError` once it holds more than ``max_bytes``. Read in blocks into one growing
    buffer, handed over without a copy."""
    data = io.BytesIO()
    while data.tell() <= max_bytes and (block := stream.read(min(max_bytes + 1 - data.tell(), MiB))):
        data.write(block)  # a read of n bytes allocates n first: blocks, never the whole cap
    if data.tell() > max_bytes:
        raise FileTooLargeError(f"{name} holds over {describe_size(max_bytes)}; a {what} expected")
    return data.getvalue()


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


def _finite_or_none(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite_or_none(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_or_none(v) for v in data]
    return data


def write_json(data: Any, path: str | Path) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically; NaN and infinities become ``null``."""
    text = json.dumps(_finite_or_none(data), indent=2, allow_nan=False) + "\n"
    atomic_write(Path(path), lambda f: f.write(text.encode()))


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
