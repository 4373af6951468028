"""The user's own images and labels, listed in a CSV or TSV file (docs/datasets.md, "Your own data").

A column of names (``labels_column``): listed names 1, other classes 0. One column per class
(``labels_column: null``): 1, 0, -1 or empty (unknown).
Without ``val_file``, about ``val_fraction`` of the training file is held out, ``val_by``
``stratified`` (:func:`stratified_holdout`: each class keeps about its share of positives; appending rows
can move images) or ``hashed`` (:func:`held_out`: by each path as written, so appending moves none). An
image is known by its path joined to ``root / image_dir`` and normalised: repeats with the same labels
count once, with other labels they are an error; one in both files, a class left fewer than
``MIN_VAL_POSITIVES`` held-out positives and names differing only in case are warned about.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from mlcls.data.datasets.base import (
    DatasetConfigError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
    check_choice,
    check_class_names,
    label_table,
    reading,
    require_files,
    resolve_path,
)
from mlcls.data.datasets.folds import DEFAULT_VAL_FRACTION, VAL_BY, hashed_holdout, stratified_holdout
from mlcls.errors import plural, printable
from mlcls.io import CAPS, open_regular

SPLITS = ("train", "val")
# A class with fewer validation positives than this in a held-out split is named in a warning.
MIN_VAL_POSITIVES = 5
# The longest line read (an image's path and its labels): a file with no line break is refused at this length.
MAX_LINE_CHARS = 2**24

log = logging.getLogger("mlcls")


def _lines(file: IO[str], path: Path) -> Iterator[str]:
    """The lines of the open text ``file``, each at most :data:`MAX_LINE_CHARS` characters (else one
    :class:`DatasetFormatError` line): a file with no line break is never held whole."""
    for number, line in enumerate(iter(lambda: file.readline(MAX_LINE_CHARS + 1), ""), start=1):
        if len(line) > MAX_LINE_CHARS:
            raise DatasetFormatError(
                f"{path}, line {number}: over {MAX_LINE_CHARS} characters; expected one image's row per line"
            )
        yield line


def read_table(path: Path, delimiter: str | None) -> tuple[list[str], list[list[str]]]:
    """Header and rows (blank lines skipped) of a delimited UTF-8 text file of at most
    ``CAPS["label file"]`` bytes, parsed as it is read: what it holds is its rows."""
    if delimiter is None:
        delimiter = "\t" if path.suffix.lower() in (".tsv", ".tab") else ","
    with (
        reading(path),
        open_regular(
            path, "r", max_bytes=CAPS["label file"], what="label file", encoding="utf-8-sig", newline=""
        ) as file,
    ):
        rows = [
            row
            for row in csv.reader(_lines(file, path), delimiter=delimiter)
            if any(cell.strip() for cell in row)
        ]
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


def _cells(header: list[str], rows: list[list[str]], name: str, path: Path) -> list[str]:
    """The cells of column ``name`` of the table read from ``path``."""
    if name not in header:
        raise DatasetFormatError(f"{path}: no column {name!r} (columns: {', '.join(header)})")
    column = header.index(name)
    return [row[column] for row in rows]


class CSVDataset(MultiLabelDataset):
    """Images and labels listed in a CSV/TSV file; the keys are ``configs/dataset/csv.yaml``'s
    (docs/datasets.md). ``classes`` None: the sorted names of the files' labels column, or the class
    columns in header order; ``delimiter`` None: tab for ``.tsv``/``.tab``, else comma."""

    @classmethod
    def cuts_validation(cls, keys: Any) -> bool:
        """Without ``val_file`` the validation split is ``val_fraction`` of the training file."""
        return not keys.get("val_file")

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = ".",
        train_file: str = "train.csv",
        val_file: str | None = None,
        val_fraction: float | None = None,
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
        val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
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
                names: set[str] = set()
                for key, (header, rows) in tables.items():
                    for cell in _cells(header, rows, labels_column, paths[key]):
                        names.update(_split_names(cell, label_delimiter))
                self.classes = sorted(names)
            warn_case_variants(self.classes, paths["train"])
        if not self.classes:
            raise DatasetFormatError(f"{paths[source]}: no classes found")

        labels = _labels(*tables[source], self.classes, paths[source], labels_column, label_delimiter, paths)
        image_root = str(resolve_path(root, image_dir))
        listed = {key: _cells(*table, image_column, paths[key]) for key, table in tables.items()}
        # An image's key: its path joined to image_root, made absolute and normalised lexically (symbolic
        # links are not followed).
        keys = {
            key: [os.path.abspath(os.path.join(image_root, i)) for i in images]
            for key, images in listed.items()
        }
        if len(listed) == 2 and not paths["train"].samefile(paths["val"]):  # one file: seen images on purpose
            check_disjoint(listed, keys, paths)
        kept = unique_rows(listed[source], keys[source], labels, paths[source])
        labels, written = labels[kept], [listed[source][i] for i in kept]
        images = [os.path.join(image_root, image) for image in written]  # an absolute path stays as it is

        if not val_file and val_fraction == 0 and split == "val":
            raise DatasetConfigError(
                "the csv dataset has no validation data: set dataset.val_file or dataset.val_fraction > 0"
            )
        if not val_file and val_fraction > 0:
            if val_by == "stratified":
                in_val = stratified_holdout(labels, val_fraction, val_seed)
            else:
                in_val = hashed_holdout(written, val_fraction, val_seed)
            chosen = np.flatnonzero(in_val if split == "val" else ~in_val)
            labels, images = labels[chosen], [images[i] for i in chosen]
            if split == "val":
                warn_few_positives(labels, self.classes, val_fraction)
        if not images:
            raise DatasetFormatError(f"{paths[source]}: the {split} split is empty")
        if not Path(images[0]).exists():
            raise DatasetLayoutError(
                f"missing {images[0]} (first image of {paths[source]}); expected: {layout}"
            )
        self.labels = labels
        self.samples = [Sample(path) for path in images]


def unique_rows(images: Sequence[str], keys: Sequence[str], labels: np.ndarray, path: Path) -> np.ndarray:
    """Indices of the rows to keep: the first of each image (``keys[i]``; ``images`` as written), its
    repeats with the same labels dropped; with other labels, a :class:`DatasetFormatError` naming the
    lines."""
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
    """Warn once, naming the first pair of lines, about images (``keys``; ``listed`` as written) in both the
    training and the validation file. Not an error: scoring seen images can be deliberate."""
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
    """Warn once about the classes with 1 to ``MIN_VAL_POSITIVES - 1`` positives in the held-out split
    ``labels`` (N, C): their AP and threshold rest on a few images (the trainer reports those with none)."""
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


def _labels(
    header: list[str],
    rows: list[list[str]],
    classes: list[str],
    path: Path,
    labels_column: str | None,
    label_delimiter: str,
    read: dict[str, Path],
) -> np.ndarray:
    """float32 (rows, C) of the file ``path``: 1 for the names of ``labels_column``, 0 elsewhere (refused
    before it is allocated when larger than :func:`label_table` allows for the files ``read``); or, with no
    labels column, one column per class, 1 / 0 / -1, an empty cell -1."""
    if labels_column is not None:
        class_index = {name: i for i, name in enumerate(classes)}
        cells = _cells(header, rows, labels_column, path)
        labels = label_table(len(rows), len(classes), list(read.values()), path)
        for i, cell in enumerate(cells):
            for name in _split_names(cell, label_delimiter):
                if name not in class_index:
                    raise DatasetFormatError(
                        f"{path}, line {i + 2}: label {name!r} is not one of the given classes"
                    )
                labels[i, class_index[name]] = 1.0
        return labels
    cells = np.array([_cells(header, rows, name, path) for name in classes], dtype=object).T
    cells[cells == ""] = "-1"
    try:
        labels = cells.astype(np.float32)
        valid = np.isin(labels, (1.0, 0.0, -1.0)).all()
    except ValueError:
        valid = False
    if not valid:
        for (line, col), cell in np.ndenumerate(cells):
            try:
                number = float(cell) in (1.0, 0.0, -1.0)
            except ValueError:
                number = False
            if not number:
                raise DatasetFormatError(
                    f"{path}, line {line + 2}: column {classes[col]!r} holds {cell!r}; "
                    "expected 1, 0, -1 or nothing"
                )
    return labels
