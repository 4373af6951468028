"""Open Images V6 image-level classification: 9,605 trainable classes, human-verified partial labels
(layout: docs/datasets.md).

Classes: the trainable list, named by DisplayName (``"Bass (/m/...)"`` where several share one). Labels:
the human verifications only, Confidence 1 -> 1, 0 -> 0, a pair absent (or given both verdicts) -> -1.
Samples: the images with a trainable label, sorted by ImageID; what is left out is counted in ``ignored``.

Memory: the labels stay sparse (5 bytes a verified label plus 8 an image: ~0.35 GB for train's ~57 M),
the samples are made on access, and the dense ``labels`` is built only when it fits in
``dense_labels_gb``: validation (41,620 x 9,605: 1.6 GB) and test (4.8 GB) do, train (~350 GB) does not.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlcls.data.datasets.base import (
    DatasetFormatError,
    LazySamples,
    MultiLabelDataset,
    Sample,
    check_choice,
    reading,
    require_files,
    resolve_path,
)
from mlcls.data.datasets.labels import SparseLabelled, SparseLabels
from mlcls.io import CAPS, open_regular, read_text

log = logging.getLogger("mlcls")

SPLITS = ("train", "validation", "test")
CLASS_DESCRIPTIONS = "oidv6-class-descriptions.csv"
TRAINABLE_CLASSES = "oidv6-classes-trainable.txt"
HUMAN_LABELS = {
    "train": "oidv6-train-annotations-human-imagelabels.csv",
    "validation": "validation-annotations-human-imagelabels.csv",
    "test": "test-annotations-human-imagelabels.csv",
}
LABEL_COLUMNS = ("ImageID", "Source", "LabelName", "Confidence")
CONFIDENCE_VALUES = {"1": 1, "0": 0, "1.0": 1, "0.0": 0}
IMAGE_ID_DIGITS = 16  # ImageIDs are 64-bit integers written as 16 lowercase hexadecimal digits


class ImageSamples(LazySamples):
    """The samples ``<folder>/<ImageID>.jpg`` of ``image_ids`` (uint64 (N,)): 8 bytes an image instead of
    ~150 as a list of :class:`Sample` (~1.4 GB for the V6 training split)."""

    def __init__(self, folder: str, image_ids: np.ndarray) -> None:
        self.folder, self.image_ids = folder, image_ids

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return Sample(os.path.join(self.folder, f"{int(self.image_ids[index]):016x}.jpg"))


class OpenImages(SparseLabelled, MultiLabelDataset):
    """Open Images V6 human-verified image-level labels over the trainable classes.

    ``annotations``: the CSV folder and ``{train,validation,test}_images`` the image folders, relative to
    ``root`` or absolute. Attributes: ``sparse_labels`` (N, C), ``label_names`` (the LabelNames, in class
    order), ``ignored`` (``non_trainable_labels``, ``conflicting_labels``,
    ``images_without_trainable_label``).
    """

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = "data/openimages",
        annotations: str = ".",
        train_images: str | None = None,
        validation_images: str | None = None,
        test_images: str | None = None,
        dense_labels_gb: float = 8.0,
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("Open Images split", split, SPLITS)
        annotation_dir = resolve_path(root, annotations)
        folders = {"train": train_images, "validation": validation_images, "test": test_images}
        image_dir = resolve_path(root, folders[split] or split)
        layout = (
            f"{annotation_dir}/{{{CLASS_DESCRIPTIONS}, {TRAINABLE_CLASSES}, {HUMAN_LABELS[split]}}} "
            f"and images in {image_dir}/<ImageID>.jpg"
        )
        require_files(annotation_dir, [CLASS_DESCRIPTIONS, TRAINABLE_CLASSES, HUMAN_LABELS[split]], layout)
        require_files(image_dir, ["."], layout)
        self.dense_labels_gb = float(dense_labels_gb)

        trainable = annotation_dir / TRAINABLE_CLASSES
        text = read_text(trainable, "class list")
        self.label_names = [line.strip() for line in text.splitlines() if line.strip()]
        if not self.label_names:
            raise DatasetFormatError(
                f"{trainable} lists no class; expected one LabelName (e.g. /m/01g317) per line"
            )
        repeated = [name for name, count in Counter(self.label_names).items() if count > 1]
        if repeated:
            raise DatasetFormatError(f"{trainable}: class {repeated[0]!r} is listed twice")
        # The DisplayNames; a name shared by several classes gets its LabelName appended.
        with _csv_rows(annotation_dir / CLASS_DESCRIPTIONS, ("LabelName", "DisplayName")) as (reader, column):
            wanted = set(self.label_names)
            display = {
                row[column["LabelName"]]: row[column["DisplayName"]]
                for row in reader
                if len(row) > 1 and row[column["LabelName"]] in wanted
            }
        missing = [name for name in self.label_names if name not in display]
        if missing:
            raise DatasetFormatError(
                f"{annotation_dir / CLASS_DESCRIPTIONS} has no DisplayName for the trainable class "
                f"{missing[0]!r}"
            )
        uses = Counter(display[name] for name in self.label_names)
        self.classes = [
            display[n] if uses[display[n]] == 1 else f"{display[n]} ({n})" for n in self.label_names
        ]
        image_ids, self.sparse_labels, self.ignored = _read_human_labels(
            annotation_dir / HUMAN_LABELS[split], self.label_names
        )
        if any(self.ignored.values()):
            log.info(
                "Open Images %s: left out %s",
                split,
                ", ".join(f"{count} {what.replace('_', ' ')}" for what, count in self.ignored.items()),
            )
        self.samples = ImageSamples(str(image_dir), image_ids)


@contextlib.contextmanager
def _csv_rows(path: Path, columns: Sequence[str]) -> Iterator[tuple[Iterator[list[str]], dict[str, int]]]:
    """``(rows, column index)`` of an open CSV whose header row holds ``columns``."""
    with (
        reading(path),
        open_regular(path, "r", max_bytes=CAPS["label file"], newline="", encoding="utf-8") as handle,
    ):
        reader = csv.reader(handle)
        header = next(reader, [])
        missing = [c for c in columns if c not in header]
        if missing:
            raise DatasetFormatError(
                f"{path}: header {','.join(header)!r} lacks the column {missing[0]!r}; "
                f"expected {','.join(columns)}"
            )
        yield reader, {c: header.index(c) for c in columns}


def _read_human_labels(path: Path, label_names: list[str]) -> tuple[np.ndarray, SparseLabels, dict[str, int]]:
    """``(image ids, labels, ignored counts)`` of a human-verified labels CSV: uint64 (N,) sorted ids and
    :class:`SparseLabels` (N, C) over ``label_names``. Streamed: 13 bytes a verified label while parsing."""
    num_classes = len(label_names)
    class_index = {name: i for i, name in enumerate(label_names)}
    image_ids, columns, values = array("Q"), array("i"), array("b")
    with _csv_rows(path, LABEL_COLUMNS) as (reader, column):
        image_col, label_col, confidence_col = column["ImageID"], column["LabelName"], column["Confidence"]
        for line, row in enumerate(reader, start=2):
            try:
                image_id, confidence = row[image_col], row[confidence_col]
                values.append(CONFIDENCE_VALUES[confidence])
                if len(image_id) != IMAGE_ID_DIGITS:
                    raise ValueError
                image_ids.append(int(image_id, 16))
            except (IndexError, KeyError, ValueError):
                raise DatasetFormatError(
                    f"{path}, line {line}: {','.join(row)!r}; expected ImageID (16 hexadecimal digits), "
                    "Source, LabelName and Confidence 1 or 0"
                ) from None
            columns.append(class_index.get(row[label_col], -1))  # -1: not a trainable class

    all_ids, rows = np.unique(np.frombuffer(image_ids, dtype=np.uint64), return_inverse=True)
    cols, vals = np.frombuffer(columns, dtype=np.int32), np.frombuffer(values, dtype=np.int8)
    trainable = cols >= 0
    # One entry per (image, class) pair, sorted; a pair verified both 1 and 0 is dropped (unknown).
    keys = rows[trainable].astype(np.int64) * num_classes + cols[trainable]
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], vals[trainable][order]
    starts = np.flatnonzero(np.diff(keys, prepend=-1))  # keys are >= 0
    agree = np.minimum.reduceat(vals, starts) == np.maximum.reduceat(vals, starts)
    keys, vals, conflicts = keys[starts][agree], vals[starts][agree], int((~agree).sum())
    rows, cols = keys // num_classes, (keys % num_classes).astype(np.int32)
    kept_images, rows = np.unique(rows, return_inverse=True)  # rows renumbered over the images kept
    offsets = np.zeros(len(kept_images) + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=len(kept_images)), out=offsets[1:])
    ignored = {
        "non_trainable_labels": int((~trainable).sum()),
        "conflicting_labels": conflicts,
        "images_without_trainable_label": len(all_ids) - len(kept_images),
    }
    return all_ids[kept_images], SparseLabels(offsets, cols, vals, num_classes), ignored
