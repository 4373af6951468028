"""Base class shared by every multi-label dataset.

A dataset is pure data: it parses its annotation files once, then serves ``(image, target)`` pairs.
Subclasses fill three attributes in ``__init__``:

* ``classes``  -- list of class names, in the dataset's fixed, documented order;
* ``labels``   -- float32 tensor (N, C) with 1 = positive, 0 = negative, -1 = unknown;
* ``samples``  -- list of :class:`Sample` (image path and optional crop box), one per row of ``labels``.

``labels`` is available without decoding any image (class statistics, loss weighting, ``mlcls-data stats``).

Unreadable images (missing, corrupt, truncated) are handled by ``on_bad_image``:

* ``"error"`` (default): raise :class:`BadImageError` naming the file. A silently altered training set is
  worse than a stopped run; ``mlcls-data stats --check`` lists every unreadable file beforehand.
* ``"skip"``: serve the next readable sample instead (index + 1, + 2, ... wrapping around; image *and*
  target of that sample) and flag the bad one in a per-sample flag tensor kept in shared memory, so flags
  set inside DataLoader worker processes are seen by the main process. After each epoch the trainer calls
  :meth:`MultiLabelDataset.pop_bad_images` to get (and reset) the files skipped since its last call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

ON_BAD_IMAGE = ("error", "skip")
# What PIL raises for a missing, unidentifiable, truncated or oversized image file.
BAD_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
# In ``skip`` mode, give up after this many consecutive unreadable samples (a wrong folder, not bad luck).
MAX_CONSECUTIVE_BAD = 16


class DatasetError(Exception):
    """Base class of the user-facing dataset errors; the CLIs print them as one line."""


class DatasetLayoutError(DatasetError, FileNotFoundError):
    """A dataset root does not hold the files of the expected official layout."""


class DatasetFormatError(DatasetError, ValueError):
    """An annotation file exists but does not hold what its format specifies (column, class name, ...)."""


class DatasetConfigError(DatasetError, ValueError):
    """A dataset option has an invalid value (unknown split, mode, ...)."""


class BadImageError(DatasetError, OSError):
    """An image file cannot be decoded (with ``on_bad_image=error``)."""


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


def resolve_path(root: str | Path, path: str | Path) -> Path:
    """``path`` itself if absolute, else ``root / path``."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else Path(root).expanduser() / path


def load_json(path: str | Path) -> Any:
    """Parse the JSON file ``path``; a missing or malformed file raises a one-line dataset error."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as exc:
        raise DatasetLayoutError(f"missing {path}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"cannot parse {path}: {exc}") from exc


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise :class:`DatasetConfigError`."""
    if value not in choices:
        raise DatasetConfigError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def crop_box(box: tuple[float, float, float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """Pixel crop ``(left, top, right, bottom)`` of box ``(x, y, w, h)`` clamped to a ``width`` x ``height``
    image; the whole image when the clamped box is empty."""
    x, y, w, h = box
    left, top = max(0, int(x)), max(0, int(y))
    right, bottom = min(width, int(round(x + w))), min(height, int(round(y + h)))
    if right > left and bottom > top:
        return left, top, right, bottom
    return 0, 0, width, height


def nonempty_boxes(boxes: np.ndarray) -> np.ndarray:
    """Boolean mask (N,) of the ``(x, y, w, h)`` boxes (N, 4) with a positive width and height.

    The crop datasets drop the other boxes: there is nothing to crop.
    """
    return (boxes[:, 2] > 0) & (boxes[:, 3] > 0)


class MultiLabelDataset(Dataset):
    """Serves ``(image, target)``: ``image`` is the transformed PIL image, ``target`` a float32 (C,) row.

    Args:
        transform: applied to the PIL image.
        on_bad_image: ``"error"`` or ``"skip"`` (see the module docstring).
    """

    classes: list[str]
    labels: torch.Tensor

    def __init__(self, transform: Callable | None = None, on_bad_image: str = "error") -> None:
        self.transform = transform
        self.on_bad_image = check_choice("on_bad_image", on_bad_image, ON_BAD_IMAGE)

    @property
    def samples(self) -> list[Sample]:
        """One :class:`Sample` per row of ``labels``."""
        return self._samples

    @samples.setter
    def samples(self, samples: Sequence[Sample]) -> None:
        self._samples = list(samples)
        # Allocated here, in the process that builds the dataset, so that DataLoader workers (forked or
        # spawned) share it with the main process.
        self._bad_flags = torch.zeros(len(self._samples), dtype=torch.bool).share_memory_()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def load_image(self, index: int) -> Image.Image:
        """Decode sample ``index`` as RGB, cropped to its box (clamped to the image) when it has one.

        A transform with a ``decode(path, box)`` method decodes the file itself and its result goes to the
        transform (the fast pipeline picks its random crop first, then decodes JPEGs at reduced scale).
        """
        sample = self.samples[index]
        decode = getattr(self.transform, "decode", None)
        if decode is not None:
            return decode(sample.path, sample.box)
        with Image.open(sample.path) as img:
            img = img.convert("RGB")
        if sample.box is not None:
            img = img.crop(crop_box(sample.box, img.width, img.height))
        return img

    def read_image(self, index: int) -> tuple[Image.Image, int]:
        """``(image, index_served)``: sample ``index``, or in ``skip`` mode the next readable one."""
        for attempt in range(min(MAX_CONSECUTIVE_BAD, len(self))):
            current = (index + attempt) % len(self)
            try:
                return self.load_image(current), current
            except BAD_IMAGE_ERRORS as exc:
                path = self.samples[current].path
                if self.on_bad_image == "error":
                    raise BadImageError(
                        f"cannot read image {path}: {exc} (dataset.on_bad_image=skip skips unreadable "
                        "images; `mlcls-data stats --check` lists them)"
                    ) from exc
                self._bad_flags[current] = True
        raise BadImageError(
            f"{min(MAX_CONSECUTIVE_BAD, len(self))} consecutive unreadable images from "
            f"{self.samples[index].path}; is the image folder right? (`mlcls-data stats --check` lists them)"
        )

    def pop_bad_images(self) -> list[str]:
        """Files skipped (``on_bad_image=skip``) since the last call, sorted, each once; resets the record.

        Works whether the images were read in this process or in DataLoader worker processes. With DDP
        each rank holds its own record (gather the lists to report a global count).
        """
        flagged = torch.nonzero(self._bad_flags).flatten().tolist()
        self._bad_flags.zero_()
        return sorted({self.samples[i].path for i in flagged})

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, served = self.read_image(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[served]
