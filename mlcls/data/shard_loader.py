"""Reading packed training shards: which samples each rank and DataLoader worker reads every epoch
(:class:`ShardSchedule`), the worker-side stream (:class:`ShardStream`) and the loader the trainer iterates
(:class:`ShardTrainLoader`). The shard files themselves and the datasets are in :mod:`mlcls.data.shards`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mlcls.data.base import (
    DatasetFormatError,
)
from mlcls.data.loader import sample_seed, training_loader_options
from mlcls.data.shards import ShardTrainSet, iter_shard


class ShardSchedule:
    """The ``sampler`` of :class:`ShardTrainLoader`: which samples of the shards each rank and worker
    reads in an epoch (see the module docstring). ``set_epoch(e)`` and ``set_start(samples)`` as
    :class:`mlcls.data.loader.ResumableSampler`; the state lives in shared memory, so that persistent
    DataLoader workers see it."""

    def __init__(
        self, shard_sizes: list[int], batch_size: int, rank: int, world_size: int, seed: int
    ) -> None:
        self.shard_sizes, self.batch_size = list(shard_sizes), batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
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

    def worker_blocks(self, workers: int) -> list[tuple[int, int]]:
        """``(first batch, batches)`` of each worker within the rank's range."""
        batches = self.per_rank // self.batch_size
        base, extra = divmod(batches, workers)
        blocks, first = [], 0
        for worker in range(workers):
            count = base + (worker < extra)
            blocks.append((first, count))
            first += count
        return blocks

    def consumed(self, worker: int, workers: int, batches: int) -> int:
        """Batches of ``worker`` among the first ``batches`` the DataLoader served (it takes one batch of
        each worker in turn; the workers with one batch more come first)."""
        count = self.worker_blocks(workers)[worker][1]
        return min(count, batches // workers + (worker < batches % workers))

    def reads(self, worker: int, workers: int) -> tuple[list[tuple[int, int, int]], int]:
        """The reads of ``worker``: ``(shard, first, stop)`` sample ranges in order, and the number of its
        samples the DataLoader already served (to skip, after the window shuffle)."""
        first_batch, count = self.worker_blocks(workers)[worker]
        begin = self.rank * self.per_rank + first_batch * self.batch_size
        end = begin + count * self.batch_size
        reads, offset = [], 0
        for shard in self.shard_order():
            size = self.shard_sizes[shard]
            lo, hi = max(begin, offset), min(end, offset + size)
            if lo < hi:
                reads.append((shard, lo - offset, hi - offset))
            offset += size
        served = self.consumed(worker, workers, self.start // self.batch_size) * self.batch_size
        return reads, served


class ShardStream(IterableDataset):
    """The samples of one rank for one DataLoader worker (or the main process), as the schedule says."""

    def __init__(self, dataset: ShardTrainSet, schedule: ShardSchedule) -> None:
        self.dataset, self.schedule = dataset, schedule

    def __iter__(self) -> Iterator[tuple[Any, Tensor]]:
        info = get_worker_info()
        schedule, window_size = self.schedule, self.dataset.shuffle_buffer
        workers = 1 if info is None else info.num_workers
        # The DataLoader starts every iteration at its worker 0: after k batches served, that is the worker
        # whose turn came next, k mod workers.
        worker = 0 if info is None else (info.id + schedule.start // schedule.batch_size) % workers
        reads, served = schedule.reads(worker, workers)
        position = 0  # samples of this worker's list before the window
        for window in self._windows(reads, window_size):
            generator = torch.Generator().manual_seed(
                sample_seed(schedule.seed, schedule.epoch, schedule.rank * schedule.per_rank + position)
            )
            for k in torch.randperm(len(window), generator=generator).tolist():
                if served > 0:
                    served -= 1
                    continue
                key, fields = window[k]
                yield self.dataset.make_sample(
                    key, fields, sample_seed(schedule.seed, schedule.epoch, int(key))
                )
            position += len(window)

    def _windows(
        self, reads: list[tuple[int, int, int]], size: int
    ) -> Iterator[list[tuple[str, dict[str, bytes]]]]:
        window: list[tuple[str, dict[str, bytes]]] = []
        for shard, first, stop in reads:
            url = self.dataset.urls[shard]
            count = 0
            # Read to the end even past ``stop``: a pipe: command closed early fails.
            for position, sample in enumerate(iter_shard(url)):
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
    """The training loader of a :class:`ShardTrainSet` (what ``build_train_loader`` returns for one):
    ``len()`` batches of ``batch_size`` per epoch, ``sampler`` a :class:`ShardSchedule`; batches as the
    map-style loader's (collated by :func:`mlcls.data.fast.collate_batch`)."""

    def __init__(
        self,
        dataset: ShardTrainSet,
        batch_size: int,
        workers: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.batch_size = batch_size
        self.sampler = ShardSchedule(dataset.shard_sizes, batch_size, rank, world_size, seed)
        self.loader = DataLoader(
            ShardStream(dataset, self.sampler),
            batch_size=batch_size,
            **training_loader_options(workers, device),
        )

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)
