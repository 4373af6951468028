"""The held-out selection split: a share of the training split kept out of training to select the best
epoch (``dataset.holdout_fraction``), as the single-positive benchmark's released code holds out 20 %.

:func:`split_holdout` cuts a training split into two :class:`SplitRows` views, the samples that train and
the samples held out (:meth:`HoldoutSplit.held_out`: a pure function of ``dataset.holdout_seed`` and the
sample index, the same on every rank). Both read the training split's images and labels by its own sample
index: the observed-label regime shows each training sample the labels it shows it without the cut, and a
loss with a row per training sample indexes the training view's rows ``0 .. len - 1``. The held-out view
reads its images with the evaluation transform; its targets are the full labels (``clean``) or the
regime's observed labels (``observed``, unknown entries -1, which the metrics leave out).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Subset

from mlcls.data.datasets.base import DatasetConfigError, LazySamples, MultiLabelDataset, Sample
from mlcls.data.datasets.labels import LabelCounts, label_counts
from mlcls.data.datasets.observed import ALL_LABELS


class RowSamples(LazySamples):
    """The :class:`Sample` of rows ``rows`` of ``samples``, made on access (no copy of the list)."""

    def __init__(self, samples: Sequence[Sample], rows: np.ndarray) -> None:
        self.source_samples, self.rows = samples, rows

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]
        return self.source_samples[int(self.rows[index])]

    def __len__(self) -> int:
        return len(self.rows)


class SplitRows(MultiLabelDataset):
    """Rows ``rows`` (ascending sample indices) of the dataset ``source``, as a dataset: sample ``i`` is
    ``source``'s sample ``rows[i]``, its image read by ``source`` (``load_image``, with ``source``'s
    transform) and its target ``source``'s (``target``: as ``source``'s observed-label regime shows it).
    Unreadable images are skipped within the view (``dataset.on_bad_image=skip``)."""

    def __init__(self, source: MultiLabelDataset, rows: np.ndarray) -> None:
        # The source's settings, checked when it was built; nothing of the config is read again.
        self.source, self.rows = source, np.asarray(rows, dtype=np.int64)
        self.name, self.image_size, self.split = source.name, source.image_size, source.train_split
        self.train_split, self.val_split = source.train_split, source.val_split
        self.transform, self.on_bad_image = source.transform, source.on_bad_image
        self.observed = source.observed
        self.classes = list(source.classes)
        self.samples = RowSamples(source.samples, self.rows)

    @property
    def labels(self) -> Tensor:  # type: ignore[override]
        """float32 (n, C): the full labels of the rows."""
        return self.source.labels[torch.from_numpy(self.rows)]

    def label_counts(self) -> LabelCounts:
        """The counts of the targets (:func:`label_counts` of the rows of ``source``)."""
        return label_counts(Subset(self.source, self.rows))

    def load_image(self, index: int) -> Any:
        return self.source.load_image(int(self.rows[index]))

    def target(self, index: int) -> Tensor:
        return self.source.target(int(self.rows[index]))


def split_holdout(
    train_set: MultiLabelDataset, eval_transform: Callable | None
) -> tuple[SplitRows, SplitRows]:
    """``(training, held out)``: the samples of ``train_set`` its ``selection_split`` keeps for training and
    those it holds out. The held-out view reads through a shallow copy of ``train_set`` (the parsed
    annotations shared, nothing read twice) with ``eval_transform`` (the validation split's) and, for
    ``holdout_labels=clean``, every label. A cut that leaves either side empty raises
    :class:`DatasetConfigError`."""
    selection = train_set.selection_split
    held = selection.held_out(np.arange(len(train_set)))
    if not 0 < held.sum() < len(held):
        raise DatasetConfigError(
            f"dataset.holdout_fraction={selection.fraction:g} holds out {int(held.sum())} of the "
            f"{len(held)} training samples; expected some on each side (set a fraction that leaves both "
            "non-empty, or 0 for no held-out split)"
        )
    reader = copy.copy(train_set)
    reader.transform = eval_transform
    if selection.labels == "clean":
        reader.observed = ALL_LABELS
    return SplitRows(train_set, np.flatnonzero(~held)), SplitRows(reader, np.flatnonzero(held))
