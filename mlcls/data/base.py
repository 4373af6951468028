"""Base class shared by every multi-label dataset.

A dataset is pure data: it parses its annotation files once, then serves ``(image, target)`` pairs.
Subclasses fill three attributes in ``__init__``:

* ``classes``  -- list of class names, in the dataset's fixed, documented order;
* ``labels``   -- float32 tensor (N, C) with 1 = positive, 0 = negative, -1 = unknown;
* ``samples``  -- list of :class:`Sample` (image path and optional crop box), one per row of ``labels``.

``labels`` is available without decoding any image (class statistics, loss weighting, ``mlcls-data stats``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset


class DatasetLayoutError(FileNotFoundError):
    """A dataset root does not hold the files of the expected official layout."""


@dataclass(frozen=True)
class Sample:
    """One image (or one crop of an image).

    ``box`` is ``(x, y, w, h)`` in pixels, or ``None`` for the whole image.
    """

    path: str
    box: tuple[float, float, float, float] | None = None


def require_files(root: str | Path, relative_paths: Sequence[str], layout: str) -> None:
    """Raise :class:`DatasetLayoutError` naming the first missing file and the expected layout."""
    root = Path(root)
    for rel in relative_paths:
        if not (root / rel).exists():
            raise DatasetLayoutError(f"missing {root / rel}; expected layout: {layout}")


class MultiLabelDataset(Dataset):
    """Serves ``(image, target)``: ``image`` is the transformed PIL image, ``target`` a float32 (C,) row."""

    classes: list[str]
    labels: torch.Tensor
    samples: list[Sample]

    def __init__(self, transform: Callable | None = None) -> None:
        self.transform = transform

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def load_image(self, index: int) -> Image.Image:
        """Decode sample ``index`` as RGB, cropped to its box (clamped to the image) when it has one."""
        sample = self.samples[index]
        with Image.open(sample.path) as img:
            img = img.convert("RGB")
        if sample.box is not None:
            x, y, w, h = sample.box
            left, top = max(0, int(x)), max(0, int(y))
            right, bottom = min(img.width, int(round(x + w))), min(img.height, int(round(y + h)))
            if right > left and bottom > top:
                img = img.crop((left, top, right, bottom))
        return img

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.load_image(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]
