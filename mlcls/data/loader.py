"""The loaders of training and (distributed) evaluation, and the device prefetcher: where a batch comes
from and how it reaches the device.

The trainer and ``mlcls-eval`` build their loaders with :func:`build_train_loader` and
:func:`build_eval_loader` (the ``fast``/``torchvision`` DataLoader, the DALI loader or the shard loader,
workers capped at the CPUs this process may use, pinned memory and persistent workers on CUDA), and iterate
the training loader through :class:`DevicePrefetcher`, which hands each batch over on the device, finished
by the :class:`mlcls.data.pipeline.fast.DeviceStage`, its copy overlapped with the previous step on CUDA.

The imports run one way: this module chooses among the loaders; they share the samplers, the per-sample
seeds and the DataLoader options of :mod:`mlcls.data.sampling` (training randomness is a function of
``(seed, epoch, sample index)`` only, see there) and import nothing from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from mlcls.data.datasets.base import DatasetConfigError
from mlcls.data.pipeline.dali import DaliTrainLoader
from mlcls.data.pipeline.fast import AugmentedImage, DeviceStage, FastTrainTransform
from mlcls.data.sampling import ResumableSampler, SeededSamples, loader_workers, training_loader_options
from mlcls.data.shards.datasets import ShardTrainSet
from mlcls.data.shards.loader import ShardTrainLoader


class ShardSampler(Sampler[int]):
    """Evaluation sampler: rank ``r`` of ``W`` takes indices ``r, r + W, r + 2W, ...``, without padding.

    Unlike ``DistributedSampler`` it never repeats a sample, so shards differ in length by at most one and
    :func:`mlcls.distributed.gather_rank_parts` restores dataset order exactly.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


class TrainBatches(Protocol):
    """What :func:`build_train_loader` returns: an iterable of ``(images, targets)`` batches (``(images,
    targets, indices)`` when built ``with_index``) with a length and a ``sampler`` with ``set_epoch(epoch)``
    and ``set_start(samples)`` (a :class:`ResumableSampler`, or
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
    with_index: bool = False,
) -> TrainBatches:
    """The training loader of ``data.backend``: ``batch_size`` samples per process, shuffled by a
    :class:`ResumableSampler` (``loader.sampler.set_epoch(epoch)`` every epoch, ``set_start(samples)`` to
    resume mid-epoch), the incomplete last batch dropped; ``len(loader)`` batches per epoch.

    ``backend`` ``"fast"`` or ``"torchvision"``: a DataLoader over the dataset's own transform, workers
    capped by :func:`loader_workers`, persistent and prefetching, pinned memory when ``device`` is CUDA.
    ``"dali"``: a :class:`mlcls.data.pipeline.dali.DaliTrainLoader` (the dataset's transform must be the
    :class:`FastTrainTransform` that ``build_dataset(..., backend="dali")`` gives with
    ``dataset.transform=paper``), keeping ``dali_prefetch`` batches decoded ahead on the GPU.
    Batches come on the host (DALI: pixels on the GPU); :class:`DevicePrefetcher` finishes them.

    A :class:`mlcls.data.shards.datasets.ShardTrainSet` (``dataset=shards``; with ``dali`` the fast CPU stage
    decodes) gets its :class:`mlcls.data.shards.loader.ShardTrainLoader`: the same interface, its ``sampler``
    a ``ShardSchedule``.

    ``with_index``: each batch also holds the int64 (B,) positions of its samples in ``dataset``, as its
    third element (the ``fast`` and ``torchvision`` backends over a map-style dataset; the shard and DALI
    loaders are refused with one line).
    """
    if with_index and (isinstance(dataset, ShardTrainSet) or backend == "dali"):
        where = "dataset=shards" if isinstance(dataset, ShardTrainSet) else "data.backend=dali"
        raise DatasetConfigError(
            f"this loss keeps a row per training sample and needs each sample's index in the batch, which "
            f"{where} does not give; train it with data.backend=fast or torchvision on a map-style dataset"
        )
    if isinstance(dataset, ShardTrainSet):
        return ShardTrainLoader(dataset, batch_size, workers, rank, world_size, seed, device)
    sampler = ResumableSampler(dataset, world_size, rank, seed)
    if backend == "dali":
        transform = getattr(dataset, "transform", None)
        if not isinstance(transform, FastTrainTransform):
            raise DatasetConfigError(
                "data.backend=dali does the paper's augmentation only; use dataset.transform=paper"
            )
        return DaliTrainLoader(
            dataset, batch_size, loader_workers(workers), sampler, transform, device, dali_prefetch
        )
    return DataLoader(
        SeededSamples(dataset, with_index),
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
    through ``device_stage`` (float32 (B, 3, H, W), normalised), targets float32 (B, C); a batch's further
    tensors (the sample indices of a loader built ``with_index``) are moved as they are.

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

    def _finish(self, batch: tuple[Any, ...]) -> tuple[Tensor, ...]:
        """``(images, targets, ...)`` of the loader -> the same on the device, images finished."""
        images, *rest = batch
        return self.device_stage(images), *(tensor.to(self.device, non_blocking=True) for tensor in rest)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        if self.device.type != "cuda":
            yield from map(self._finish, self.loader)
            return
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        batches = iter(self.loader)

        def next_on_side_stream() -> tuple[Tensor, ...] | None:
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
