"""Samplers and DataLoaders for training and (distributed) evaluation.

Training randomness is a function of ``(seed, epoch, sample index)`` only: the sampler draws the epoch's
permutation from ``seed + epoch`` (``DistributedSampler``'s rule, also for a single process) and hands each
index to the dataset together with a per-sample seed, under which the sample's augmentation runs. Hence
the augmented batch at iteration *i* does not depend on the number of DataLoader workers, and a run resumed
in the middle of an epoch (``ResumableSampler.set_start``) sees exactly the batches it would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from mlcls.data.fast import collate_batch


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for the augmentation of sample ``index`` in ``epoch``."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % (2**63 - 1)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled, ``drop_last``) yielding ``(index, sample_seed)`` pairs.

    Works for a single process too (``num_replicas=1``). ``set_epoch`` as usual; ``set_start(k)`` skips the
    first ``k`` samples of this process's share of the current epoch (resuming mid-epoch), until the next
    ``set_epoch``.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def set_start(self, start: int) -> None:
        self.start = start

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        indices = list(super().__iter__())[self.start :]
        return iter([(i, sample_seed(self.seed, self.epoch, i)) for i in indices])

    def __len__(self) -> int:
        return self.num_samples - self.start


class SeededSamples(Dataset):
    """Wraps a dataset so that ``ds[(index, seed)]`` runs ``ds.dataset[index]`` with torch/numpy/random seeded
    by ``seed``; the caller's random state is restored afterwards (it also runs in the main process)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            try:
                return self.dataset[index]
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)


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


def train_loader(
    dataset: Dataset, batch_size: int, workers: int, rank: int, world_size: int, seed: int, pin_memory: bool
) -> DataLoader:
    """Shuffled loader of ``batch_size`` samples per process over a :class:`ResumableSampler`;
    the incomplete last batch is dropped. Call ``loader.sampler.set_epoch(epoch)`` every epoch."""
    return DataLoader(
        SeededSamples(dataset),
        batch_size=batch_size,
        sampler=ResumableSampler(dataset, world_size, rank, seed),
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=True,
        collate_fn=collate_batch,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )


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
    )
