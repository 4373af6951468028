"""Reading hostile files under a memory cap and a time limit.

Every test that hands mlcls a crafted file runs the read through :func:`bounded` (a function, in a forked
child process) or :func:`bounded_command` (a console script, in a subprocess). The child's address space
is limited to what it has mapped plus ``memory_mb``, so an allocation a crafted file asks for fails there at
once instead of exhausting the machine, and an alarm ends a read that blocks. The outcome is returned as
data for the test to assert on: a ``MemoryError`` or a timeout is an escape, never a one-line refusal.

It also builds the hostile files more than one test reads: zip archives written again (:func:`rezip`), a
checkpoint with two zip directories (:func:`two_directories`) and pickles that build more than they hold
(:func:`empty_dicts_pickle`, :func:`nested_list_pickle`, :func:`nested_tuple_key_pickle`) put in a
checkpoint (:func:`with_pickle`).
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import signal
import struct
import subprocess
import sys
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MEMORY_MB = 1024  # above what the child has mapped when it starts
SECONDS = 20


@dataclass
class Outcome:
    """What a bounded call did: ``value`` when it returned, else the exception's type name and message (or
    ``"Timeout"`` / ``"Killed"``), the traceback text, and whether a ``MemoryError`` was raised anywhere."""

    value: Any = None
    error: str | None = None
    message: str = ""
    trace: str = ""

    @property
    def escaped(self) -> bool:
        """The read exhausted its memory or time, or crashed: not a clean refusal."""
        exhausted = ("MemoryError", "bad_alloc", "can't allocate memory", "RecursionError")
        return self.error in {"MemoryError", "Timeout", "Killed", "RecursionError"} or any(
            sign in self.trace or sign in self.message for sign in exhausted
        )


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _limit(memory_mb: int, seconds: float) -> None:
    cap = _mapped_bytes() + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.setitimer(signal.ITIMER_REAL, seconds)


def bounded(
    fn: Callable[..., Any], *args: Any, memory_mb: int = MEMORY_MB, seconds: float = SECONDS, **kwargs: Any
) -> Outcome:
    """``fn(*args, **kwargs)`` in a forked child under the caps; its outcome (the value must pickle)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, exit without running the parent's exit handlers
        os.close(read)
        outcome = Outcome()
        try:
            import torch

            torch.set_num_threads(1)

            def timeout(*_):
                raise TimeoutError("alarm")

            signal.signal(signal.SIGALRM, timeout)
            _limit(memory_mb, seconds)
            outcome.value = fn(*args, **kwargs)
        except TimeoutError as exc:
            outcome.error, outcome.message = ("Timeout" if str(exc) == "alarm" else "TimeoutError"), str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            name = "MemoryError" if isinstance(exc, MemoryError) else type(exc).__name__
            outcome.error, outcome.message = name, str(exc)
            outcome.trace = "".join(traceback.format_exception(exc))
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            data = pickle.dumps(outcome)
        except Exception:  # noqa: BLE001 - an unpicklable value
            data = pickle.dumps(Outcome(None, outcome.error, outcome.message, outcome.trace))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(data)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return Outcome(error="Killed", message=f"child ended with status {status}")
    return pickle.loads(data)  # noqa: S301 - written by our own child


def bounded_command(
    args: list[str], memory_mb: int = 3072, seconds: float = 60, **kwargs: Any
) -> subprocess.CompletedProcess:
    """A command run under an address-space limit of ``memory_mb`` (a whole Python process with torch
    imported maps about 1.5 GB) and a time limit; a timeout returns exit status ``"Timeout"``."""
    cap = memory_mb * 2**20

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", **kwargs.pop("env", {})}
    try:
        return subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=seconds,
            preexec_fn=limit,
            env=env,
            stdin=subprocess.DEVNULL,
            **kwargs,
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(args, "Timeout", exc.stdout or "", exc.stderr or "")


def python_command(*args: str) -> list[str]:
    """``python -m`` of this interpreter, for :func:`bounded_command`."""
    return [sys.executable, *args]


# ------------------------------------------------------------------------------------------- hostile files
_ENTRY = struct.Struct("<4s6H3L5H2L")  # a zip central-directory entry


def two_directories(archive: bytes) -> bytes:
    """The zip ``archive`` (written by Python's ``zipfile``, members deflated) with a second directory, a
    copy of its own with every member declared stored at its compressed size, placed just before the end
    record. The end record still states the first directory's offset, which torch's reader (miniz) follows;
    Python's ``zipfile`` reads the copy, which ends where the end record starts, and takes the first
    directory for prepended data."""
    end = archive.rfind(b"PK\x05\x06")
    entries, offset = struct.unpack_from("<H4xL", archive, end + 10)
    copy, at = bytearray(), offset
    for _ in range(entries):
        fields = list(_ENTRY.unpack_from(archive, at))
        length = _ENTRY.size + sum(fields[10:13])  # with its name, extra field and comment
        fields[4], fields[9] = zipfile.ZIP_STORED, fields[8]
        copy += _ENTRY.pack(*fields) + archive[at + _ENTRY.size : at + length]
        at += length
    return archive[:end] + bytes(copy) + archive[end:]  # the same length: the end record's size fits both


def rezip(archive: bytes, compression: int, edit: Callable[[str, bytes], bytes] | None = None) -> bytes:
    """The zip ``archive`` written again by Python's ``zipfile`` with ``compression``; ``edit(name, bytes)``
    may change a member's bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", compression) as dst:
        for info in src.infolist():
            member = src.read(info.filename)
            dst.writestr(info.filename, edit(info.filename, member) if edit else member)
    return out.getvalue()


def with_pickle(archive: bytes, data_pkl: bytes) -> bytes:
    """The ``torch.save`` archive with ``data_pkl`` as its ``data.pkl``, every member stored."""
    return rezip(
        archive, zipfile.ZIP_STORED, lambda name, data: data_pkl if name.endswith("/data.pkl") else data
    )


def _pickle_of(config: bytes) -> bytes:
    """A protocol-2 pickle of ``{"model": {}, "config": <config>}``; ``config`` builds its value."""
    return b"\x80\x02}(X\x05\x00\x00\x00model}X\x06\x00\x00\x00config" + config + b"u."


def empty_dicts_pickle(count: int) -> bytes:
    """A checkpoint pickle whose ``config`` is a list of ``count`` empty dicts: one byte each."""
    return _pickle_of(b"](" + b"}" * count + b"e")


def nested_list_pickle(depth: int) -> bytes:
    """A checkpoint pickle whose ``config`` holds a list nested ``depth`` deep (two bytes a level)."""
    return _pickle_of(b"}X\x01\x00\x00\x00a" + b"]" * depth + b"a" * (depth - 1) + b"s")


def nested_tuple_key_pickle(depth: int) -> bytes:
    """A checkpoint pickle whose ``config`` is a dict keyed by a tuple nested ``depth`` deep: hashing the key
    recurses in C once per level."""
    return _pickle_of(b"}" + b")" + b"\x85" * depth + b"K\x01s")
