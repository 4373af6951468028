"""Process-group set-up under torchrun, and the few collectives the trainer needs."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


def init_distributed(device_preference: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1): NCCL on CUDA, gloo on CPU.

    Under SLURM through Hydra's submitit launcher the variables come from submitit. Without either this is
    a single process on rank 0.
    """
    device = resolve_device(device_preference)
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        # Launched by Hydra's submitit launcher (one process per task): derive torchrun's variables.
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
            # One group per process, reused by every run of a sweep, closed when the process exits.
            atexit.register(cleanup)
    elif device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every rank (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum of ``value`` over ranks (identity without a process group)."""
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
    return value


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
