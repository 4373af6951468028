"""What the benchmarks share: blocks timed in turns on a synchronised clock, the peak memory of a block,
torch's thread count for the length of a run, and the description of the machine a figure was measured on."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from mlcls.errors import ConfigError

T = TypeVar("T")


def sync(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (CUDA); nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def random_labels(rows: int, classes: int, positives: float, generator: torch.Generator) -> torch.Tensor:
    """{0, 1} float labels (rows, classes), each label positive with probability ``positives / classes``
    (at most 1/2): about ``positives`` per row."""
    return (torch.rand(rows, classes, generator=generator) < min(0.5, positives / classes)).float()


def check_names(option: str, names: list[str], known: tuple[str, ...]) -> None:
    """Raise :class:`ConfigError` unless ``names`` (given to ``option``) are one or more of ``known``."""
    if not names or any(name not in known for name in names):
        raise ConfigError(
            f"{option} {','.join(names)}; expected a comma-separated list of {', '.join(known)}"
        )


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def median_seconds(
    blocks: dict[str, Callable[[], Any]], repeats: int, warmup: int = 0, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """Median seconds of one call of each block over ``repeats`` rounds, after ``warmup`` untimed rounds.

    Each round calls every block once, in turn, the order reversed every other round, so that the blocks
    see the same machine state; ``device`` is synchronised before and after each call.
    """
    seconds: dict[str, list[float]] = {name: [] for name in blocks}
    for round_ in range(warmup + repeats):
        for name in list(blocks) if round_ % 2 == 0 else list(blocks)[::-1]:
            sync(device)
            start = time.perf_counter()
            blocks[name]()
            sync(device)
            if round_ >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def mmap_allocations() -> None:
    """Let glibc serve every new allocation above 4 KiB by ``mmap`` (Linux), so that a freed tensor leaves
    the resident set at once, and hand the heap's free pages back (``malloc_trim``), so that memory reused
    from it counts again once touched: :func:`peak_bytes` then sees the bytes live at the worst moment. Each
    allocation costs a system call afterwards: call it after the timings."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 4096)  # M_MMAP_THRESHOLD = 4 KiB
    libc.malloc_trim(0)


def _rss_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as status:
        return 1024 * int(re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.M).group(1))


def peak_bytes(block: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """The memory one call of ``block`` adds at its worst moment: on CUDA the allocator's peak above what was
    allocated before; on the CPU (Linux, after :func:`mmap_allocations`) the resident set's high-water mark,
    reset through ``/proc/self/clear_refs`` before the call, above the resident size before it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        block()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current resident size
    before = _rss_bytes("VmRSS")
    block()
    return _rss_bytes("VmHWM") - before


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Torch runs ``threads`` intra-op threads inside the block (``None``: its setting is kept); the previous
    setting is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def host() -> dict[str, Any]:
    """``torch_threads``, ``cpus`` and ``machine`` (architecture and processor), the last keys of a result."""
    return {
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
    }


def run_with_options(run: Callable[..., T], args: argparse.Namespace) -> T:
    """``run`` called with each option of ``args`` named like one of its parameters (others: its defaults)."""
    parameters = inspect.signature(run).parameters
    return run(**{name: value for name, value in vars(args).items() if name in parameters})
