"""Open Images V6 image-level classification: 9,605 trainable classes, human-verified partial labels.

Layout (the official downloads, unrenamed, in ``root/<annotations>``; images named by their ImageID)::

    root/oidv6-class-descriptions.csv                     LabelName,DisplayName (header row)
    root/oidv6-classes-trainable.txt                      one LabelName per line, no header
    root/oidv6-train-annotations-human-imagelabels.csv    ImageID,Source,LabelName,Confidence (header row)
    root/validation-annotations-human-imagelabels.csv
    root/test-annotations-human-imagelabels.csv
    root/{train,validation,test}/<ImageID>.jpg            (``train_images``, ... override these)

* classes: the trainable list in its file order (9,605 classes in V6: those with at least 100 positive
  human verifications in the training split), named by their DisplayName; a name shared by several
  trainable classes gets its LabelName appended, ``"Bass (/m/...)"``, so that class names stay unique.
  ``label_names`` holds the LabelNames (``/m/...`` ids) in the same order;
* labels come from the human-verified image-level labels only (the machine-generated ones are not read):
  Confidence 1 -> 1 (positive), 0 -> 0 (negative), an (image, class) pair absent from the file -> -1
  (unknown). A pair verified twice with opposite verdicts is unknown (-1);
* samples: the images with at least one verified label of a trainable class, sorted by ImageID. Rows of
  classes outside the trainable list, conflicting pairs and images without a trainable label are left
  out and counted in ``ignored`` (a dict, also logged).

Memory. The labels are kept sparse (:class:`mlcls.data.datasets.labels.SparseLabels`: the verified entries
only, 5 bytes each plus 8 per image; the V6 training split's ~57 M verified labels of ~9 M images take
about 0.35 GB), and each target row is built from them on its own. Training reads only those rows and the
label counts (:func:`mlcls.data.datasets.labels.label_counts`: loss weights, class statistics, results), so
the full training split trains from the CSVs or packs into shards without a dense matrix. The dense float32
``labels`` (N, C) is built on first access, and only when it fits in ``dense_labels_gb``: validation
(41,620 x 9,605: 1.6 GB) and test (125,436 images: 4.8 GB) do; the training split (~9 M x 9,605: ~350 GB)
does not (:class:`mlcls.data.datasets.labels.SparseLabelled`). The samples are made on access from the
image ids (:class:`ImageSamples`, 8 bytes an image).
"""

from __future__ import annotations

import csv
import logging
import os
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlcls.data.datasets.base import (
    DatasetFormatError,
    LazySamples,
    MultiLabelDataset,
    Sample,
    check_choice,
    require_files,
    resolve_path,
)
from mlcls.data.datasets.labels import SparseLabelled, SparseLabels
from mlcls.io import open_regular, read_regular_bytes

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
    """The samples ``<folder>/<ImageID>.jpg`` of ``image_ids`` (uint64 (N,)), each made on access: 8 bytes an
    image instead of ~150 for a list of :class:`Sample` (~1.4 GB for the V6 training split)."""

    def __init__(self, folder: str, image_ids: np.ndarray) -> None:
        self.folder, self.image_ids = folder, image_ids

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return Sample(os.path.join(self.folder, f"{int(self.image_ids[index]):016x}.jpg"))


class OpenImages(SparseLabelled, MultiLabelDataset):
    """Open Images V6 human-verified image-level labels over the trainable classes (module docstring).

    Args:
        split: ``"train"``, ``"validation"`` or ``"test"``.
        root: folder holding the annotation files (in ``annotations``) and the image folders.
        annotations: folder of the CSV files, relative to ``root`` or absolute (default: ``root``).
        train_images, validation_images, test_images: image folder of each split, relative to ``root`` or
            absolute; default: the split name (``root/train/<ImageID>.jpg``, ...).
        dense_labels_gb: largest dense float32 ``labels`` matrix built on request, in GB (1e9 bytes).

    Attributes:
        sparse_labels: :class:`SparseLabels` (N, C), the labels as parsed.
        label_names: the trainable LabelNames, in class order.
        ignored: counts of what the CSV held but the dataset left out: ``non_trainable_labels``,
            ``conflicting_labels``, ``images_without_trainable_label``.
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

        self.label_names = _read_trainable(annotation_dir / TRAINABLE_CLASSES)
        self.classes = _class_names(self.label_names, annotation_dir / CLASS_DESCRIPTIONS)
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


def _read_trainable(path: Path) -> list[str]:
    """The LabelNames of the trainable-classes file, in file order; blank lines skipped."""
    names = [line.strip() for line in read_regular_bytes(path).decode("utf-8").splitlines() if line.strip()]
    if not names:
        raise DatasetFormatError(f"{path} lists no class; expected one LabelName (e.g. /m/01g317) per line")
    repeated = [name for name, count in Counter(names).items() if count > 1]
    if repeated:
        raise DatasetFormatError(f"{path}: class {repeated[0]!r} is listed twice")
    return names


def _open_csv(path: Path, columns: Sequence[str]) -> tuple[Any, Any, dict[str, int]]:
    """``(file, reader, column index)`` of a CSV with a header row holding ``columns``."""
    handle = open_regular(path, "r", newline="", encoding="utf-8")  # closed by the caller
    reader = csv.reader(handle)
    header = next(reader, [])
    missing = [c for c in columns if c not in header]
    if missing:
        handle.close()
        raise DatasetFormatError(
            f"{path}: header {','.join(header)!r} lacks the column {missing[0]!r}; "
            f"expected {','.join(columns)}"
        )
    return handle, reader, {c: header.index(c) for c in columns}


def _class_names(label_names: list[str], path: Path) -> list[str]:
    """DisplayNames of ``label_names`` from the class-descriptions CSV; a name shared by several of them
    gets its LabelName appended."""
    handle, reader, column = _open_csv(path, ("LabelName", "DisplayName"))
    with handle:
        wanted = set(label_names)
        display = {
            row[column["LabelName"]]: row[column["DisplayName"]]
            for row in reader
            if len(row) > 1 and row[column["LabelName"]] in wanted
        }
    missing = [name for name in label_names if name not in display]
    if missing:
        raise DatasetFormatError(f"{path} has no DisplayName for the trainable class {missing[0]!r}")
    uses = Counter(display[name] for name in label_names)
    return [
        display[name] if uses[display[name]] == 1 else f"{display[name]} ({name})" for name in label_names
    ]


def _read_human_labels(path: Path, label_names: list[str]) -> tuple[np.ndarray, SparseLabels, dict[str, int]]:
    """Parse a human-verified image-level labels CSV into ``(image ids, labels, ignored counts)``.

    Image ids are uint64 (N,), sorted; labels :class:`SparseLabels` (N, C) over ``label_names``.
    Streams the file: memory is 13 bytes per verified label while parsing.
    """
    num_classes = len(label_names)
    class_index = {name: i for i, name in enumerate(label_names)}
    image_ids, columns, values = array("Q"), array("i"), array("b")
    handle, reader, column = _open_csv(path, LABEL_COLUMNS)
    image_col, label_col, confidence_col = column["ImageID"], column["LabelName"], column["Confidence"]
    with handle:
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
    keys, vals, conflicts = _one_entry_per_pair(
        rows[trainable].astype(np.int64) * num_classes + cols[trainable], vals[trainable]
    )
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


def _one_entry_per_pair(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Sorted unique ``keys`` (one per (image, class) pair) with their value; a pair listed with both 1 and
    0 is dropped (unknown). Returns ``(keys, values, number of pairs dropped)``."""
    if len(keys) == 0:
        return keys, values, 0
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    agree = np.minimum.reduceat(values, starts) == np.maximum.reduceat(values, starts)
    return keys[starts][agree], values[starts][agree], int((~agree).sum())
