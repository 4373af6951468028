"""Exact distributed collection of evaluation outputs.

Evaluation shards the validation set without padding (rank ``r`` takes indices ``r, r + W, r + 2W, ...``;
see :class:`mlcls.data.loader.ShardSampler`), so shards may differ in length by one, and a rank may hold
no row at all when the set is smaller than the world. :func:`gather_shards` brings every rank's rows to
every rank, each sample exactly once and in dataset order, so 1 and N processes evaluate identical
tensors. Floating-point rows are converted to float32 first, whatever the AMP dtype they were computed in,
on every path: float16/bfloat16 to float32 is exact, so the gathered scores are the model's outputs bit
for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_DIMS = 8


def _shard_length(rank: int, world: int, total: int) -> int:
    return len(range(rank, total, world))


def gather_shards(local: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenate the strided shards ``local`` (rows ``rank::world_size``) of all ranks in dataset order.

    ``local`` is (n_r, ...) on each rank with ``n_r = len(range(rank, total, world_size))``; a rank without
    rows may pass any empty tensor (e.g. ``torch.empty(0)``). Without an initialised process group (or
    with one process) ``local`` itself is the whole set. The result is on the CPU, float32 if ``local``
    is floating point (other dtypes unchanged). Every rank must call it (a collective); communication
    uses the backend's device (CUDA for NCCL).

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
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"

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
        return local.cpu()
    row_shape = row_shapes.pop()
    local = local.reshape(len(local), *row_shape)

    padded = torch.zeros((expected[0], *row_shape), dtype=local.dtype, device=device)
    padded[: len(local)] = local.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    out = torch.empty((total, *row_shape), dtype=local.dtype)
    for rank, part in enumerate(parts):
        out[rank::world] = part[: expected[rank]].cpu()
    return out
