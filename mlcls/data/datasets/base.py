"""Base class shared by every multi-label dataset: pure data, its annotation files parsed once.

A subclass's constructor takes ``split`` and ``transform``, then its own keys, passes the rest to
:class:`MultiLabelDataset`, and sets ``classes``, ``labels`` (float32 (N, C): 1 positive, 0 negative, -1
unknown) and ``samples`` (one :class:`Sample` per row). An image that fails to read or transform with one
of :data:`BAD_IMAGE_ERRORS` stops the run naming the file (``on_bad_image=error``: a silently altered
training set is worse) or is replaced by the next readable sample and recorded (``skip``).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from mlcls.data.images import read_image_bytes, rgb_picture
from mlcls.errors import shown
from mlcls.io import read_json

ON_BAD_IMAGE = ("error", "skip")
# What PIL raises for a missing, unidentifiable, truncated or oversized image (and check_aspect_ratio).
BAD_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
# In ``skip`` mode, give up after this many consecutive unreadable samples (a wrong folder, not bad luck).
MAX_CONSECUTIVE_BAD = 16
# Label values: positive, negative, unknown.
LABEL_VALUES = (1.0, 0.0, -1.0)
# A dense label table takes at most this many times its annotation files' size, or the floor (label_table).
LABEL_TABLE_RATIO = 256
LABEL_TABLE_FLOOR = 256 * 2**20

T = TypeVar("T")


class DatasetError(Exception):
    """Base class of the user-facing dataset errors; the CLIs print them as one line."""


class DatasetLayoutError(DatasetError, FileNotFoundError):
    """A dataset root does not hold the files of the expected official layout."""


class DatasetFormatError(DatasetError, ValueError):
    """An annotation file exists but does not hold what its format specifies (column, class name, ...)."""


class DatasetConfigError(DatasetError, ValueError):
    """A dataset option has an invalid value (unknown split, mode, ...)."""


class BadImageError(DatasetError, OSError):
    """An image file cannot be decoded or transformed (with ``on_bad_image=error``)."""


@dataclass(frozen=True)
class Sample:
    """One image, or its crop ``box`` ``(x, y, w, h)`` in pixels (None: the whole image)."""

    path: str
    box: tuple[float, float, float, float] | None = None


class LazySamples(Sequence):
    """A sequence of :class:`Sample` made on access, for millions of images that would take gigabytes as a
    list; the dataset keeps it as it is."""


def require_files(root: str | Path, relative_paths: Sequence[str], layout: str) -> None:
    """Raise :class:`DatasetLayoutError` naming the first missing file and the expected layout."""
    root = Path(root)
    for rel in relative_paths:
        if not (root / rel).exists():
            raise DatasetLayoutError(f"missing {root / rel}; expected layout: {layout}")


def first_file(root: str | Path, names: Sequence[str], layout: str) -> Path:
    """``root / name`` for the first of ``names`` that is a file, else :class:`DatasetLayoutError`."""
    for name in names:
        if (Path(root) / name).is_file():
            return Path(root) / name
    raise DatasetLayoutError(f"missing {Path(root) / names[0]}; expected layout: {layout}")


def resolve_path(root: str | Path, path: str | Path) -> Path:
    """``path`` itself if absolute, else ``root / path``."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else Path(root).expanduser() / path


@contextlib.contextmanager
def reading(path: str | Path, expected: str = "") -> Iterator[None]:
    """What reading the file ``path`` in the block raises, as one dataset error line: a missing file a
    :class:`DatasetLayoutError` (``expected``: what belongs there), one that does not parse, is too large or
    nested too deep a :class:`DatasetFormatError`."""
    try:
        yield
    except DatasetError:
        raise
    except FileNotFoundError as exc:
        raise DatasetLayoutError(f"missing {path}" + (f"; expected {expected}" if expected else "")) from exc
    except (json.JSONDecodeError, csv.Error, ET.ParseError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"cannot parse {path}: {exc}") from exc
    except ValueError as exc:  # too large, or nested too deep
        raise DatasetFormatError(str(exc)) from exc


def load_json(path: str | Path) -> Any:
    """The JSON file ``path`` (:func:`read_json`, ``CAPS["label file"]``), read through :func:`reading`."""
    with reading(path):
        return read_json(path, "label file")


def label_table(rows: int, classes: int, read: Sequence[str | Path], source: str | Path) -> np.ndarray:
    """float32 (rows, classes) of zeros, allocated only when it takes at most
    ``LABEL_TABLE_RATIO`` times the bytes of the annotation files ``read``, or ``LABEL_TABLE_FLOOR``; else
    one :class:`DatasetFormatError` line naming ``source``, before allocating.

    Why: a 0.7 MB CSV of many distinct images and class names (each used once) would ask for 5 GB. Real
    files state much of their table: COCO's 82,081 x 80 (26 MB) comes from a 450 MB JSON; a CSV of class
    names reaches the bound only past 64 classes per byte of a row; a CSV of one column per class never."""
    source_bytes = sum(os.stat(path).st_size for path in read)
    allowed = max(LABEL_TABLE_FLOOR, LABEL_TABLE_RATIO * source_bytes)
    needed = 4 * rows * classes
    if needed > allowed:
        raise DatasetFormatError(
            f"{source}: {rows} samples x {classes} classes would take {needed / 2**20:.0f} MiB as a label "
            f"table, more than {LABEL_TABLE_RATIO} times the {source_bytes / 2**20:.2f} MiB of the annotation"
            f" files (or {LABEL_TABLE_FLOOR // 2**20} MiB); expected a table the annotations describe"
        )
    return np.zeros((rows, classes), dtype=np.float32)


def check_class_names(classes: Sequence[object], source: str | Path) -> list[str]:
    """``classes`` as a list; one :class:`DatasetFormatError` line naming ``source`` for a name that is not a
    non-empty string or appears twice (two columns of one name would split its labels)."""
    seen: dict[str, int] = {}
    for position, name in enumerate(classes):
        if not isinstance(name, str) or not name:
            raise DatasetFormatError(
                f"{source}: class {position} is {shown(name)}; expected a non-empty class name"
            )
        if name in seen:
            raise DatasetFormatError(
                f"{source}: class name {shown(name)} is given twice (classes {seen[name]} and {position}); "
                "expected distinct class names"
            )
        seen[name] = position
    return list(classes)


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise :class:`DatasetConfigError`."""
    if value not in choices:
        raise DatasetConfigError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def check_setting(key: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` of ``dataset.<key>`` if one of ``choices``, else one :class:`DatasetConfigError` line."""
    if not isinstance(value, str) or value not in choices:
        raise DatasetConfigError(f"dataset.{key}={shown(value)}; expected one of {', '.join(choices)}")
    return value


def check_integer(key: str, value: Any, low: int, high: int) -> int:
    """``value`` of ``dataset.<key>`` if an integer (not a bool) in [``low``, ``high``], else one
    :class:`DatasetConfigError` line."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DatasetConfigError(f"dataset.{key}={shown(value)}; expected an integer from {low} to {high}")
    return value


def check_labels(labels: torch.Tensor, classes: Sequence[str], dataset: str) -> torch.Tensor:
    """``labels`` as float32 (N, C), C = ``len(classes)``, holding only 1, 0 and -1 (the losses and metrics
    rely on it at every step); else one :class:`DatasetFormatError` line naming the first bad value."""
    labels = torch.as_tensor(labels, dtype=torch.float32)
    if labels.ndim != 2 or labels.shape[1] != len(classes):
        raise DatasetFormatError(
            f"{dataset}: labels of shape {tuple(labels.shape)}; expected (samples, {len(classes)}), one "
            "column per class"
        )
    valid = torch.isin(labels, torch.tensor(LABEL_VALUES))
    if not bool(valid.all()):
        row, column = torch.nonzero(~valid)[0].tolist()
        raise DatasetFormatError(
            f"{dataset}: label {labels[row, column].item():g} for sample {row}, class {classes[column]!r}; "
            "expected 1 (positive), 0 (negative) or -1 (unknown)"
        )
    return labels


class MultiLabelDataset(Dataset):
    """Serves ``(transformed image, target)``, the target a float32 (C,) row of ``labels``; ``name``,
    ``train_split`` and ``val_split`` are the config's keys, kept for results and reports."""

    # The samples are image files, which a transform's own ``decode`` may read (False: drawn pixels).
    reads_files = True

    @classmethod
    def cuts_validation(cls, keys: Any) -> bool:
        """Whether the dataset config ``keys`` cuts its validation split from its training file: then the
        dataset takes ``val_fraction``, ``val_by`` and ``val_seed`` itself (:func:`mlcls.data.build_dataset`).
        Most datasets have a validation split of their own."""
        return False

    def __init__(
        self,
        transform: Callable | None = None,
        on_bad_image: str = "error",
        *,
        name: str | None = None,
        train_split: str = "train",
        val_split: str = "val",
    ) -> None:
        self.name, self.transform = name, transform
        self.train_split, self.val_split = train_split, val_split
        self.on_bad_image = check_choice("on_bad_image", on_bad_image, ON_BAD_IMAGE)

    @property
    def classes(self) -> list[str]:
        """The class names, in label order (:func:`check_class_names` when set)."""
        return self._classes

    @classes.setter
    def classes(self, classes: Sequence[str]) -> None:
        self._classes = check_class_names(classes, self.described())

    def described(self) -> str:
        """The dataset's class and split, for its messages: ``"CSVDataset (train split)"``."""
        split = getattr(self, "split", None)
        return type(self).__name__ + (f" ({split} split)" if split else "")

    @property
    def labels(self) -> torch.Tensor:
        """float32 (N, C) (:func:`check_labels` when set, after ``classes``)."""
        return self._labels

    @labels.setter
    def labels(self, labels: torch.Tensor) -> None:
        self._labels = check_labels(labels, self.classes, self.described())

    @property
    def samples(self) -> list[Sample]:
        """One :class:`Sample` per row of ``labels``."""
        return self._samples

    @samples.setter
    def samples(self, samples: Sequence[Sample]) -> None:
        # A lazy sequence (Open Images' millions of images) is kept as it is; anything else becomes a list.
        self._samples = samples if isinstance(samples, LazySamples) else list(samples)
        # Allocated here, in the process that builds the dataset, so that DataLoader workers (forked or
        # spawned) share it with the main process.
        self._bad_flags = torch.zeros(len(self._samples), dtype=torch.bool).share_memory_()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def image_bytes(self, index: int) -> bytes:
        """The encoded image of sample ``index``: its file's bytes (:func:`read_image_bytes`)."""
        return read_image_bytes(self.samples[index].path)

    def picture(self, index: int) -> Image.Image:
        """Sample ``index`` as a person sees it (:func:`rgb_picture` of its bytes and box)."""
        return rgb_picture(self.image_bytes(index), self.samples[index].box)

    def load_image(self, index: int) -> Any:
        """The transform's input for sample ``index``: its ``decode_bytes(data, box)`` of :meth:`image_bytes`
        when it has one and :attr:`reads_files` (the fast pipeline crops first, then decodes at reduced
        scale), else :meth:`picture`."""
        decode = getattr(self.transform, "decode_bytes", None)
        if decode is None or not self.reads_files:
            return self.picture(index)
        return decode(self.image_bytes(index), self.samples[index].box)

    def transformed_image(self, index: int) -> Any:
        """The transform's output for sample ``index`` (:meth:`load_image`'s image without a transform)."""
        image = self.load_image(index)
        return image if self.transform is None else self.transform(image)

    def read_sample(self, index: int, read: Callable[[int], T]) -> tuple[T, int]:
        """``(read(i), i)`` for ``i = index``; when ``read`` raises one of :data:`BAD_IMAGE_ERRORS`,
        :class:`BadImageError` naming the file (``error``) or the next ``i`` that reads, the bad file recorded
        for :meth:`pop_bad_images` (``skip``). Every input pipeline reads through it."""
        for attempt in range(min(MAX_CONSECUTIVE_BAD, len(self))):
            current = (index + attempt) % len(self)
            try:
                return read(current), current
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
        """Files skipped since the last call (here or in DataLoader workers; this rank's), sorted, each once;
        resets the record."""
        flagged = torch.nonzero(self._bad_flags).flatten().tolist()
        self._bad_flags.zero_()
        return sorted({self.samples[i].path for i in flagged})

    def target(self, index: int) -> torch.Tensor:
        """float32 (C,): the labels of sample ``index`` (a row of ``labels``)."""
        return self.labels[index]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, served = self.read_sample(index, self.transformed_image)
        return image, self.target(served)


def find_unreadable(dataset: MultiLabelDataset, workers: int = 4) -> tuple[int, list[tuple[str, str]]]:
    """``(images checked, [(path, error), ...])``: every distinct file of ``dataset`` decoded once (through
    its first sample: the crops of one image share it)."""
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
