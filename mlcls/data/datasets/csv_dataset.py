"""The user's own images and labels, listed in a CSV or TSV file.

Two label formats:

* a labels column holding class names separated by ``label_delimiter`` (default a space)::

      image,labels
      img/0001.jpg,cat dog
      img/0002.jpg,dog

  listed names -> 1, every other class -> 0; an empty cell is an image with no positive class;
* one column per class (``labels_column: null``), values ``1`` (positive), ``0`` (negative), ``-1`` or an
  empty cell (unknown)::

      image,cat,dog,bird
      img/0001.jpg,1,1,0
      img/0002.jpg,0,1,

Classes: ``classes`` given (that order; any other name is an error), or inferred: the sorted names found in
the training and validation files (labels column), or the class columns in header order (one-hot).

Image paths are relative to ``root / image_dir`` (or absolute). Validation data: ``val_file``, or else about
``val_fraction`` of the training file's images, held out as ``val_by`` says, seeded by ``val_seed``:
``stratified`` (the default, :func:`stratified_holdout`: each class keeps about its share of positives on
each side, and the split depends on every row: appending rows can move images between training and
validation) or ``hashed`` (:func:`held_out`: a function of each image's path as written alone, so appending
rows never moves an image; a rare class may have no positive held out). A held-out split that leaves a class
fewer than ``MIN_VAL_POSITIVES`` positives is warned about, naming them.

An image is known by its path resolved against ``root / image_dir`` and normalised (:func:`image_key`): an
image listed twice with the same labels counts once, with a warning; with other labels it is an error
naming both lines (:func:`unique_rows`). An image in both the training and the validation file is warned
about (:func:`check_disjoint`). Class names that differ only in case are warned about. The file delimiter
follows the extension (``.tsv``/``.tab`` -> tab, else comma) unless ``delimiter`` is set.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlcls.data.datasets.base import (
    DatasetConfigError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
    check_choice,
    check_class_names,
    label_table,
    require_files,
    resolve_path,
)
from mlcls.data.datasets.folds import held_out, image_hash, stratified_holdout
from mlcls.errors import plural, printable
from mlcls.io import FileTooLargeError, read_text

SPLITS = ("train", "val")
VAL_BY = ("stratified", "hashed")  # dataset.val_by: how val_fraction of the training file is held out
# A class with fewer validation positives than this in a held-out split is named in a warning.
MIN_VAL_POSITIVES = 5

log = logging.getLogger("mlcls")


def read_table(path: Path, delimiter: str | None) -> tuple[list[str], list[list[str]]]:
    """Header and rows (blank lines skipped) of a delimited text file (a regular file of at most
    ``CAPS["label file"]`` bytes)."""
    if delimiter is None:
        delimiter = "\t" if path.suffix.lower() in (".tsv", ".tab") else ","
    try:
        text = read_text(path, "label file").removeprefix("\ufeff")
        lines = io.StringIO(text, newline="")
        rows = [row for row in csv.reader(lines, delimiter=delimiter) if any(cell.strip() for cell in row)]
    except FileNotFoundError as exc:
        raise DatasetLayoutError(f"missing {path}") from exc
    except (csv.Error, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"cannot parse {path}: {exc}") from exc
    except FileTooLargeError as exc:
        raise DatasetFormatError(str(exc)) from exc
    if not rows:
        raise DatasetFormatError(f"{path} is empty; expected a header line and one line per image")
    header = [cell.strip() for cell in rows[0]]
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DatasetFormatError(
                f"{path}, line {line}: {len(row)} fields but the header has {len(header)} "
                f"(delimiter {delimiter!r})"
            )
    return header, [[cell.strip() for cell in row] for row in rows[1:]]


def _column(header: list[str], name: str, path: Path) -> int:
    if name not in header:
        raise DatasetFormatError(f"{path}: no column {name!r} (columns: {', '.join(header)})")
    return header.index(name)


def _cells(table: tuple[list[str], list[list[str]]], name: str, path: Path) -> list[str]:
    """The cells of column ``name`` of the ``(header, rows)`` read from ``path``."""
    column = _column(table[0], name, path)
    return [row[column] for row in table[1]]


class CSVDataset(MultiLabelDataset):
    """Images and labels listed in a CSV/TSV file (see the module docstring for the formats).

    Args:
        split: ``"train"`` or ``"val"``.
        root: folder the files and images are relative to.
        train_file: the training list (relative to ``root`` or absolute).
        val_file: the validation list; ``None`` to hold out ``val_fraction`` of ``train_file``.
        val_fraction: share of ``train_file`` held out for validation when there is no ``val_file``.
        val_by: ``"stratified"`` or ``"hashed"``, how that share is chosen (see the module docstring).
        val_seed: seed of that share (another seed, another split).
        image_column: column holding the image paths.
        labels_column: column of delimited class names; ``None`` for one column per class.
        label_delimiter: separator of the names in ``labels_column``.
        classes: class names in their order; ``None`` to infer them.
        image_dir: folder the image paths are relative to, itself relative to ``root``.
        delimiter: the file's field delimiter; ``None`` to choose from the extension.
    """

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = ".",
        train_file: str = "train.csv",
        val_file: str | None = None,
        val_fraction: float = 0.1,
        val_by: str = "stratified",
        val_seed: int = 0,
        image_column: str = "image",
        labels_column: str | None = "labels",
        label_delimiter: str = " ",
        classes: Sequence[str] | None = None,
        image_dir: str = "",
        delimiter: str | None = None,
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("csv split", split, SPLITS)
        layout = (
            f"{root}/{train_file} with columns {image_column!r} and labels, images under {root}/{image_dir}"
        )
        source = "val" if split == "val" and val_file else "train"
        # A test list with the model's classes (mlcls-eval) is read alone: the training file may be gone.
        # Training with a validation file reads both, to refuse an image listed in both.
        needed = {"train", "val"} if val_file and (classes is None or split == "train") else {source}
        files = {"train": train_file, "val": val_file}
        require_files(root, [files[key] for key in sorted(needed)], layout)
        if not val_file and not 0.0 <= val_fraction < 1.0:
            raise DatasetConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
        check_choice("dataset.val_by", val_by, VAL_BY)

        paths = {key: resolve_path(root, files[key]) for key in sorted(needed)}
        tables = {key: read_table(path, delimiter) for key, path in paths.items()}

        if classes is not None:
            self.classes = check_class_names(list(classes), "dataset.classes")
        else:
            if labels_column is None:
                header = [name for name in tables["train"][0] if name != image_column]
                self.classes = check_class_names(header, f"{paths['train']} (its header)")
            else:
                self.classes = _infer_names(tables, paths, labels_column, label_delimiter)
            warn_case_variants(self.classes, paths["train"])
        if not self.classes:
            raise DatasetFormatError(f"{paths[source]}: no classes found")

        header, rows = tables[source]
        if labels_column is None:
            labels = _one_hot_labels(header, rows, self.classes, paths[source])
        else:
            labels = _named_labels(
                header,
                rows,
                labels_column,
                label_delimiter,
                self.classes,
                paths[source],
                list(paths.values()),
            )
        image_root = str(resolve_path(root, image_dir))
        listed = {key: _cells(table, image_column, paths[key]) for key, table in tables.items()}
        keys = {key: [image_key(image_root, image) for image in images] for key, images in listed.items()}
        if len(listed) == 2 and not paths["train"].samefile(paths["val"]):  # one file: seen images on purpose
            check_disjoint(listed, keys, paths)
        kept = unique_rows(listed[source], keys[source], labels, paths[source])
        labels, written = labels[kept], [listed[source][i] for i in kept]
        images = [os.path.join(image_root, image) for image in written]  # an absolute path stays as it is

        if not val_file:
            chosen = self._val_rows(written, labels, val_fraction, val_by, val_seed, split)
            labels, images = labels[chosen], [images[i] for i in chosen]
            if split == "val":
                warn_few_positives(labels, self.classes, val_fraction)
        if not images:
            raise DatasetFormatError(f"{paths[source]}: the {split} split is empty")
        if not Path(images[0]).exists():
            raise DatasetLayoutError(
                f"missing {images[0]} (first image of {paths[source]}); expected: {layout}"
            )
        self.labels = torch.from_numpy(labels)
        self.samples = [Sample(path) for path in images]

    @staticmethod
    def _val_rows(
        images: list[str], labels: np.ndarray, val_fraction: float, val_by: str, seed: int, split: str
    ) -> np.ndarray:
        """Indices of the rows of ``split``: those held out for validation (``val``) or not (``train``), by
        :func:`stratified_holdout` of ``labels`` or by :func:`held_out` of each image path (``val_by``).
        When the hash holds out no image (a file of a few rows), the image of smallest :func:`image_hash`
        is, so that validation is never empty."""
        if val_fraction == 0:
            if split == "val":
                raise DatasetConfigError(
                    "the csv dataset has no validation data: set dataset.val_file or dataset.val_fraction > 0"
                )
            return np.arange(len(images))
        if val_by == "stratified":
            in_val = stratified_holdout(labels, val_fraction, seed)
        else:
            hashes = [image_hash(image, seed) for image in images]
            in_val = np.array([held_out(image, val_fraction, seed) for image in images], dtype=bool)
            if not in_val.any():
                in_val = np.array(hashes) == min(hashes)
        return np.flatnonzero(in_val if split == "val" else ~in_val)


def image_key(image_root: str, image: str) -> str:
    """The image a CSV cell names: ``image`` (as written) joined to ``image_root`` (an absolute path stays as
    it is), made absolute and normalised (``.``, ``..`` and repeated separators removed; lexically, without
    reading the file system: symbolic links are not followed)."""
    return os.path.abspath(os.path.join(image_root, image))


def unique_rows(images: Sequence[str], keys: Sequence[str], labels: np.ndarray, path: Path) -> np.ndarray:
    """Indices of the rows to keep: the first of each image (its :func:`image_key` ``keys[i]``; ``images``
    as written), the repeats of an image with the same labels dropped; an image listed again with other
    labels raises :class:`DatasetFormatError` naming its lines (line 2 is the first row below the header)."""
    first: dict[str, int] = {}
    kept = []
    for i, key in enumerate(keys):
        if key not in first:
            first[key] = i
            kept.append(i)
        elif not np.array_equal(labels[i], labels[first[key]]):
            j = first[key]
            spelled = "" if images[i] == images[j] else f" (line {i + 2} writes it {images[i]!r})"
            raise DatasetFormatError(
                f"{path}, lines {j + 2} and {i + 2}: image {images[j]!r} is listed twice{spelled} with "
                "other labels; list each image once, with all its labels"
            )
    if len(kept) < len(images):
        log.warning(
            "%s: %s listed more than once with the same labels, counted once",
            path,
            plural(len(images) - len(kept), "repeated image row"),
        )
    return np.array(kept, dtype=np.int64)


def check_disjoint(listed: dict[str, list[str]], keys: dict[str, list[str]], paths: dict[str, Path]) -> None:
    """Warn once, naming the first pair of lines, when images are listed in both the training and the
    validation file (however their paths are written): their validation scores are of images the model
    trained on. A warning, not an error: scoring seen images can be deliberate (a sanity check).
    ``listed`` holds each file's image cells as written, ``keys`` their :func:`image_key`."""
    train_lines = {key: line for line, key in enumerate(keys["train"], start=2)}
    shared = [
        (line, image, train_lines[key])
        for line, (image, key) in enumerate(zip(listed["val"], keys["val"], strict=True), start=2)
        if key in train_lines
    ]
    if shared:
        line, image, train_line = shared[0]
        log.warning(
            "%s: %s also in the training file %s, e.g. line %d %r (line %d there, as %r): validation "
            "figures include images the model trained on",
            paths["val"],
            "1 image is" if len(shared) == 1 else f"{len(shared)} images are",
            paths["train"],
            line,
            image,
            train_line,
            listed["train"][train_line - 2],
        )


def warn_case_variants(classes: Sequence[str], path: Path) -> None:
    """Warn when class names differ only in case (``Cat`` and ``cat``): they are separate classes."""
    variants: dict[str, list[str]] = {}
    for name in classes:
        variants.setdefault(name.casefold(), []).append(name)
    clashes = [" and ".join(names) for names in variants.values() if len(names) > 1]
    if clashes:
        log.warning(
            "%s: class names that differ only in case are separate classes: %s; write them alike if they "
            "are one class",
            path,
            "; ".join(clashes),
        )


def warn_few_positives(labels: np.ndarray, classes: Sequence[str], val_fraction: float) -> None:
    """Warn once, naming them, about the classes with 1 to ``MIN_VAL_POSITIVES - 1`` positives in the
    held-out validation split ``labels`` (N, C): their AP and calibrated threshold rest on a few images.
    (A class without any is reported by the trainer as unscored.)"""
    positives = (labels == 1).sum(axis=0)
    few = [
        (name, int(count))
        for name, count in zip(classes, positives, strict=True)
        if 0 < count < MIN_VAL_POSITIVES
    ]
    if few:
        listed = ", ".join(f"{printable(name)} {count}" for name, count in few[:20]) + (
            ", ..." if len(few) > 20 else ""
        )
        log.warning(
            "the validation split held out of the training file (dataset.val_fraction=%g, %s) has fewer "
            "than %d positives of %s (%s): their AP and per-class thresholds are noise; hold out more with "
            "dataset.val_fraction or give a validation list with dataset.val_file",
            val_fraction,
            plural(len(labels), "image"),
            MIN_VAL_POSITIVES,
            f"{len(few)} class{'es' if len(few) > 1 else ''}",
            listed,
        )


def _split_names(cell: str, label_delimiter: str) -> list[str]:
    return [name.strip() for name in cell.split(label_delimiter) if name.strip()]


def _infer_names(
    tables: dict[str, tuple[list[str], list[list[str]]]],
    paths: dict[str, Path],
    labels_column: str,
    label_delimiter: str,
) -> list[str]:
    """Sorted class names found in the labels column of every file."""
    names: set[str] = set()
    for key, (header, rows) in tables.items():
        column = _column(header, labels_column, paths[key])
        for row in rows:
            names.update(_split_names(row[column], label_delimiter))
    return sorted(names)


def _named_labels(
    header: list[str],
    rows: list[list[str]],
    labels_column: str,
    label_delimiter: str,
    classes: list[str],
    path: Path,
    read: list[Path],
) -> np.ndarray:
    """(rows, C) float32: 1 for the names listed in ``labels_column``, 0 elsewhere; refused before it is
    allocated when it would take more than :func:`label_table` allows for the files ``read``."""
    column = _column(header, labels_column, path)
    class_index = {name: i for i, name in enumerate(classes)}
    row_ids: list[int] = []
    col_ids: list[int] = []
    for i, row in enumerate(rows):
        for name in _split_names(row[column], label_delimiter):
            if name not in class_index:
                raise DatasetFormatError(
                    f"{path}, line {i + 2}: label {name!r} is not one of the given classes"
                )
            row_ids.append(i)
            col_ids.append(class_index[name])
    labels = label_table(len(rows), len(classes), read, path)
    labels[np.array(row_ids, int), np.array(col_ids, int)] = 1.0
    return labels


def _one_hot_labels(header: list[str], rows: list[list[str]], classes: list[str], path: Path) -> np.ndarray:
    """(rows, C) float32 from one column per class: 1 / 0 / -1, an empty cell meaning -1."""
    columns = [_column(header, name, path) for name in classes]
    cells = np.array([[row[c] for c in columns] for row in rows], dtype=object).reshape(
        len(rows), len(classes)
    )
    cells[cells == ""] = "-1"
    try:
        labels = cells.astype(np.float32)
        valid = np.isin(labels, (1.0, 0.0, -1.0)).all()
    except ValueError:
        valid = False
    if not valid:
        for (line, col), cell in np.ndenumerate(cells):
            if cell not in ("1", "0", "-1") and not _is_label_number(cell):
                raise DatasetFormatError(
                    f"{path}, line {line + 2}: column {classes[col]!r} holds {cell!r}; "
                    "expected 1, 0, -1 or nothing"
                )
    return labels


def _is_label_number(cell: str) -> bool:
    try:
        return float(cell) in (1.0, 0.0, -1.0)
    except ValueError:
        return False
