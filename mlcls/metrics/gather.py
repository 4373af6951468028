"""Exact distributed collection of evaluation outputs.

Evaluation shards the validation set without padding (rank ``r`` takes indices ``r, r + W, r + 2W, ...``;
see :class:`mlcls.data.loader.ShardSampler`), so shards may differ in length by one. :func:`gather_shards`
brings every rank's rows to every rank, each sample exactly once and in dataset order, so 1 and N
processes evaluate identical tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_shards(local: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenate the strided shards ``local`` (rows ``rank::world_size``) of all ranks in dataset order.

    ``local`` is (n_r, ...) on each rank with ``sum(n_r) == total``. Without an initialised process group
    it is returned unchanged. The result is on the CPU; communication uses the backend's device
    (CUDA for NCCL).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local.cpu()
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    longest = -(-total // world)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=device)
    padded[: len(local)] = local.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    out = torch.empty((total, *local.shape[1:]), dtype=local.dtype)
    for rank, part in enumerate(parts):
        count = len(range(rank, total, world))
        out[rank::world] = part[:count].cpu()
    return out
