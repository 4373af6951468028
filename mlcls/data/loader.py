"""Samplers and DataLoaders for training and (distributed) evaluation."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler


class ShardSampler(Sampler[int]):
    """Evaluation sampler: rank ``r`` of ``W`` takes indices ``r, r + W, r + 2W, ...``, without padding.

    Unlike ``DistributedSampler`` it never repeats a sample, so shards differ in length by at most one and
    :func:`mlcls.metrics.gather.gather_shards` restores dataset order exactly.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


def seed_worker(worker_id: int) -> None:
    """Seed numpy and ``random`` in a DataLoader worker from the seed torch gave it."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def train_loader(
    dataset: Dataset, batch_size: int, workers: int, rank: int, world_size: int, seed: int, pin_memory: bool
) -> DataLoader:
    """Shuffled loader of ``batch_size`` samples per process; incomplete last batches are dropped.

    Under DDP a ``DistributedSampler`` (seeded, ``set_epoch`` every epoch) shards the data; otherwise a
    ``RandomSampler`` whose generator is seeded per epoch by :func:`set_loader_epoch`.
    """
    if world_size > 1:
        sampler: Sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=True,
        persistent_workers=False,
        worker_init_fn=seed_worker,
    )


def set_loader_epoch(loader: DataLoader, epoch: int, seed: int) -> None:
    """Make the shuffling of ``epoch`` a function of (seed, epoch) only, so a resumed run sees the same order."""
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    elif isinstance(sampler, RandomSampler) and sampler.generator is not None:
        sampler.generator.manual_seed(seed + epoch)


def eval_loader(
    dataset: Dataset, batch_size: int, workers: int, rank: int, world_size: int, pin_memory: bool
) -> DataLoader:
    """Ordered loader over this process's shard (see :class:`ShardSampler`)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardSampler(len(dataset), rank, world_size),
        num_workers=workers,
        pin_memory=pin_memory,
        worker_init_fn=seed_worker,
    )
