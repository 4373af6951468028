"""Training randomness: a function of ``(seed, epoch, sample index)`` only, whatever the number of
DataLoader workers, so that a run resumed mid-epoch sees exactly the batches it would have seen: the epoch's
permutation is drawn from ``seed + epoch`` (``DistributedSampler``'s rule), each sample's augmentation under
its :func:`sample_seed`. This module imports nothing of mlcls.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

T = TypeVar("T")


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for the augmentation of sample ``index`` in ``epoch``."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % (2**63 - 1)


def seeded_call(seed: int, function: Callable[..., T], *args: Any, torch_only: bool = False) -> T:
    """``function(*args)`` with torch/numpy/random seeded by ``seed``, the caller's random state restored
    afterwards. Only torch's CPU generator is seeded: ``torch.manual_seed`` would also seed every device
    generator, capturing a stack trace for each (~1 ms per sample). ``torch_only``: ``function`` draws from
    torch alone (``torch_random_only`` transforms), so Python's and NumPy's generators are neither seeded
    nor saved and restored (~0.1 ms a sample: NumPy copies its state word by word)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        if torch_only:
            return function(*args)
        py_state, np_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            return function(*args)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled, ``drop_last``; also for one process) yielding ``(index,
    sample_seed)`` pairs; ``set_start(k)`` skips the first ``k`` samples of this process's share of the
    current epoch (resuming mid-epoch), until the next ``set_epoch``."""

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
    """``ds[(index, seed)]``: ``ds.dataset[index]`` run under :func:`seeded_call`; with ``with_index``,
    ``(image, target, index)`` (what a loss with a row per training sample needs, e.g. ROLE's table)."""

    def __init__(self, dataset: Dataset, with_index: bool = False) -> None:
        self.dataset, self.with_index = dataset, with_index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        sample = seeded_call(seed, self.dataset.__getitem__, index)
        return (*sample, index) if self.with_index else sample


class RankSampler(Sampler[int]):
    """Evaluation sampler: rank ``r`` of ``W`` takes indices ``r, r + W, r + 2W, ...``, never a sample twice
    (unlike ``DistributedSampler``), so that :func:`mlcls.collectives.gather_rank_parts` restores dataset
    order exactly."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))
