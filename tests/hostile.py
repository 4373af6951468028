"""Reading hostile files under a memory cap and a time limit.

Every test that hands mlcls a crafted file runs the read through :func:`bounded` (a function, in a forked
child process) or :func:`bounded_command` (a console script, in a subprocess). The child's address space
is limited to what it has mapped plus ``memory_mb``, so an allocation a crafted file asks for fails there at
once instead of exhausting the machine, and an alarm ends a read that blocks. The outcome is returned as
data for the test to assert on: a ``MemoryError`` or a timeout is an escape, never a one-line refusal.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import subprocess
import sys
import traceback
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
