"""Training randomness and the DataLoader options every training loader shares: the map-style loaders of
:mod:`mlcls.data.loader`, the DALI loader (:mod:`mlcls.data.pipeline.dali`) and the shard loader
(:mod:`mlcls.data.shards.loader`) all import from here, and :mod:`mlcls.data.loader` dispatches to them.

Training randomness is a function of ``(seed, epoch, sample index)`` only: the sampler draws the epoch's
permutation from ``seed + epoch`` (``DistributedSampler``'s rule, also for a single process) and hands each
index to the dataset together with a per-sample seed, under which the sample's augmentation runs. Hence
the augmented batch at iteration *i* does not depend on the number of DataLoader workers, and a run resumed
in the middle of an epoch (``ResumableSampler.set_start``) sees exactly the batches it would have seen.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from mlcls.data.pipeline.fast import collate_batch

log = logging.getLogger("mlcls")

# Batches each DataLoader worker keeps ready (torch's default is 2): decoding times vary from image to image.
PREFETCH_FACTOR = 4

T = TypeVar("T")


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
    by ``seed``; the caller's random state is restored afterwards (it also runs in the main process).

    ``with_index``: each sample ``(image, target)`` comes as ``(image, target, index)``, ``index`` its
    position in the dataset (what a loss with a row per training sample needs, e.g. ROLE's label table).
    """

    def __init__(self, dataset: Dataset, with_index: bool = False) -> None:
        self.dataset, self.with_index = dataset, with_index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        sample = seeded_call(seed, self.dataset.__getitem__, index)
        return (*sample, index) if self.with_index else sample


def seeded_call(seed: int, function: Callable[..., T], *args: Any, torch_only: bool = False) -> T:
    """``function(*args)`` with torch/numpy/random seeded by ``seed``; the caller's random state is restored
    afterwards. How every training sample's augmentation runs (map-style and shard datasets).

    Only the CPU generator is seeded (the augmentation draws nothing on a device): ``torch.manual_seed``
    would also queue the seeding of every device generator, capturing a stack trace for each (~1 ms per
    sample, a quarter of the fast pipeline's time per image), and leave them changed.

    ``torch_only``: ``function`` draws from torch's CPU generator alone (the fast pipeline's CPU stage,
    ``FastTrainTransform.torch_random_only``), so Python's and NumPy's generators are left alone: neither
    seeded nor saved and restored (~0.1 ms a sample: NumPy copies its state out and in word by word).
    """
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


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (what a SLURM or cgroup allocation sets), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def loader_workers(requested: int) -> int:
    """``requested`` DataLoader workers (``trainer.workers``), at most :func:`available_cpus`.

    More workers than CPUs only compete for them (torch warns about it for every loader); the cap is
    logged once per process.
    """
    cpus = available_cpus()
    if requested <= cpus:
        return requested
    _log_worker_cap(requested, cpus)
    return cpus


def training_loader_options(workers: int, device: torch.device) -> dict[str, Any]:
    """The DataLoader options of a training loader of ``workers`` capped processes (:func:`loader_workers`)
    feeding ``device``: batches collated by :func:`mlcls.data.pipeline.fast.collate_batch`, pinned memory on
    CUDA,
    persistent workers each keeping ``PREFETCH_FACTOR`` batches ready."""
    workers = loader_workers(workers)
    return {
        "num_workers": workers,
        "pin_memory": device.type == "cuda",
        "collate_fn": collate_batch,
        "persistent_workers": workers > 0,
        "prefetch_factor": PREFETCH_FACTOR if workers > 0 else None,
    }


@functools.cache
def _log_worker_cap(requested: int, cpus: int) -> None:
    log.info("DataLoader workers capped at the %d CPUs this process may use (%d requested)", cpus, requested)
