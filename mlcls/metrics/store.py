"""Where an evaluation's outputs wait for their metrics: the logits and labels of every sample, fed in
batches of rows in dataset order and read back by blocks of classes, while the figures that need whole rows
(the AP of each sample, the top-k predictions) are computed as the rows arrive.

Two stores share one interface, so one piece of code computes every figure from either:

* :class:`MemoryStore` holds the (N, C) tensors: a small evaluation, or tensors already gathered;
* :class:`DiskStore` writes class-blocked files in a temporary folder: the classes are cut into blocks of
  ``width`` columns and each block's (N, width) float32 scores and int8 labels lie contiguous, so a block is
  one read. Its memory is the row buffer and one block, not N x C (50,000 x 75,000 float32 logits are
  15 GB); the scores are the model's float32 logits exactly, so every figure equals the in-memory one.

:class:`Storage` chooses by size (``metrics.in_memory_gb``). Rows reach a store in batches
(:meth:`OutputStore.append`); they are buffered on their device and moved to the host together, about
:data:`FLUSH_ELEMENTS` scores at a time, so a GPU evaluation waits once per flush, not per batch.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlcls.errors import ConfigError, shown
from mlcls.metrics.ap import block_slices
from mlcls.metrics.checks import check_scores_labels

# Scores buffered before they move to the host and the store: 32M float32 scores and their labels, 160 MB.
FLUSH_ELEMENTS = 1 << 25
# Above this many GB of scores and labels (5 bytes an entry), Storage writes them to disk.
IN_MEMORY_GB = 2.0

RowsHook = Callable[[torch.Tensor, torch.Tensor], None]
ScoresCheck = Callable[[torch.Tensor, int], object]


class OutputStore:
    """The logits (N, C) and int8 labels (N, C) of an evaluation set, written by :meth:`append` in row
    order and read by :meth:`column_blocks`. ``on_rows(scores, labels)`` sees every row once, in blocks of
    rows (:func:`block_slices`), validated; ``check(scores, n_rows)`` sees each flushed part first (e.g.
    :func:`mlcls.metrics.thresholds.check_model_scores`)."""

    def __init__(
        self, n_rows: int, n_classes: int, on_rows: RowsHook | None = None, check: ScoresCheck | None = None
    ) -> None:
        self.n_rows, self.n_classes = n_rows, n_classes
        self.on_rows, self.check = on_rows, check
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0
        self.rows_written = 0

    def append(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        """Rows ``scores`` (b, C) and ``labels`` (b, C) in {1, 0, -1}, the next ones in dataset order."""
        if scores.dim() != 2 or scores.shape[1] != self.n_classes:
            raise ValueError(f"scores {tuple(scores.shape)} for a store of {self.n_classes} classes")
        self._pending.append((scores.detach(), labels))
        self._pending_rows += len(scores)
        if self._pending_rows * self.n_classes >= FLUSH_ELEMENTS:
            self._flush()

    def finish(self) -> OutputStore:
        """Write what is buffered; ``ValueError`` unless exactly ``n_rows`` rows came. Returns the store."""
        self._flush()
        if self.rows_written != self.n_rows:
            raise ValueError(f"{self.rows_written} rows of outputs for {self.n_rows} samples")
        return self

    def _flush(self) -> None:
        if not self._pending:
            return
        scores = torch.cat([s for s, _ in self._pending]).cpu()
        labels = torch.cat([lab.to(torch.int8) for _, lab in self._pending]).cpu()
        self._pending, self._pending_rows = [], 0
        if self.rows_written + len(scores) > self.n_rows:
            raise ValueError(f"more than {self.n_rows} rows of outputs")
        self._rows_arrived(scores, labels)
        self._write(self.rows_written, scores, labels)
        self.rows_written += len(scores)

    def _rows_arrived(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Validate rows and show them to ``on_rows``; returns the labels as int8."""
        if self.check is not None:
            self.check(scores, self.n_rows)
        labels = check_scores_labels(scores, labels)
        if self.on_rows is not None:
            for rows in block_slices(*scores.shape):
                self.on_rows(scores[rows], labels[rows])
        return labels

    def _write(self, start: int, scores: torch.Tensor, labels: torch.Tensor) -> None:
        raise NotImplementedError

    def column_blocks(
        self, rows: torch.Tensor | None = None
    ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """``(classes, scores, labels)`` for consecutive blocks of classes covering all C: the (n, w)
        scores and int8 labels of the classes ``classes`` (a slice) on the rows ``rows`` (int64 indices,
        None: all N), each block about :data:`mlcls.metrics.ap.BLOCK_ELEMENTS` scores."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the store holds (its files); it cannot be read afterwards."""


class MemoryStore(OutputStore):
    """The outputs as (N, C) tensors (:attr:`scores` keeps its dtype and device when given whole)."""

    def __init__(
        self, n_rows: int, n_classes: int, on_rows: RowsHook | None = None, check: ScoresCheck | None = None
    ) -> None:
        super().__init__(n_rows, n_classes, on_rows, check)
        self.scores = torch.empty(n_rows, n_classes)
        self.labels = torch.empty(n_rows, n_classes, dtype=torch.int8)

    @classmethod
    def of(
        cls,
        scores: torch.Tensor,
        labels: torch.Tensor,
        on_rows: RowsHook | None = None,
        check: ScoresCheck | None = None,
    ) -> MemoryStore:
        """The store of whole tensors ``scores`` (N, C) and ``labels`` (N, C), used as they are (no copy
        but int8 labels), their rows shown to ``on_rows`` at once."""
        store = cls.__new__(cls)
        OutputStore.__init__(store, len(scores), scores.shape[1] if scores.dim() == 2 else 0, on_rows, check)
        store.scores = scores.detach()
        store.labels = store._rows_arrived(store.scores, labels)
        store.rows_written = len(scores)
        return store

    def _write(self, start: int, scores: torch.Tensor, labels: torch.Tensor) -> None:
        self.scores[start : start + len(scores)] = scores
        self.labels[start : start + len(scores)] = labels

    def column_blocks(self, rows=None):
        n_rows = self.n_rows if rows is None else len(rows)
        for classes in block_slices(self.n_classes, n_rows):
            scores, labels = self.scores[:, classes], self.labels[:, classes]
            if rows is not None:
                scores, labels = scores[rows.to(scores.device)], labels[rows.to(labels.device)]
            yield classes, scores, labels


class DiskStore(OutputStore):
    """The outputs in two class-blocked files (float32 scores, int8 labels) of a temporary folder made in
    ``folder`` (None: the system's temporary folder), removed by :meth:`close` or when the store is
    collected. Block ``b`` holds classes ``[b w, (b + 1) w)`` (``w`` = :attr:`width`), row-major (N, w), at
    element offset ``b w N``: rows arrive as whole rows and are written to every block."""

    def __init__(
        self,
        n_rows: int,
        n_classes: int,
        on_rows: RowsHook | None = None,
        check: ScoresCheck | None = None,
        folder: str | Path | None = None,
    ) -> None:
        super().__init__(n_rows, n_classes, on_rows, check)
        self.width = next(block_slices(n_classes, n_rows)).stop or 1
        self._folder = tempfile.TemporaryDirectory(prefix="mlcls-eval-", dir=folder)
        self._cleanup = weakref.finalize(self, self._folder.cleanup)
        root = Path(self._folder.name)
        self._files = {np.dtype(np.float32): root / "scores.f32", np.dtype(np.int8): root / "labels.i8"}
        for dtype, path in self._files.items():
            with open(path, "wb") as file:
                file.truncate(n_rows * n_classes * dtype.itemsize)

    def _write(self, start: int, scores: torch.Tensor, labels: torch.Tensor) -> None:
        for values in (scores.float().numpy(), labels.numpy()):
            size = values.dtype.itemsize
            fd = os.open(self._files[values.dtype], os.O_WRONLY)
            try:
                for first in range(0, self.n_classes, self.width):
                    part = np.ascontiguousarray(values[:, first : first + self.width])
                    offset = (first * self.n_rows + start * part.shape[1]) * size
                    _write_all(fd, memoryview(part).cast("B"), offset)
            finally:
                os.close(fd)

    def column_blocks(self, rows=None):
        for first in range(0, self.n_classes, self.width):
            width = min(self.width, self.n_classes - first)
            parts = []
            for dtype, path in self._files.items():
                offset = first * self.n_rows * dtype.itemsize
                values = np.fromfile(path, dtype, self.n_rows * width, offset=offset)
                block = torch.from_numpy(values.reshape(self.n_rows, width))
                parts.append(block if rows is None else block[rows])
            yield slice(first, first + width), parts[0], parts[1]

    def close(self) -> None:
        self._cleanup()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` of the file ``fd`` (``os.pwrite`` may write part of it)."""
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


@dataclass(frozen=True)
class Storage:
    """Where a single process's evaluation keeps its outputs (``metrics.in_memory_gb``,
    ``metrics.scratch_dir``): in memory while they take at most ``in_memory_gb`` (5 bytes an entry: float32
    score, int8 label), else on disk in a temporary folder made in ``folder`` (None: the system's, TMPDIR)."""

    in_memory_gb: float = IN_MEMORY_GB
    folder: str | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.in_memory_gb, bool)
            or not isinstance(self.in_memory_gb, (int, float))
            or not (self.in_memory_gb >= 0)
        ):
            raise ConfigError(
                f"metrics.in_memory_gb={shown(self.in_memory_gb)}; expected a number of GB >= 0"
            )

    @classmethod
    def of(cls, metrics: Any) -> Storage:
        """The storage a config's ``metrics`` group chooses (None, or a key left out: the default)."""
        metrics = metrics or {}
        return cls(metrics.get("in_memory_gb", IN_MEMORY_GB), metrics.get("scratch_dir"))

    def open(
        self, n_rows: int, n_classes: int, on_rows: RowsHook | None = None, check: ScoresCheck | None = None
    ) -> OutputStore:
        """An empty store for ``n_rows`` x ``n_classes`` outputs: a :class:`MemoryStore` or a
        :class:`DiskStore`, by size."""
        if n_rows * n_classes * 5 <= self.in_memory_gb * 1e9:
            return MemoryStore(n_rows, n_classes, on_rows, check)
        return DiskStore(n_rows, n_classes, on_rows, check, self.folder)


DEFAULT_STORAGE = Storage()
