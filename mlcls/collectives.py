"""Every collective of mlcls: objects and sums for the trainer, the exact gather of evaluation outputs,
and the differentiable gather of a loss's global batch. Each is the identity (or an error where a process
group is required) without a process group, and a collective every rank must call at the same point. The
process group itself and the agreement on a rank's failure are :mod:`mlcls.engine.distributed`'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

MAX_DIMS = 8


def communication_device(backend: str) -> torch.device:
    """The device a process group with ``backend`` (one name, or one per device type as the trainer's
    ``"cpu:gloo,cuda:nccl"``) exchanges tensors on: the current CUDA device under NCCL, else the CPU."""
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        cuda_backend = per_device.get("cuda")
    else:
        cuda_backend = backend
    if cuda_backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_rank_parts(local: torch.Tensor, total: int, dst: int | None = None) -> torch.Tensor | None:
    """Concatenate every rank's part ``local`` (rows ``rank::world_size`` of :class:`RankSampler`'s
    unpadded split) in dataset order, each sample exactly once: 1 and N processes evaluate identical tensors.

    ``local`` is (n_r, ...) with ``n_r = len(range(rank, total, world_size))`` (a rank without rows may pass
    ``torch.empty(0)``). The result is on the CPU, float32 if floating (exact from float16/bfloat16), on
    every rank (``dst=None``) or on rank ``dst`` only (the others get None).

    Raises:
        ValueError: on every rank alike, if a part has another length (e.g. ``DistributedSampler``'s padded
            duplicates) or the parts' trailing shapes differ.
    """
    if local.is_floating_point():
        local = local.detach().float()
    if not initialized() or dist.get_world_size() == 1:
        if len(local) != total:
            raise ValueError(f"gather_rank_parts: {len(local)} rows but total={total} in a single process")
        return local.cpu()
    if local.dim() > MAX_DIMS:
        raise ValueError(f"gather_rank_parts: at most {MAX_DIMS} dimensions, got {local.dim()}")
    world, receives = dist.get_world_size(), dst is None or dist.get_rank() == dst
    device = communication_device(dist.get_backend())

    # every rank learns every part's length and trailing shape, so all ranks raise (or not) together
    layout = torch.full((1 + MAX_DIMS,), -1, dtype=torch.int64)
    layout[0] = len(local)
    layout[1 : local.dim()] = torch.tensor(local.shape[1:], dtype=torch.int64)
    layouts = all_gather_rows(layout.to(device)[None]).tolist()
    lengths = [part[0] for part in layouts]
    expected = [len(range(rank, total, world)) for rank in range(world)]
    if lengths != expected:
        raise ValueError(
            f"gather_rank_parts: part lengths {lengths} but rows rank::{world} of {total} give {expected} "
            "(padded or overlapping parts?)"
        )
    row_shapes = {tuple(size for size in part[1:] if size >= 0) for part in layouts if part[0] > 0}
    if len(row_shapes) > 1:
        raise ValueError(f"gather_rank_parts: parts have different row shapes {sorted(row_shapes)}")
    if not row_shapes:  # total == 0
        return local.cpu() if receives else None
    row_shape = row_shapes.pop()
    local = local.reshape(len(local), *row_shape)

    padded = torch.zeros((expected[0], *row_shape), dtype=local.dtype, device=device)
    padded[: len(local)] = local.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)] if receives else None
    if dst is None:
        dist.all_gather(parts, padded)
    else:
        dist.gather(padded, parts, dst=dst)
    if not receives:
        return None
    out = torch.empty((total, *row_shape), dtype=local.dtype)
    for rank in range(world):
        out[rank::world] = parts[rank][: expected[rank]]
        parts[rank] = None  # each part is freed once copied
    return out


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the process group, 0 without one."""
    return dist.get_rank() if initialized() else 0


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every rank (identity without a process group)."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not initialized():
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def broadcast_buffers(model: nn.Module) -> None:
    """Under DDP, rank 0's buffers (BatchNorm running statistics) on every rank; a no-op otherwise."""
    if initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def all_reduce_max(flag: torch.Tensor, async_op: bool = False) -> dist.Work | None:
    """``flag`` replaced in place by its maximum over the ranks (a stop request of any rank); with
    ``async_op`` the exchange is only started, and the returned work's ``wait()`` completes it."""
    return dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=async_op)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum of ``value`` over ranks (identity without a process group)."""
    if initialized():
        value = value.clone()
        dist.all_reduce(value)
    return value


class _GatherRows(torch.autograd.Function):
    """All ranks' (B, C) rows concatenated in rank order; the backward sums, over the ranks, the gradients
    sent to this rank's rows (all-reduce, then this rank's slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, rows: Tensor) -> Tensor:
        ctx.span = (dist.get_rank() * rows.shape[0], (dist.get_rank() + 1) * rows.shape[0])
        return all_gather_rows(rows)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # the incoming gradient may be shared
        dist.all_reduce(grad)
        start, end = ctx.span
        return grad[start:end]


def all_gather_rows(rows: Tensor) -> Tensor:
    """Every rank's ``rows`` (same shape on each), concatenated along dim 0 in rank order; no gradient."""
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, rows.contiguous())
    return torch.cat(parts)


def gather_batch(logits: Tensor, targets: Tensor, check_sizes: bool = True) -> tuple[Tensor, Tensor]:
    """Concatenate every rank's rows in rank order; gradients flow back to each rank's ``logits``. The
    backward *sums* what all ranks send to a rank's slice: every rank computes the same loss on the same
    global batch, so the sum is ``world_size`` times its gradient, which DDP's averaging divides back.

    Every rank must hold as many rows: ``check_sizes`` (a collective) compares them, a ``ValueError`` on a
    mismatch (:class:`BucketedLoss` checks once: the training loaders drop the last incomplete batch).
    """
    if not initialized():
        raise ValueError("gather=True needs torch.distributed initialised (run under torchrun)")
    world = dist.get_world_size()
    if world == 1:
        return logits, targets
    if check_sizes:
        rows = all_gather_rows(torch.tensor([logits.shape[0]], device=logits.device)).tolist()
        if len(set(rows)) > 1:
            raise ValueError(f"gather=True needs the same batch size on every rank; got {rows}")
    return _GatherRows.apply(logits.contiguous()), all_gather_rows(targets)
