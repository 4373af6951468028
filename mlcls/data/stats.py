"""Label statistics of a dataset (from ``labels`` alone, no image decoded) and an image readability check."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mlcls.data.base import BAD_IMAGE_ERRORS, MultiLabelDataset


@dataclass(frozen=True)
class LabelStats:
    """Summary of a (N, C) label matrix with entries 1 / 0 / -1.

    Attributes:
        num_samples: N.
        positives_per_sample: mean number of 1 entries per row.
        unknown_share: share of -1 entries among all N * C entries.
        positives_per_class: (C,) number of 1 entries per column.
    """

    num_samples: int
    positives_per_sample: float
    unknown_share: float
    positives_per_class: torch.Tensor

    def ranked(self, classes: list[str], count: int, most: bool) -> list[tuple[str, int]]:
        """The ``count`` most (or least) frequent classes as ``(name, positives)``; ties by class order."""
        order = sorted(
            range(len(classes)), key=lambda c: (-1 if most else 1) * int(self.positives_per_class[c])
        )
        return [(classes[c], int(self.positives_per_class[c])) for c in order[:count]]


def label_stats(labels: torch.Tensor) -> LabelStats:
    """Statistics of ``labels`` (N, C), 1 = positive, 0 = negative, -1 = unknown."""
    positives = labels == 1
    return LabelStats(
        num_samples=labels.shape[0],
        positives_per_sample=float(positives.sum(dim=1).float().mean()) if labels.shape[0] else 0.0,
        unknown_share=float((labels == -1).float().mean()) if labels.numel() else 0.0,
        positives_per_class=positives.sum(dim=0),
    )


def find_unreadable(dataset: MultiLabelDataset, workers: int = 4) -> tuple[int, list[tuple[str, str]]]:
    """Decode every distinct image of ``dataset`` once; return ``(images checked, [(path, error), ...])``.

    Samples sharing a file (several crops of one image) are checked once, through their first sample.
    """
    first_index: dict[str, int] = {}
    for index, sample in enumerate(dataset.samples):
        first_index.setdefault(sample.path, index)

    def error_of(index: int) -> str | None:
        try:
            dataset.load_image(index)
        except BAD_IMAGE_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        errors = list(pool.map(error_of, first_index.values()))
    bad = [(path, error) for path, error in zip(first_index, errors, strict=True) if error is not None]
    return len(first_index), bad
