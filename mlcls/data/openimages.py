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

Memory. The labels are kept sparse (:class:`SparseLabels`: the verified entries only, 5 bytes each plus 8
per image; the V6 training split's ~57 M verified labels of ~9 M images take about 0.35 GB), and
``__getitem__`` builds each target row from them. The dense float32 ``labels`` (N, C) that the rest of
mlcls reads (loss set-up, class statistics, the ignored-label count) is built on first access and only
when it fits in ``dense_labels_gb``: validation (41,620 x 9,605: 1.6 GB) and test (125,436 images:
4.8 GB) do; the training split (~9 M x 9,605: ~350 GB) does not, and reading its ``labels`` raises a
:class:`DatasetConfigError` saying so. The training split is meant to be packed into shards
(``mlcls-data pack``), which store one label row per sample; training from the CSVs directly on the full
split needs those consumers to take label counts instead of the dense matrix (see ``SparseLabels``).
The samples list (one path per image) takes about 150 bytes an image, ~1.4 GB for the training split.
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
import torch

from mlcls.data.base import (
    DatasetConfigError,
    DatasetFormatError,
    MultiLabelDataset,
    Sample,
    check_choice,
    require_files,
    resolve_path,
)

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


class SparseLabels:
    """An (N, C) label matrix stored as its known entries, row by row (compressed sparse rows).

    Row ``i``'s known entries are ``columns[offsets[i]:offsets[i + 1]]`` (ascending) with values
    ``values[...]`` (1 positive, 0 negative); every other entry is -1 (unknown).

    Args:
        offsets: int64 (N + 1,), non-decreasing, ``offsets[0] = 0``.
        columns: int32 (K,) class indices in [0, C), ascending within each row.
        values: int8 (K,) in {0, 1}.
        num_classes: C.
    """

    def __init__(self, offsets: np.ndarray, columns: np.ndarray, values: np.ndarray, num_classes: int):
        self.offsets, self.columns, self.values = offsets, columns, values
        self.shape = (len(offsets) - 1, int(num_classes))

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.columns.nbytes + self.values.nbytes

    def row(self, index: int) -> torch.Tensor:
        """float32 (C,): row ``index`` with 1 / 0 / -1."""
        start, end = self.offsets[index], self.offsets[index + 1]
        row = torch.full((self.shape[1],), -1.0)
        row[torch.from_numpy(self.columns[start:end]).long()] = torch.from_numpy(
            self.values[start:end]
        ).float()
        return row

    def dense(self) -> torch.Tensor:
        """float32 (N, C): the whole matrix (N * C * 4 bytes)."""
        rows = np.repeat(np.arange(self.shape[0]), np.diff(self.offsets))
        dense = torch.full(self.shape, -1.0)
        dense[torch.from_numpy(rows), torch.from_numpy(self.columns).long()] = torch.from_numpy(
            self.values
        ).float()
        return dense

    def count_per_class(self, value: int) -> torch.Tensor:
        """int64 (C,): number of entries equal to ``value`` (1 or 0) in each column."""
        counts = np.bincount(self.columns[self.values == value], minlength=self.shape[1])
        return torch.from_numpy(counts.astype(np.int64))

    def unknown_count(self) -> int:
        """Number of -1 entries: N * C minus the known ones."""
        return self.shape[0] * self.shape[1] - len(self.values)


class OpenImages(MultiLabelDataset):
    """Open Images V6 human-verified image-level labels over the trainable classes (see the module
    docstring for the label semantics and the memory limits).

    ``on_bad_image`` and the config's ``name``, ``image_size``, ``train_split`` and ``val_split``
    (``**config_keys``) are those of :class:`MultiLabelDataset`.

    Args:
        split: ``"train"``, ``"validation"`` or ``"test"``.
        transform: applied to the PIL image, or a transform name (see :class:`MultiLabelDataset`).
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
        transform: Callable | str | None = None,
        root: str = "data/openimages",
        annotations: str = ".",
        train_images: str | None = None,
        validation_images: str | None = None,
        test_images: str | None = None,
        dense_labels_gb: float = 8.0,
        on_bad_image: str = "error",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, on_bad_image, split=split, **config_keys)
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
        folder = str(image_dir)
        self.samples = [Sample(os.path.join(folder, f"{i:016x}.jpg")) for i in image_ids.tolist()]
        self._dense_labels: torch.Tensor | None = None

    @property
    def labels(self) -> torch.Tensor:
        """float32 (N, C): 1 positive, 0 negative, -1 unknown; built from ``sparse_labels`` on first access,
        or :class:`DatasetConfigError` when it would exceed ``dense_labels_gb``."""
        if self._dense_labels is None:
            size_gb = 4 * self.sparse_labels.shape[0] * self.sparse_labels.shape[1] / 1e9
            if size_gb > self.dense_labels_gb:
                rows, classes = self.sparse_labels.shape
                raise DatasetConfigError(
                    f"Open Images {self.split}: the dense label matrix ({rows} x {classes} float32) would "
                    f"take {size_gb:.1f} GB, over dataset.dense_labels_gb={self.dense_labels_gb:g}; pack the "
                    "split into shards (mlcls-data pack) or raise dataset.dense_labels_gb"
                )
            self._dense_labels = self.sparse_labels.dense()
        return self._dense_labels

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image, target)`` with the target row built from ``sparse_labels`` (no dense matrix needed)."""
        image, served = self.read_image(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, self.sparse_labels.row(served)


def _read_trainable(path: Path) -> list[str]:
    """The LabelNames of the trainable-classes file, in file order; blank lines skipped."""
    names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not names:
        raise DatasetFormatError(f"{path} lists no class; expected one LabelName (e.g. /m/01g317) per line")
    repeated = [name for name, count in Counter(names).items() if count > 1]
    if repeated:
        raise DatasetFormatError(f"{path}: class {repeated[0]!r} is listed twice")
    return names


def _open_csv(path: Path, columns: Sequence[str]) -> tuple[Any, Any, dict[str, int]]:
    """``(file, reader, column index)`` of a CSV with a header row holding ``columns``."""
    handle = open(path, newline="", encoding="utf-8")  # noqa: SIM115 -- closed by the caller
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
