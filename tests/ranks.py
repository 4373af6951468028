"""A test's ranks: one function run in ``world`` processes, under a deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port of this host that no process listens on now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    world: int = 2,
    seconds: float = 120,
    what: str = "the ranks",
    start_method: str = "fork",
) -> None:
    """``function(rank, *args)`` in ``world`` processes, joined; a rank's failure is raised here with its
    traceback, and ranks still running after ``seconds`` are killed and the test fails naming ``what``.

    Forked by default: the ranks share the imports of the test process (a spawned rank imports torch and
    mlcls anew, seconds each); a process that has initialised CUDA must spawn them."""
    context = mp.start_processes(function, args=args, nprocs=world, join=False, start_method=start_method)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what} did not finish within {seconds:g} s")
