"""Exact distributed collection of evaluation outputs.

Evaluation shards the validation set without padding (rank ``r`` takes indices ``r, r + W, r + 2W, ...``;
see :class:`mlcls.data.loader.RankSampler`), so shards may differ in length by one, and a rank may hold
no row at all when the set is smaller than the world. :func:`gather_shards` brings every rank's rows to
every rank, or to one rank ``dst`` only, each sample exactly once and in dataset order, so 1 and N
processes evaluate identical tensors. Floating-point rows are converted to float32 first, whatever the AMP
dtype they were computed in, on every path: float16/bfloat16 to float32 is exact, so the gathered scores
are the model's outputs bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_DIMS = 8


def _shard_length(rank: int, world: int, total: int) -> int:
    return len(range(rank, total, world))


def communication_device(backend: str) -> torch.device:
    """The device whose tensors a process group with ``backend`` should exchange: the current CUDA device
    when the group serves CUDA tensors with NCCL, else the CPU.

    ``backend`` is what ``torch.distributed.get_backend()`` returns: one name (``"nccl"``, ``"gloo"``) or
    one per device type, as the trainer's ``"cpu:gloo,cuda:nccl"`` (where NCCL is the CUDA backend, not
    the group's name).
    """
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        cuda_backend = per_device.get("cuda")
    else:
        cuda_backend = backend
    if cuda_backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_shards(local: torch.Tensor, total: int, dst: int | None = None) -> torch.Tensor | None:
    """Concatenate the strided shards ``local`` (rows ``rank::world_size``) of all ranks in dataset order.

    ``local`` is (n_r, ...) on each rank with ``n_r = len(range(rank, total, world_size))``; a rank without
    rows may pass any empty tensor (e.g. ``torch.empty(0)``). Without an initialised process group (or
    with one process) ``local`` itself is the whole set. The result is on the CPU, float32 if ``local``
    is floating point (other dtypes unchanged), on every rank (``dst=None``) or on rank ``dst`` only (the
    other ranks get None, and hold no copy of the whole set). Every rank must call it (a collective);
    communication runs on :func:`communication_device` (CUDA when the group has NCCL for it).

    Raises:
        ValueError: on every rank alike, if a shard does not have the length above -- e.g. shards padded
            by ``DistributedSampler``, whose duplicates would otherwise be counted -- or if the shards'
            trailing shapes differ.
    """
    if local.is_floating_point():
        local = local.detach().float()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if len(local) != total:
            raise ValueError(f"gather_shards: {len(local)} rows but total={total} in a single process")
        return local.cpu()
    if local.dim() > MAX_DIMS:
        raise ValueError(f"gather_shards: at most {MAX_DIMS} dimensions, got {local.dim()}")
    world, receives = dist.get_world_size(), dst is None or dist.get_rank() == dst
    device = communication_device(dist.get_backend())

    # every rank learns every shard's length and trailing shape, so all ranks raise (or not) together
    layout = torch.full((1 + MAX_DIMS,), -1, dtype=torch.int64)
    layout[0] = len(local)
    layout[1 : local.dim()] = torch.tensor(local.shape[1:], dtype=torch.int64)
    layouts = [torch.empty_like(layout, device=device) for _ in range(world)]
    dist.all_gather(layouts, layout.to(device))
    layouts = [part.tolist() for part in layouts]
    lengths = [part[0] for part in layouts]
    expected = [_shard_length(rank, world, total) for rank in range(world)]
    if lengths != expected:
        raise ValueError(
            f"gather_shards: shard lengths {lengths} but rows rank::{world} of {total} give {expected} "
            "(padded or overlapping shards?)"
        )
    row_shapes = {tuple(size for size in part[1:] if size >= 0) for part in layouts if part[0] > 0}
    if len(row_shapes) > 1:
        raise ValueError(f"gather_shards: shards have different row shapes {sorted(row_shapes)}")
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
