"""Exact distributed collection of evaluation outputs.

Evaluation shards the validation set without padding (rank ``r`` takes indices ``r, r + W, r + 2W, ...``;
see :class:`mlcls.data.loader.ShardSampler`), so shards may differ in length by one. :func:`gather_shards`
brings every rank's rows to every rank, each sample exactly once and in dataset order, so 1 and N
processes evaluate identical tensors. Floating-point rows are converted to float32 first, whatever the
AMP dtype they were computed in, on every path: float16/bfloat16 to float32 is exact, so the gathered
scores are the model's outputs bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _shard_length(rank: int, world: int, total: int) -> int:
    return len(range(rank, total, world))


def gather_shards(local: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenate the strided shards ``local`` (rows ``rank::world_size``) of all ranks in dataset order.

    ``local`` is (n_r, ...) on each rank with ``n_r = len(range(rank, total, world_size))``. Without an
    initialised process group (or with one process) ``local`` itself is the whole set. The result is on
    the CPU, float32 if ``local`` is floating point (other dtypes unchanged). Every rank must call it
    (a collective); communication uses the backend's device (CUDA for NCCL).

    Raises:
        ValueError: on every rank, if any rank's shard does not have the length above -- e.g. shards
            padded by ``DistributedSampler``, whose duplicates would otherwise be counted.
    """
    if local.is_floating_point():
        local = local.detach().float()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if len(local) != total:
            raise ValueError(f"gather_shards: {len(local)} rows but total={total} in a single process")
        return local.cpu()
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(local)], device=device))
    lengths = [int(length) for length in lengths]
    expected = [_shard_length(rank, world, total) for rank in range(world)]
    if lengths != expected:
        raise ValueError(
            f"gather_shards: shard lengths {lengths} but rows rank::{world} of {total} give {expected} "
            "(padded or overlapping shards?)"
        )
    longest = expected[0]
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=device)
    padded[: len(local)] = local.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    out = torch.empty((total, *local.shape[1:]), dtype=local.dtype)
    for rank, part in enumerate(parts):
        out[rank::world] = part[: expected[rank]].cpu()
    return out
