"""Where a batch is made, from the sampler to the device: the loader builders, :func:`collate_batch`, and
:class:`DevicePrefetcher` handing each training batch over on the device, finished by :class:`DeviceStage`.
What a sample is lives in :mod:`mlcls.data.pipeline`, which shards a rank reads in
:mod:`mlcls.data.shards.loader`; those import nothing from here.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, get_worker_info
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from mlcls.data.datasets.base import DatasetConfigError
from mlcls.data.pipeline.dali import CropPlans, DaliTrainLoader, collate_plans
from mlcls.data.pipeline.fast import (
    AugmentedImage,
    ColourConstants,
    FastTrainTransform,
    colour_lighting_normalise,
)
from mlcls.data.pipeline.gpu import SIZE, EncodedBatch, EncodedImage, GpuEvalTransform, decode_on_device
from mlcls.data.pipeline.transforms import IMAGENET_MEAN, IMAGENET_STD, normalisation
from mlcls.data.sampling import RankSampler, ResumableSampler, SeededSamples
from mlcls.data.shards.datasets import ShardTrainSet
from mlcls.data.shards.loader import ShardSchedule, ShardStream

log = logging.getLogger("mlcls")

# Batches each DataLoader worker keeps ready (torch's default is 2): decoding times vary from image to image.
PREFETCH_FACTOR = 4


# ------------------------------------------------------------------ DataLoaders
def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (what a SLURM or cgroup allocation sets), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def loader_workers(requested: int) -> int:
    """``requested`` DataLoader workers (``trainer.workers``), at most :func:`available_cpus`: more only
    compete for them. The cap is logged once per process."""
    cpus = available_cpus()
    if requested <= cpus:
        return requested
    _log_once("DataLoader workers capped at the %d CPUs this process may use (%d requested)", cpus, requested)
    return cpus


def _collate_augmented(batch: list[AugmentedImage], *, collate_fn_map: dict | None = None) -> AugmentedImage:
    pixels = collate_tensor_fn([image.pixels.permute(1, 2, 0) for image in batch]).permute(0, 3, 1, 2)
    return AugmentedImage(pixels, collate_tensor_fn([image.params for image in batch]))


def _collate_encoded(batch: list[EncodedImage], *, collate_fn_map: dict | None = None) -> EncodedBatch:
    lengths = np.array([len(sample.data) for sample in batch], dtype=np.int64)
    encoded = torch.empty(int(lengths.sum()), dtype=torch.uint8)
    if get_worker_info() is not None and len(encoded):  # in shared memory, as collate_tensor_fn does
        encoded = encoded.new(encoded._typed_storage()._new_shared(len(encoded), device="cpu"))
    files, position = encoded.numpy(), 0
    for sample in batch:
        files[position : position + len(sample.data)] = np.frombuffer(sample.data, dtype=np.uint8)
        position += len(sample.data)
    decoded = [sample.pixels.permute(1, 2, 0) for sample in batch if sample.pixels is not None]
    size = int(batch[0].geometry[SIZE])
    stacked = collate_tensor_fn(decoded) if decoded else torch.empty(0, size, size, 3, dtype=torch.uint8)
    params = collate_tensor_fn([sample.params for sample in batch])
    geometry = np.stack([sample.geometry for sample in batch])
    return EncodedBatch(encoded, lengths, geometry, stacked.permute(0, 3, 1, 2), params)


_COLLATE_FNS = {**default_collate_fn_map, AugmentedImage: _collate_augmented, EncodedImage: _collate_encoded}


def collate_batch(batch: list[Any]) -> Any:
    """``default_collate`` that stacks :class:`AugmentedImage` pixels in their channels-last memory (not
    transposed: ~10x faster) and ``data.backend=gpu``'s files in one uint8 tensor (:class:`EncodedBatch`)."""
    return collate(batch, collate_fn_map=_COLLATE_FNS)


def loader_options(
    workers: int, device: torch.device, prefetch: int | None = PREFETCH_FACTOR
) -> dict[str, Any]:
    """The DataLoader options of ``workers`` capped processes (:func:`loader_workers`) feeding ``device``:
    batches collated by :func:`collate_batch`, pinned memory on CUDA, persistent workers each keeping
    ``prefetch`` batches ready (None: torch's default)."""
    workers = loader_workers(workers)
    return {
        "num_workers": workers,
        "pin_memory": device.type == "cuda",
        "collate_fn": collate_batch,
        "persistent_workers": workers > 0,
        "prefetch_factor": prefetch if workers > 0 else None,
    }


class ShardTrainLoader:
    """The training loader of a :class:`ShardTrainSet` or its view: a DataLoader over its ``ShardStream``;
    ``sampler`` a ``ShardSchedule`` of ``workers`` streams (``trainer.workers``, before the CPU cap)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        workers: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.batch_size = batch_size
        self.sampler = ShardSchedule(dataset.shard_sizes, batch_size, rank, world_size, seed, streams=workers)
        options = loader_options(workers, device)
        if options["num_workers"] and self.sampler.streams % options["num_workers"]:
            _log_once(
                "dataset=shards: %d DataLoader workers share %d read streams (trainer.workers); each reads "
                "the shards of several streams (the sample order is the same)",
                options["num_workers"],
                self.sampler.streams,
            )
        self.loader = DataLoader(ShardStream(dataset, self.sampler), batch_size=batch_size, **options)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def build_train_loader(
    dataset: Dataset,
    batch_size: int,
    workers: int,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    backend: str,
    with_index: bool = False,
) -> DataLoader | DaliTrainLoader | ShardTrainLoader:
    """The training loader of ``data.backend``: ``(images, targets)`` batches of ``batch_size`` samples per
    process drawn by a :class:`ResumableSampler` (its ``sampler``, with ``set_epoch(epoch)`` and
    ``set_start(samples)``), the incomplete last batch dropped; with ``dali`` a
    :class:`~mlcls.data.pipeline.dali.DaliTrainLoader` over a DataLoader of crop plans; for a
    :class:`ShardTrainSet` (or its view) its :class:`ShardTrainLoader`. ``with_index``: each batch also
    holds the int64 (B,) positions of its samples in ``dataset`` (map-style datasets without DALI only)."""
    packed = isinstance(getattr(dataset, "source", dataset), ShardTrainSet)  # the shards, or their view
    if with_index and (packed or backend == "dali"):
        where = "dataset=shards" if packed else "data.backend=dali"
        raise DatasetConfigError(
            f"this loss keeps a row per training sample and needs each sample's index in the batch, which "
            f"{where} does not give; train it with data.backend=fast or torchvision on a map-style dataset"
        )
    if packed:
        return ShardTrainLoader(dataset, batch_size, workers, rank, world_size, seed, device)
    sampler = ResumableSampler(dataset, world_size, rank, seed)
    options = loader_options(workers, device)
    if backend == "dali":
        transform = getattr(dataset, "transform", None)
        if not isinstance(transform, FastTrainTransform):
            raise DatasetConfigError(
                "data.backend=dali does the paper's augmentation only; use dataset.transform=paper"
            )
        plans = SeededSamples(CropPlans(dataset, transform))
        options.update(pin_memory=False, collate_fn=collate_plans)  # the graph reads the plans on the host
        plan_loader = DataLoader(plans, batch_size=batch_size, sampler=sampler, drop_last=True, **options)
        return DaliTrainLoader(plan_loader, transform.size, device)
    return DataLoader(
        SeededSamples(dataset, with_index), batch_size=batch_size, sampler=sampler, drop_last=True, **options
    )


def build_eval_loader(
    dataset: Dataset,
    batch_size: int,
    workers: int,
    rank: int,
    world_size: int,
    device: torch.device,
    channels_last: bool = False,
) -> EvalBatches:
    """Ordered loader over this rank's share (:class:`RankSampler`) with :func:`loader_options` (persistent
    workers: evaluation runs every ``trainer.eval_every`` epochs), its images on ``device``
    (:class:`EvalBatches`; decoded and normalised there with ``data.backend=gpu``'s evaluation transform)."""
    sampler = RankSampler(len(dataset), rank, world_size)
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, **loader_options(workers, device, None)
    )
    while isinstance(dataset, Subset):  # trainer.limit_val_batches
        dataset = dataset.dataset
    transform = getattr(dataset, "transform", None)
    if isinstance(transform, GpuEvalTransform):
        return EvalBatches(loader, DeviceStage(device, channels_last, mean=transform.mean, std=transform.std))
    return EvalBatches(loader, DeviceStage(device, channels_last, colour=False))


class EvalBatches:
    """The batches ``(images, targets)`` of an evaluation ``loader``, the images finished on the device by
    ``stage``, the targets as loaded; ``dataset`` and ``len()`` the loader's."""

    def __init__(self, loader: DataLoader, stage: DeviceStage) -> None:
        self.loader, self.stage, self.dataset = loader, stage, loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for images, targets in self.loader:
            yield self.stage(images), targets


# ------------------------------------------------------------------ device
class DeviceStage:
    """Moves a batch to ``device`` and finishes it there: a float tensor is only copied; an ``EncodedBatch``
    is decoded there (:func:`~mlcls.data.pipeline.gpu.decode_on_device`), then, as an
    :class:`AugmentedImage` batch, goes through :func:`colour_lighting_normalise` with the
    :class:`ColourConstants` of ``mean`` and ``std``, made on ``device`` once (``colour=False``: none).
    Copies are ``non_blocking``; on CUDA nothing is read back to the host."""

    def __init__(
        self,
        device: torch.device | str,
        channels_last: bool = False,
        *,
        mean: Sequence[float] | None = IMAGENET_MEAN,
        std: Sequence[float] | None = IMAGENET_STD,
        batched: bool | None = None,
        colour: bool = True,
    ) -> None:
        self.device, self.batched = torch.device(device), batched
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        mean, std = normalisation(mean, std)
        self.constants = ColourConstants.on(self.device, mean, std) if colour else None

    def __call__(self, images: Tensor | AugmentedImage | EncodedBatch) -> Tensor:
        """float32 (B, 3, H, W) on ``device``, normalised."""
        if isinstance(images, EncodedBatch):  # its pixels made on the device
            images = AugmentedImage(decode_on_device(images, self.device), images.params)
        if isinstance(images, AugmentedImage):
            pixels = images.pixels.to(self.device, non_blocking=True)
            params = images.params.to(self.device, non_blocking=True)
            images = colour_lighting_normalise(pixels, params, self.constants, self.batched)
        else:
            images = images.to(self.device, non_blocking=True)
        return images.contiguous(memory_format=self.memory_format)

    def finish(self, batch: Sequence[Any]) -> tuple[Tensor, ...]:
        """``(images, targets, ...)`` of a loader -> the same on the device, images finished, the further
        tensors (targets, the sample indices of a loader built ``with_index``) moved as they are."""
        images, *rest = batch
        return self(images), *(tensor.to(self.device, non_blocking=True) for tensor in rest)


class DevicePrefetcher:
    """The batches of ``loader`` finished by ``stage`` (:meth:`DeviceStage.finish`) on ``stage.device``:
    images float32 (B, 3, H, W), normalised, targets float32 (B, C); ``len()`` and ``sampler`` the loader's.
    On CUDA batch *i + 1* is fetched, copied and finished on a side stream while the caller's step *i* runs
    on the current stream (which waits for the side stream; the yielded tensors are recorded on it so that
    their memory is not reused too early)."""

    def __init__(self, loader: Iterable, stage: DeviceStage) -> None:
        self.loader, self.stage, self.device = loader, stage, stage.device

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        if self.device.type != "cuda":
            yield from map(self.stage.finish, self.loader)
            return
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        batches = iter(self.loader)

        def next_on_side_stream() -> tuple[Tensor, ...] | None:
            # Fetched under the side stream too: the DALI loader copies its output on the current stream.
            with torch.cuda.stream(side):
                batch = next(batches, None)
                return None if batch is None else self.stage.finish(batch)

        ready = next_on_side_stream()
        while ready is not None:
            current.wait_stream(side)
            for tensor in ready:
                tensor.record_stream(current)
            upcoming = next_on_side_stream()  # enqueued before the caller's step: the two overlap
            yield ready
            ready = upcoming


@functools.cache
def _log_once(message: str, *args: Any) -> None:
    """``log.info(message, *args)``, once per process for the same arguments."""
    log.info(message, *args)
