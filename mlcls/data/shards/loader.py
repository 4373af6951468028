"""Which samples of the training shards each rank and DataLoader worker reads every epoch
(:class:`ShardSchedule`), and the worker-side stream (:class:`ShardStream`).

A rank's range of samples is cut into ``streams`` (``trainer.workers``) contiguous blocks of whole batches,
each read front to back and shuffled in windows of ``shuffle_buffer`` samples drawn from the seed, the epoch
and the window's position. The rank's batch ``i`` is batch ``i // streams`` of block ``i % streams``: the
order depends on ``(seed, epoch, rank, world_size, streams)`` only, not on the worker processes the CPUs
allow, so a requeued job resumes exactly.

Workers: torch's DataLoader asks its workers for batches in turn from worker 0 (pinned by
``tests/test_data_shards.py``): worker ``w`` of ``W`` serves the rank's batches ``start + w``, ``start + w +
W``, ... and reads the blocks they come from (one worker a block when ``W`` divides ``streams``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mlcls.data.datasets.base import DatasetFormatError
from mlcls.data.sampling import sample_seed
from mlcls.data.shards.reader import iter_shard

log = logging.getLogger("mlcls")

Sample = tuple[str, dict[str, bytes]]  # (key, {extension: bytes}) of a shard sample


class ShardSchedule:
    """The ``sampler`` of :class:`ShardTrainLoader`: ``set_epoch(e)`` and
    ``set_start(samples)`` as :class:`mlcls.data.sampling.ResumableSampler`, the state in shared memory so
    that persistent DataLoader workers see it."""

    def __init__(
        self, shard_sizes: list[int], batch_size: int, rank: int, world_size: int, seed: int, streams: int = 1
    ) -> None:
        self.shard_sizes, self.batch_size = list(shard_sizes), batch_size
        self.rank, self.world_size, self.seed, self.streams = rank, world_size, seed, max(1, streams)
        self.per_rank = sum(shard_sizes) // (world_size * batch_size) * batch_size
        self.state = torch.zeros(2, dtype=torch.int64).share_memory_()  # epoch, start

    @property
    def epoch(self) -> int:
        return int(self.state[0])

    @property
    def start(self) -> int:
        return int(self.state[1])

    def set_epoch(self, epoch: int) -> None:
        self.state[0], self.state[1] = epoch, 0

    def set_start(self, start: int) -> None:
        self.state[1] = start

    def __len__(self) -> int:
        return self.per_rank - self.start

    def shard_order(self) -> list[int]:
        """This epoch's shard order (the same on every rank)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.shard_sizes), generator=generator).tolist()

    def stream_blocks(self) -> list[tuple[int, int]]:
        """``(first batch, batches)`` of each stream's block within the rank's range."""
        base, extra = divmod(self.per_rank // self.batch_size, self.streams)
        counts = [base + (stream < extra) for stream in range(self.streams)]
        firsts = itertools.accumulate([0, *counts[:-1]])
        return list(zip(firsts, counts, strict=True))

    def stream_reads(self, stream: int) -> tuple[list[tuple[int, int, int]], int]:
        """The reads of block ``stream``: ``(shard, first, stop)`` sample ranges in order, and the block's
        first position among the epoch's samples (where its shuffle windows start)."""
        first_batch, count = self.stream_blocks()[stream]
        begin = self.rank * self.per_rank + first_batch * self.batch_size
        end = begin + count * self.batch_size
        reads, offset = [], 0
        for shard in self.shard_order():
            size = self.shard_sizes[shard]
            lo, hi = max(begin, offset), min(end, offset + size)
            if lo < hi:
                reads.append((shard, lo - offset, hi - offset))
            offset += size
        return reads, begin

    def worker_batches(self, worker: int, workers: int) -> range:
        """The rank's batches that DataLoader worker ``worker`` of ``workers`` serves, in order (the
        loader takes one batch of each worker in turn, from worker 0, after the ``start`` samples served)."""
        return range(self.start // self.batch_size + worker, self.per_rank // self.batch_size, workers)


class ShardStream(IterableDataset):
    """The samples of one rank for one DataLoader worker (or the main process), as the schedule says, made by
    ``dataset`` (a :class:`~mlcls.data.shards.datasets.ShardTrainSet` or its training view)."""

    def __init__(self, dataset: Any, schedule: ShardSchedule) -> None:
        self.dataset, self.schedule = dataset, schedule

    def __iter__(self) -> Iterator[tuple[Any, Tensor]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        schedule = self.schedule
        blocks: dict[int, Iterator[list[Sample]]] = {}  # stream -> its batches, read on demand
        next_batch: dict[int, int] = {}
        for index in schedule.worker_batches(worker, workers):
            stream, batch = index % schedule.streams, index // schedule.streams
            if stream not in blocks:
                blocks[stream], next_batch[stream] = self._block_batches(stream), 0
            samples = next(itertools.islice(blocks[stream], batch - next_batch[stream], None))
            next_batch[stream] = batch + 1
            for key, fields in samples:
                yield self.dataset.make_sample(
                    key, fields, sample_seed(schedule.seed, schedule.epoch, int(key))
                )
        for batches in blocks.values():  # every shard read to its end: a pipe: command closed early fails
            for _ in batches:
                pass

    def _block_batches(self, stream: int) -> Iterator[list[Sample]]:
        """The batches of block ``stream``, in order: its samples shuffled window by window."""
        schedule = self.schedule
        reads, position = schedule.stream_reads(stream)
        batch: list[Sample] = []
        for window in self._windows(reads, self.dataset.shuffle_buffer):
            generator = torch.Generator().manual_seed(sample_seed(schedule.seed, schedule.epoch, position))
            for k in torch.randperm(len(window), generator=generator).tolist():
                batch.append(window[k])
                if len(batch) == schedule.batch_size:
                    yield batch
                    batch = []
            position += len(window)

    def _windows(self, reads: list[tuple[int, int, int]], size: int) -> Iterator[list[Sample]]:
        window: list[Sample] = []
        for shard, first, stop in reads:
            url = self.dataset.urls[shard]
            count = 0
            # Read to the end even past ``stop``: a pipe: command closed early fails. Each sample's labels
            # are checked here, where an error can name the shard and the member.
            for position, sample in enumerate(iter_shard(url, self.dataset.num_classes)):
                if first <= position < stop:
                    window.append(sample)
                    count += 1
                    if len(window) == size:
                        yield window
                        window = []
            if count != stop - first:
                raise DatasetFormatError(
                    f"shard {url} holds fewer samples than its manifest entry "
                    f"({self.dataset.shard_sizes[shard]})"
                )
        if window:
            yield window


class ShardTrainLoader:
    """The training loader of a :class:`~mlcls.data.shards.datasets.ShardTrainSet` or its view (what
    :func:`mlcls.data.loader.build_train_loader` builds for it): a DataLoader of ``options``
    (:func:`mlcls.data.loader.loader_options`) over its :class:`ShardStream`; ``sampler`` a
    :class:`ShardSchedule` of ``streams`` read streams (``trainer.workers``, before the CPU cap)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        options: dict[str, Any],
        streams: int = 1,
    ) -> None:
        self.batch_size = batch_size
        self.sampler = ShardSchedule(dataset.shard_sizes, batch_size, rank, world_size, seed, streams=streams)
        if options["num_workers"] and self.sampler.streams % options["num_workers"]:
            log.info(
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
