"""Samplers, DataLoaders and the device prefetcher for training and (distributed) evaluation.

The trainer and ``mlcls-eval`` build their loaders with :func:`build_train_loader` and
:func:`build_eval_loader` (the ``fast``/``torchvision`` DataLoader or the DALI loader, workers capped at the
CPUs this process may use, pinned memory and persistent workers on CUDA), and iterate the training loader
through :class:`DevicePrefetcher`, which hands each batch over on the device, finished by the
:class:`mlcls.data.fast.DeviceStage`, its copy overlapped with the previous step on CUDA.

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
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from mlcls.data.base import DatasetConfigError
from mlcls.data.fast import AugmentedImage, DeviceStage, FastTrainTransform, collate_batch

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
    by ``seed``; the caller's random state is restored afterwards (it also runs in the main process)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        return seeded_call(seed, self.dataset.__getitem__, index)


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
    feeding ``device``: batches collated by :func:`mlcls.data.fast.collate_batch`, pinned memory on CUDA,
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


class TrainBatches(Protocol):
    """What :func:`build_train_loader` returns: an iterable of ``(images, targets)`` batches with a length
    and a ``sampler`` with ``set_epoch(epoch)`` and ``set_start(samples)`` (a :class:`ResumableSampler`, or
    the ``ShardSchedule`` of packed shards)."""

    sampler: Any

    def __iter__(self) -> Iterator[tuple[Tensor | AugmentedImage, Tensor]]: ...

    def __len__(self) -> int: ...


def build_train_loader(
    dataset: Dataset,
    batch_size: int,
    workers: int,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    backend: str,
    dali_prefetch: int = 2,
) -> TrainBatches:
    """The training loader of ``data.backend``: ``batch_size`` samples per process, shuffled by a
    :class:`ResumableSampler` (``loader.sampler.set_epoch(epoch)`` every epoch, ``set_start(samples)`` to
    resume mid-epoch), the incomplete last batch dropped; ``len(loader)`` batches per epoch.

    ``backend`` ``"fast"`` or ``"torchvision"``: a DataLoader over the dataset's own transform, workers
    capped by :func:`loader_workers`, persistent and prefetching, pinned memory when ``device`` is CUDA.
    ``"dali"``: a :class:`mlcls.data.dali.DaliTrainLoader` (the dataset's transform must be the
    :class:`FastTrainTransform` that ``build_dataset(..., backend="dali")`` gives with
    ``dataset.transform=paper``), keeping ``dali_prefetch`` batches decoded ahead on the GPU.
    Batches come on the host (DALI: pixels on the GPU); :class:`DevicePrefetcher` finishes them.

    A :class:`mlcls.data.shards.ShardTrainSet` (``dataset=shards``; with ``dali`` the fast CPU stage
    decodes) gets its :class:`mlcls.data.shard_loader.ShardTrainLoader`: the same interface, its ``sampler`` a
    ``ShardSchedule``.
    """
    from mlcls.data.shard_loader import ShardTrainLoader
    from mlcls.data.shards import ShardTrainSet

    if isinstance(dataset, ShardTrainSet):
        return ShardTrainLoader(dataset, batch_size, workers, rank, world_size, seed, device)
    sampler = ResumableSampler(dataset, world_size, rank, seed)
    if backend == "dali":
        from mlcls.data.dali import DaliTrainLoader

        transform = getattr(dataset, "transform", None)
        if not isinstance(transform, FastTrainTransform):
            raise DatasetConfigError(
                "data.backend=dali does the paper's augmentation only; use dataset.transform=paper"
            )
        return DaliTrainLoader(
            dataset, batch_size, loader_workers(workers), sampler, transform, device, dali_prefetch
        )
    return DataLoader(
        SeededSamples(dataset),
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        **training_loader_options(workers, device),
    )


def build_eval_loader(
    dataset: Dataset, batch_size: int, workers: int, rank: int, world_size: int, device: torch.device
) -> DataLoader:
    """Ordered loader over this process's shard (see :class:`ShardSampler`), workers capped by
    :func:`loader_workers` and persistent (evaluation runs every ``trainer.eval_every`` epochs), pinned
    memory when ``device`` is CUDA."""
    workers = loader_workers(workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardSampler(len(dataset), rank, world_size),
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
    )


class DevicePrefetcher:
    """Iterates ``loader`` and yields ``(images, targets)`` on ``device``, ready for the model: images
    through ``device_stage`` (float32 (B, 3, H, W), normalised), targets float32 (B, C).

    On CUDA batch *i + 1* is fetched, copied and finished on a side stream while the caller's step *i* runs
    on the current stream (the current stream waits for the side stream's work before it receives a batch,
    and the yielded tensors are recorded on it so that their memory is not reused too early). On the CPU it
    applies the stage batch by batch, in order.

    ``len()`` and ``sampler`` are the loader's: ``for step, (images, targets) in enumerate(prefetcher)``
    replaces the loop over the loader.
    """

    def __init__(self, loader: Iterable, device_stage: DeviceStage, device: torch.device | str) -> None:
        self.loader, self.device_stage, self.device = loader, device_stage, torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def _finish(self, batch: tuple[Tensor | AugmentedImage, Tensor]) -> tuple[Tensor, Tensor]:
        images, targets = batch
        return self.device_stage(images), targets.to(self.device, non_blocking=True)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self.device.type != "cuda":
            yield from map(self._finish, self.loader)
            return
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        batches = iter(self.loader)

        def next_on_side_stream() -> tuple[Tensor, Tensor] | None:
            # Fetched under the side stream too: the DALI loader copies its output on the current stream.
            with torch.cuda.stream(side):
                batch = next(batches, None)
                return None if batch is None else self._finish(batch)

        ready = next_on_side_stream()
        while ready is not None:
            current.wait_stream(side)
            for tensor in ready:
                tensor.record_stream(current)
            upcoming = next_on_side_stream()  # enqueued before the caller's step: the two overlap
            yield ready
            ready = upcoming
