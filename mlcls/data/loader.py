"""Where a batch is made, from the sampler to the device: the loader builders, :func:`collate_batch`, and
:class:`DevicePrefetcher` (training) and :class:`EvalBatches` (evaluation) handing each batch over on the
device, finished by :class:`DeviceStage` in a thread beside the step (:func:`beside_the_step`).
What a sample is lives in :mod:`mlcls.data.pipeline`, which shards a rank reads in
:mod:`mlcls.data.shards.loader`; those import nothing from here. The DALI, GPU-decoding and shards modules
are imported only where their backend is chosen: a sample or batch of theirs is known by what it does
(``collate``, ``on_device``, ``normalises_on_device``, ``shard_sizes``), not by its class.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from mlcls.data.datasets.base import DatasetConfigError
from mlcls.data.pipeline.fast import (
    AugmentedImage,
    ColourConstants,
    FastTrainTransform,
    colour_lighting_normalise,
    cuda_device,
    side_stream,
)
from mlcls.data.pipeline.transforms import IMAGENET_MEAN, IMAGENET_STD, normalisation
from mlcls.data.sampling import RankSampler, ResumableSampler, SeededSamples

log = logging.getLogger("mlcls")

# Batches each DataLoader worker keeps ready (torch's default is 2): decoding times vary from image to image.
PREFETCH_FACTOR = 4
# Batches the device stage makes ahead of the step at most: one handed over (queued), one in the making.
BATCHES_AHEAD = 2
# Seconds between two looks at the stop flag of a device stage waiting to hand a batch over.
STOP_POLL_S = 0.05


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


def collate_batch(batch: list[Any]) -> list[Any]:
    """The samples ``batch`` (each a tuple of fields: image, targets, ...) as one list of batched fields, as
    ``default_collate`` returns them: a field whose type has a ``collate`` of its own
    (:class:`AugmentedImage`, stacked in its channels-last memory; ``data.backend=gpu``'s ``EncodedImage``,
    whose files become one uint8 tensor) by it, any other by ``default_collate``. A sample of another type
    is one field."""
    if type(batch[0]) not in (tuple, list):
        return collate_field(batch)
    return [collate_field(list(field)) for field in zip(*batch, strict=True)]


def collate_field(values: list[Any]) -> Any:
    """``values``, one field of every sample, batched by their type's own ``collate``, else by
    ``default_collate``."""
    own = getattr(type(values[0]), "collate", None)
    return default_collate(values) if own is None else own(values)


def loader_options(
    workers: int, device: torch.device, prefetch: int | None = PREFETCH_FACTOR
) -> dict[str, Any]:
    """The DataLoader options of ``workers`` capped processes (:func:`loader_workers`) feeding ``device``:
    batches collated by :func:`collate_batch`, pinned memory on CUDA, persistent workers each keeping
    ``prefetch`` batches ready (None: torch's default). Each loader draws its workers' base seed from a
    generator of its own, never from torch's global one: an ``iter()`` after a resume would otherwise draw
    where the uninterrupted run did not, and shift every later draw of the step (dropout on the CPU). Every
    sample is seeded by its own (seed, epoch, index), so the base seed's value changes nothing."""
    workers = loader_workers(workers)
    return {
        "num_workers": workers,
        "pin_memory": device.type == "cuda",
        "collate_fn": collate_batch,
        "persistent_workers": workers > 0,
        "prefetch_factor": prefetch if workers > 0 else None,
        "generator": torch.Generator(),
    }


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
) -> Iterable:
    """The training loader of ``data.backend``: ``(images, targets)`` batches of ``batch_size`` samples per
    process drawn by a :class:`ResumableSampler` (its ``sampler``, with ``set_epoch(epoch)`` and
    ``set_start(samples)``), the incomplete last batch dropped; with ``dali`` a
    :class:`~mlcls.data.pipeline.dali.DaliTrainLoader` over a DataLoader of crop plans; for a
    :class:`~mlcls.data.shards.datasets.ShardTrainSet` (or its view) its
    :class:`~mlcls.data.shards.loader.ShardTrainLoader`. ``with_index``: each batch also
    holds the int64 (B,) positions of its samples in ``dataset`` (map-style datasets without DALI only)."""
    packed = hasattr(dataset, "shard_sizes")  # a ShardTrainSet, or its TrainingView: read in sequence
    if with_index and (packed or backend == "dali"):
        where = "dataset=shards" if packed else "data.backend=dali"
        raise DatasetConfigError(
            f"this loss keeps a row per training sample and needs each sample's index in the batch, which "
            f"{where} does not give; train it with data.backend=fast or torchvision on a map-style dataset"
        )
    options = loader_options(workers, device)
    if packed:
        from mlcls.data.shards.loader import ShardTrainLoader  # dataset=shards alone

        return ShardTrainLoader(dataset, batch_size, rank, world_size, seed, options, streams=workers)
    sampler = ResumableSampler(dataset, world_size, rank, seed)
    if backend == "dali":
        from mlcls.data.pipeline.dali import (  # data.backend=dali alone
            CropPlans,
            DaliTrainLoader,
            collate_plans,
        )

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
    if getattr(transform, "normalises_on_device", False):  # data.backend=gpu's GpuEvalTransform
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
        return beside_the_step(self.loader, self._finish, self.stage.device, self.stage.times)

    def _finish(self, batch: Sequence[Any]) -> tuple[Tensor, Tensor]:
        images, targets = batch
        return self.stage(images), targets


# ------------------------------------------------------------------ device
@dataclass
class StageTimes:
    """Host seconds of a device stage's batches: ``making_s`` in its thread (fetching from the loader and
    queueing the device work), ``waiting_s`` the consumer's (the main thread's) outside its steps, waiting
    for a finished batch and fetching it from a loader read in process, over ``batches`` handed over."""

    batches: int = 0
    making_s: float = 0.0
    waiting_s: float = 0.0


class DeviceStage:
    """Moves a batch to ``device`` and finishes it there: a float tensor is only copied; an ``EncodedBatch``
    is decoded there (:func:`~mlcls.data.pipeline.gpu.decode_on_device`), then, as an
    :class:`AugmentedImage` batch, goes through :func:`colour_lighting_normalise` with the
    :class:`ColourConstants` of ``mean`` and ``std``, made on ``device`` once (``colour=False``: none).
    Copies are ``non_blocking``; on CUDA nothing is read back to the host. ``times``: the host time of the
    batches it made beside a step (:class:`DevicePrefetcher`, :class:`EvalBatches`), summed over them."""

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
        self.times = StageTimes()

    def __call__(self, images: Tensor | AugmentedImage | Any) -> Tensor:
        """float32 (B, 3, H, W) on ``device``, normalised."""
        if hasattr(images, "on_device"):  # data.backend=gpu's EncodedBatch: its pixels made on the device
            images = images.on_device(self.device)
        if isinstance(images, AugmentedImage):
            # uint8 in the step's memory format: the colour stage's passes keep it, at a byte a value
            pixels = images.pixels.to(self.device, non_blocking=True)
            pixels = pixels.contiguous(memory_format=self.memory_format)
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
    """The batches of ``loader`` finished by ``stage`` (:meth:`DeviceStage.finish`) on ``stage.device``,
    made beside the step (:func:`beside_the_step`): images float32 (B, 3, H, W), normalised, targets
    float32 (B, C); ``len()`` and ``sampler`` the loader's; how long making them took adds to
    ``stage.times``."""

    def __init__(self, loader: Iterable, stage: DeviceStage) -> None:
        self.loader, self.stage, self.device = loader, stage, stage.device

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        return beside_the_step(self.loader, self.stage.finish, self.device, self.stage.times)


class _Failed(NamedTuple):
    error: BaseException


_END = object()  # no more batches


def _reads_in_process(loader: Iterable) -> bool:
    """Whether iterating ``loader`` runs its dataset in the calling process (a DataLoader without workers,
    or any other iterable): the dataset's seeded draws fork the process's random generators, so it is read
    in the consumer's thread, between steps, as without a device stage."""
    for inner in (loader, getattr(loader, "loader", None), getattr(loader, "plans", None)):
        if isinstance(inner, DataLoader):
            return inner.num_workers == 0
    return True


def _device_tensors(data: Any) -> Iterator[Tensor]:
    """The CUDA tensors of ``data``: a tensor, or tuples and lists of them (named or nested)."""
    if isinstance(data, Tensor):
        if data.is_cuda:
            yield data
    elif isinstance(data, (tuple, list)):
        for item in data:
            yield from _device_tensors(item)


def beside_the_step(
    loader: Iterable,
    finish: Callable[[Any], tuple],
    device: torch.device,
    times: StageTimes | None = None,
) -> Iterator[tuple]:
    """``finish(batch)`` for each batch of ``loader``, made by a thread of its own up to
    :data:`BATCHES_AHEAD` batches ahead of the consumer, while the consumer queues its steps.

    The thread fetches the batches from the loader (the consumer does, when the loader reads in this
    process: :func:`_reads_in_process`) and finishes them; on CUDA under the one :func:`side_stream`
    ``"stage"`` of ``device``. Each batch is handed over with an event recorded on that stream after its
    work: the consumer's current stream waits for the event, and the batch's device tensors are recorded on
    the consumer's stream (their memory is not given out again before the consumer's work on them has
    run). A batch the consumer fetched with device tensors goes the other way the same way (a DALI loader's
    copies run on the fetching thread's stream); one on the host needs no event, so the stage does not
    queue behind the steps. The thread starts batch j once the consumer's work on batch j - 3 has run (an
    event the consumer records when it asks for batch j - 2; the host waits for it, which the GPU has
    mostly done by then): the stage's batches held on the device are the one in the making, the one queued
    and the step's, however far the consumer's host runs ahead of its GPU. On the CPU the same thread runs
    without streams or events.

    An exception in the thread reaches the consumer as itself (the same type and message). Closing the
    generator (the consumer's loop ends, breaks or raises: a stop signal, Ctrl-C, an error) or exhausting
    it stops the thread and joins it: a thread blocked on handing a batch over sees the stop within
    :data:`STOP_POLL_S`; one fetching or finishing a batch ends that batch first."""
    times = StageTimes() if times is None else times
    batches, in_process = iter(loader), _reads_in_process(loader)
    stream = side_stream(cuda_device(device), "stage") if device.type == "cuda" else None
    consumer = None if stream is None else torch.cuda.current_stream(stream.device)
    finished: queue.Queue = queue.Queue(maxsize=BATCHES_AHEAD - 1)
    fetched: queue.Queue = queue.Queue()  # batches the consumer fetched (in-process loaders)
    released: queue.Queue = queue.Queue()  # the consumer's events after its work on each batch, in order
    stop = threading.Event()

    def hand_over(item: Any) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                finished.put(item, timeout=STOP_POLL_S)
                return True
        return False

    def wait_for_release() -> bool:  # already queued: the consumer took the batch before last
        while not stop.is_set():
            with contextlib.suppress(queue.Empty):
                event = released.get(timeout=STOP_POLL_S)
                if event is not None:
                    event.synchronize()
                return True
        return False

    def produce() -> None:
        source = iter(fetched.get, _END) if in_process else ((batch, None) for batch in batches)
        try:
            with contextlib.ExitStack() as on_stream:
                if stream is not None:  # a thread starts on device 0 with its default stream
                    on_stream.enter_context(torch.cuda.device(stream.device))
                    on_stream.enter_context(torch.cuda.stream(stream))
                for number in itertools.count():
                    if number > BATCHES_AHEAD and not wait_for_release():
                        return
                    start = time.perf_counter()
                    item = next(source, _END)
                    if item is _END:
                        break
                    batch, fetched_on = item
                    if fetched_on is not None:  # made on the consumer's stream
                        stream.wait_event(fetched_on)
                        for tensor in _device_tensors(batch):
                            tensor.record_stream(stream)
                    made = finish(batch)
                    event = None if stream is None else stream.record_event()
                    times.making_s += time.perf_counter() - start
                    if not hand_over((made, event)):
                        return
            hand_over(_END)
        except BaseException as error:  # handed to the consumer, which raises it
            hand_over(_Failed(error))

    if stream is not None:  # what the caller queued before (the stage's constants) comes first
        stream.wait_stream(consumer)
    thread = threading.Thread(target=produce, name="mlcls-device-stage", daemon=True)
    thread.start()
    requested, exhausted, handed = 0, not in_process, 0
    try:
        while True:
            if handed:  # the work queued on the batches handed over so far
                released.put(None if consumer is None else consumer.record_event())
            start = time.perf_counter()
            while not exhausted and requested < BATCHES_AHEAD:
                batch = next(batches, _END)
                exhausted, requested = batch is _END, requested + (batch is not _END)
                on_device = (
                    consumer is not None and not exhausted and next(_device_tensors(batch), None) is not None
                )
                ready = consumer.record_event() if on_device else None  # host batches need no ordering
                fetched.put(_END if exhausted else (batch, ready))
            item = finished.get()
            times.waiting_s += time.perf_counter() - start
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            (made, event), requested = item, requested - 1
            if event is not None:
                consumer.wait_event(event)
                for tensor in _device_tensors(made):
                    tensor.record_stream(consumer)
            times.batches, handed = times.batches + 1, handed + 1
            yield made
    finally:
        stop.set()
        fetched.put(_END)
        thread.join()


@functools.cache
def _log_once(message: str, *args: Any) -> None:
    """``log.info(message, *args)``, once per process for the same arguments."""
    log.info(message, *args)
