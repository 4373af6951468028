"""Process-group set-up under torchrun or SLURM, and what every rank agrees on: a failure, and a stop
request (the collectives themselves are :mod:`mlcls.collectives`'s).

The group has two backends: NCCL for CUDA tensors and gloo for CPU tensors (the stop flag, a rank's
status, objects), which never wait for the GPU's stream: a status exchange can end every rank when one
fails. SIGTERM, SIGUSR1 (SLURM's warnings) and a first SIGINT stop the run after the current step,
checkpointed, on every rank after the same step (:class:`StopSignals`); a second SIGINT ends it at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mlcls.collectives import all_gather_object, all_reduce_max, initialized
from mlcls.errors import ConfigError

log = logging.getLogger("mlcls")

T = TypeVar("T")


class RankFailed(RuntimeError):
    """Another rank failed during work every rank takes part in; its error is in the message."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs: rank among ``world_size`` processes, its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(preference: str, key: str = "trainer.device") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; another value, or ``cuda`` without a GPU, is a
    :class:`ConfigError` naming the config ``key``: the one check of the device setting."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{key}={preference!r}; expected auto, cpu or cuda")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda but no CUDA device is available; use {key}=cpu")
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(preference)


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The CUDA device of the process with ``local_rank`` among the ``device_count`` it can see: its own
    index when each process sees every GPU of the node, 0 when it sees only the one bound to it."""
    if local_rank < device_count:
        return local_rank
    if device_count == 1:
        return 0
    raise RuntimeError(
        f"LOCAL_RANK={local_rank} but this process sees {device_count} CUDA devices "
        "(CUDA_VISIBLE_DEVICES); launch one process per GPU"
    )


def world_size_from_environment() -> int:
    """The number of processes of this run (1 without a launcher). Under Hydra's submitit launcher (a
    process per SLURM task, no torchrun) torchrun's variables are set first, from submitit's view of the job.
    """
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        import submitit

        # submitit's defaults would refuse a MASTER_PORT the job script set (it reads it all the same), and
        # narrow CUDA_VISIBLE_DEVICES to the local rank, after which no device index but 0 exists; the
        # device is chosen by cuda_device_index instead, from the devices SLURM gave the task.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(
    device_preference: str = "auto", timeout_s: float | None = None, key: str = "trainer.device"
) -> DistInfo:
    """Join the process group torchrun or SLURM through submitit describes (without either: a single
    process, rank 0) on the device of setting ``key`` (:func:`resolve_device`); ``timeout_s`` bounds how
    long a collective waits for a missing rank."""
    device = resolve_device(device_preference, key)
    world_size = world_size_from_environment()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1:
        if device.type == "cuda":
            device = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {"backend": backend}
            if timeout_s:
                kwargs["timeout"] = timedelta(seconds=timeout_s)
            dist.init_process_group(**kwargs)
            # One group per process, reused by every run of a sweep, closed when the process exits.
            atexit.register(cleanup)
    elif device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return DistInfo(rank=rank, world_size=world_size, device=device)


def agree(error: BaseException | None) -> None:
    """Exchange every rank's outcome of a piece of work; if any failed, raise on every rank: the failing
    rank its own error, the others :class:`RankFailed` naming the first failed rank and its error."""
    if error is not None and not isinstance(error, Exception):
        raise error  # KeyboardInterrupt, SystemExit: this process ends at once
    failures = [
        (rank, message)
        for rank, message in enumerate(all_gather_object(None if error is None else _describe(error)))
        if message is not None
    ]
    if error is not None:
        raise error
    if failures:
        rank, message = failures[0]
        raise RankFailed(f"rank {rank} failed: {message}")


@contextlib.contextmanager
def all_or_none() -> Iterator[None]:
    """Run the block on every rank; if it raises on any rank, raise on every rank (see :func:`agree`)."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - handed to agree(), which re-raises it
        error = exc
    agree(error)


def on_main(work: Callable[[], T], is_main: bool) -> T | None:
    """``work()`` on rank 0 only, then every rank continues together; if it raises, every rank raises
    (where "rank 0 writes, then barrier" would leave the others waiting for a dead rank 0 until timeout)."""
    result: T | None = None
    with all_or_none():
        if is_main:
            result = work()
    return result


def _describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def cleanup() -> None:
    if initialized():
        dist.destroy_process_group()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Steps between two exchanges of the stop flags under DDP: a signal takes effect within 2 x POLL_EVERY steps.
POLL_EVERY = 10


class StopSignals:
    """The stop handlers, for a ``with`` block: ``received`` is the first signal this process got (or None),
    :meth:`poll` the decision all ranks share; the handlers installed before (submitit's) are ``previous``.
    Under DDP the flags are exchanged every :data:`POLL_EVERY` steps, asynchronously: the exchange started
    at one poll is read at the next, so no step waits for the decision."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def __enter__(self) -> StopSignals:
        self.previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self._settle()  # a started exchange must complete before the group is reused
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        if self.received is None:
            self.received = signum
            hint = " (Ctrl-C again to quit at once)" if signum == signal.SIGINT else ""
            log.warning("received %s: stopping after this step%s", signal.Signals(signum).name, hint)

    def poll(self, step: int) -> bool:
        """True on every rank when the run must stop after step ``step`` (counted from 1): at once in a
        single process, under DDP at multiples of :data:`POLL_EVERY` from the previous multiple's exchange."""
        if not self.distributed:
            return self.received is not None
        if step % POLL_EVERY:
            return False
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()  # started POLL_EVERY steps ago: long done
            stop = bool(flag.item())  # a CPU tensor: no device synchronisation
        flag = torch.tensor([float(self.received is not None)])
        self._pending = (all_reduce_max(flag, async_op=True), flag)
        return stop

    def agree_now(self) -> bool:
        """The decision of all ranks at once (a blocking exchange), for the end of an epoch."""
        self._settle()
        if not self.distributed:
            return self.received is not None
        flag = torch.tensor([float(self.received is not None)])
        all_reduce_max(flag)
        return bool(flag.item())

    def _settle(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def hand_over(self) -> None:
        """Give the received signal to the handler installed before ours (submitit requeues the job)."""
        handler: Callable[..., Any] | Any = self.previous.get(self.received) if self.received else None
        if callable(handler) and handler is not signal.default_int_handler:
            handler(self.received, None)
