"""Process-group set-up under torchrun or SLURM, and the agreement of every rank on a failure (the
collectives themselves are :mod:`mlcls.distributed`'s).

The process group has two backends: NCCL for CUDA tensors (gradients, logits) and gloo for CPU tensors
(control messages: the stop flag, the status of a rank's work, objects). Control messages therefore never
wait for the GPU's stream, and a status exchange can end every rank when one fails.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mlcls.distributed import all_gather_object, initialized

T = TypeVar("T")


class RankFailed(RuntimeError):
    """Another rank failed during work every rank takes part in; its error is in the message."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs: rank among ``world_size`` processes, its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(preference: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device={preference!r}; expected auto, cpu or cuda")
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(preference)


def export_slurm_environment() -> None:
    """Under Hydra's submitit launcher (one process per SLURM task, no torchrun), set torchrun's variables
    from submitit's view of the job. A no-op when ``WORLD_SIZE`` is already set or outside SLURM."""
    if "WORLD_SIZE" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return
    import submitit

    # submitit's defaults would refuse a MASTER_PORT the job script set (it reads it as the port all the
    # same), and narrow CUDA_VISIBLE_DEVICES to the local rank, after which no device index but 0 exists;
    # the device is chosen by cuda_device_index instead, from the devices SLURM gave the task.
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


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
    """The number of processes of this run, as :func:`init_distributed` will see it (1 without a launcher)."""
    export_slurm_environment()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_preference: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Join the process group torchrun (``WORLD_SIZE`` > 1) or SLURM through submitit describes (without
    either: a single process, rank 0); ``timeout_s`` bounds how long a collective waits for a missing rank.
    """
    device = resolve_device(device_preference)
    export_slurm_environment()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
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
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def agree(error: BaseException | None) -> None:
    """Exchange every rank's outcome of a piece of work; raise on every rank if any rank failed.

    The failing rank re-raises its own error; the others raise :class:`RankFailed` naming the first failed
    rank and its error. Call it on every rank at the same point, where a rank would otherwise wait in a
    collective (a barrier, a gather) for a rank that will never arrive.
    """
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
