"""CUB-200-2011 attributes: 11,788 bird images, the 312 binary attributes as the classes.

Layout (as ``CUB_200_2011.tgz`` unpacks: ``attributes.txt`` beside the ``CUB_200_2011/`` folder)::

    root/attributes.txt                     "<attribute_id> <name>", ids 1..312 in order
                                            (root/CUB_200_2011/attributes/attributes.txt is read too)
    root/CUB_200_2011/images.txt            "<image_id> <relative path>"
    root/CUB_200_2011/train_test_split.txt  "<image_id> <is_training_image>": 1 train, 0 test
    root/CUB_200_2011/attributes/image_attribute_labels.txt
                                            "<image_id> <attribute_id> <is_present> <certainty_id> <time>",
                                            one line per image and attribute
    root/CUB_200_2011/images/<class folder>/<file>.jpg

The labels follow Cole et al.'s formatting script for the single-positive benchmark (CVPR 2021;
``preproc/format_cub.py`` of github.com/elijahcole/single-positive-multi-label, commit
30ce86cbd1df53d7f18307a98db55896e184d633):

* classes: the 312 names of ``attributes.txt``, in file order (column ``attribute_id - 1``);
* labels: ``is_present`` as it is, 1 positive and 0 negative; ``certainty_id`` and ``time`` are not read
  (the script keeps only ``attribute_id`` and ``is_present``). CUB has no unknown labels;
* malformed lines: the official file has a few lines with more than five fields. The script reads it with
  pandas' ``read_csv(..., usecols=[attribute_id, is_present])``, which takes the first fields of such a line
  and ignores the extra ones; mlcls does the same: the first three fields of every line are read, the
  others ignored. A line with fewer than three integer fields, an ``is_present`` other than 0 or 1, an
  unknown image or attribute id, a pair given twice or missing is a one-line error naming the file (and
  the line);
* splits: ``train`` = the images flagged 1 in ``train_test_split.txt`` (5,994), ``test`` = those flagged 0
  (5,794), each in the order of ``images.txt``; every image is kept, with or without a positive attribute
  (the script drops none). The script's validation split is carved from ``train`` by its training code;
  mlcls evaluates on ``test``, the benchmark's test set, and selects the epoch on a share of ``train``
  (``dataset.holdout_fraction``).

The script places the rows by position (line ``312 * i + j`` is image ``i``, attribute ``j``); mlcls places
them by their ``image_id`` and ``attribute_id``, the same on the official file, whose lines are in that order.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlcls.data.datasets.base import (
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
    check_choice,
    require_files,
)
from mlcls.io import CAPS, open_regular, read_text

SPLITS = {"train": 1, "test": 0}  # the split's flag in train_test_split.txt
NUM_ATTRIBUTES = 312
FOLDER = "CUB_200_2011"
ATTRIBUTE_LISTS = ("attributes.txt", f"{FOLDER}/attributes/attributes.txt")
IMAGE_LIST = f"{FOLDER}/images.txt"
SPLIT_LIST = f"{FOLDER}/train_test_split.txt"
LABEL_FILE = f"{FOLDER}/attributes/image_attribute_labels.txt"
LABEL_FORMAT = "'<image_id> <attribute_id> <is_present> <certainty_id> <time>'"
MIN_LABEL_LINE = len("1 1 0\n")  # the shortest line of image_attribute_labels.txt, in bytes


def read_id_table(path: Path) -> tuple[list[int], list[str]]:
    """The ids and values of a ``"<id> <value>"`` file (``images.txt``, ``attributes.txt``, ...), in file
    order; blank lines are skipped, a line without an integer id and a value is a one-line dataset error."""
    ids: list[int] = []
    values: list[str] = []
    text = read_text(path, "label file", errors="replace")
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split(maxsplit=1)
        if not fields:
            continue
        if len(fields) != 2 or not fields[0].isdigit():
            raise DatasetFormatError(f"{path}, line {number}: {line.strip()!r}; expected '<id> <value>'")
        ids.append(int(fields[0]))
        values.append(fields[1].strip())
    return ids, values


def read_attribute_names(root: Path, layout: str) -> list[str]:
    """The 312 attribute names of the first of :data:`ATTRIBUTE_LISTS` under ``root``, ordered by id, the
    ids numbering them 1..312 in file order."""
    found = [root / name for name in ATTRIBUTE_LISTS if (root / name).is_file()]
    if not found:
        raise DatasetLayoutError(f"missing {root / ATTRIBUTE_LISTS[0]}; expected layout: {layout}")
    ids, names = read_id_table(found[0])
    if ids != list(range(1, NUM_ATTRIBUTES + 1)):
        raise DatasetFormatError(
            f"{found[0]}: {len(ids)} attributes; expected the {NUM_ATTRIBUTES} attributes with ids "
            f"1..{NUM_ATTRIBUTES} in order, one '<attribute_id> <name>' a line"
        )
    return names


def read_split_flags(path: Path, image_ids: list[int]) -> np.ndarray:
    """int (N,) flags of ``train_test_split.txt`` (1 train, 0 test), aligned with ``image_ids``; an image
    without a flag, or a flag other than 0 or 1, is a one-line dataset error."""
    ids, flags = read_id_table(path)
    by_id = dict(zip(ids, flags, strict=True))
    for image_id in image_ids:
        flag = by_id.get(image_id)
        if flag not in ("0", "1"):
            found = "no line" if flag is None else f"{flag!r}"
            raise DatasetFormatError(
                f"{path}: image_id {image_id} has {found}; expected '<image_id> <1 train | 0 test>' for "
                "every image of images.txt"
            )
    return np.array([int(by_id[image_id]) for image_id in image_ids], dtype=np.int64)


def label_problem(
    row: int | None, image_id: int, attribute_id: int, present: int, seen: np.ndarray
) -> str | None:
    """What is wrong with a line of ``image_attribute_labels.txt`` for image row ``row`` (``None``: not in
    ``images.txt``), given the pairs ``seen`` so far; ``None`` when nothing is."""
    if row is None:
        return f"image_id {image_id} is not in images.txt"
    if not 1 <= attribute_id <= NUM_ATTRIBUTES:
        return f"attribute_id {attribute_id} is outside 1..{NUM_ATTRIBUTES}"
    if present not in (0, 1):
        return f"is_present {present}; expected 0 or 1"
    if seen[row, attribute_id - 1]:
        return f"image_id {image_id}, attribute_id {attribute_id} was given before; expected one line each"
    return None


def read_attribute_labels(path: Path, image_ids: list[int]) -> np.ndarray:
    """float32 (N, 312) of ``image_attribute_labels.txt``: ``is_present`` (1 / 0) for image ``image_ids[i]``
    and attribute ``j + 1`` at ``[i, j]``. The first three fields of a line are read and any others ignored
    (see the module docstring); every (image, attribute) pair must appear exactly once.

    NumPy's reader takes the 3.7 million lines of the official file in about half a second; a file it
    refuses, or whose values break a rule, is read again line by line (:func:`read_labels_by_line`, ten
    times slower), which names the first line at fault."""
    try:
        with (
            open_regular(path, "r", max_bytes=CAPS["label file"], encoding="utf-8") as f,
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", UserWarning)  # an empty file: the line reader says so
            table = np.loadtxt(f, dtype=np.int64, usecols=(0, 1, 2), comments=None, ndmin=2)
    except (ValueError, UnicodeDecodeError):
        return read_labels_by_line(path, image_ids)
    labels = labels_of_table(table, image_ids) if image_ids and table.shape[1:] == (3,) else None
    return read_labels_by_line(path, image_ids) if labels is None else labels


def labels_of_table(table: np.ndarray, image_ids: list[int]) -> np.ndarray | None:
    """float32 (N, 312) of the int64 (lines, 3) ``(image_id, attribute_id, is_present)`` rows, or None when
    a row breaks a rule of :func:`label_problem` or a pair is missing."""
    ids = np.asarray(image_ids, dtype=np.int64)
    order = np.argsort(ids)
    image_id, attribute_id, present = table.T
    at = np.minimum(np.searchsorted(ids, image_id, sorter=order), len(ids) - 1)
    rows = order[at]
    valid = (ids[rows] == image_id) & (attribute_id >= 1) & (attribute_id <= NUM_ATTRIBUTES)
    if not (valid & ((present == 0) | (present == 1))).all():
        return None
    cells = rows * NUM_ATTRIBUTES + attribute_id - 1
    if (np.bincount(cells, minlength=len(ids) * NUM_ATTRIBUTES) != 1).any():
        return None
    labels = np.zeros(len(ids) * NUM_ATTRIBUTES, dtype=np.float32)
    labels[cells] = present
    return labels.reshape(len(ids), NUM_ATTRIBUTES)


def read_labels_by_line(path: Path, image_ids: list[int]) -> np.ndarray:
    """:func:`read_attribute_labels` line by line, with a one-line :class:`DatasetFormatError` naming the
    first line that breaks a rule (or the first pair without a line)."""
    row_of = {image_id: row for row, image_id in enumerate(image_ids)}
    labels = np.zeros((len(image_ids), NUM_ATTRIBUTES), dtype=np.float32)
    seen = np.zeros((len(image_ids), NUM_ATTRIBUTES), dtype=bool)
    with open_regular(path, "r", max_bytes=CAPS["label file"], encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            fields = line.split(maxsplit=3)
            if not fields:
                continue
            try:
                image_id, attribute_id, present = (int(field) for field in fields[:3])
            except ValueError:
                raise DatasetFormatError(
                    f"{path}, line {number}: {line.strip()!r}; expected {LABEL_FORMAT}"
                ) from None
            row = row_of.get(image_id)
            problem = label_problem(row, image_id, attribute_id, present, seen)
            if problem is not None:
                raise DatasetFormatError(f"{path}, line {number}: {line.strip()!r}: {problem}")
            seen[row, attribute_id - 1] = True
            labels[row, attribute_id - 1] = present
    if not seen.all():
        row, column = np.argwhere(~seen)[0].tolist()
        raise DatasetFormatError(
            f"{path}: no line for image_id {image_ids[row]}, attribute_id {column + 1}; expected one line "
            f"per image of images.txt and attribute ({len(image_ids)} x {NUM_ATTRIBUTES})"
        )
    return labels


def check_distinct(image_ids: list[int], path: Path) -> None:
    """One :class:`DatasetFormatError` line naming the first image id of ``path`` listed twice (in one pass:
    time linear in the number of lines)."""
    seen: set[int] = set()
    for image_id in image_ids:
        if image_id in seen:
            raise DatasetFormatError(
                f"{path}: image_id {image_id} is listed twice; expected one line per image"
            )
        seen.add(image_id)


def check_label_file_size(path: Path, images: int) -> None:
    """Refuse, before any label table is sized, an ``image_attribute_labels.txt`` too small to hold a line
    per image and attribute: each line takes at least :data:`MIN_LABEL_LINE` bytes (``"1 1 0\n"``), so the
    tables of :func:`read_attribute_labels` (about 60 bytes per image and attribute, with NumPy's table of
    the lines) stay within about ten times the label file's size, whatever ``images.txt`` lists."""
    size = os.stat(path).st_size
    needed = images * NUM_ATTRIBUTES * MIN_LABEL_LINE - 1  # the last line may lack its newline
    if size < needed:
        raise DatasetFormatError(
            f"{path} is {size} bytes; {images} images x {NUM_ATTRIBUTES} attributes need at least {needed} "
            f"(one line of {LABEL_FORMAT} each)"
        )


class CUB(MultiLabelDataset):
    """CUB-200-2011's 312 attributes with the official train/test split, as Cole et al. format them.

    Args:
        split: ``"train"`` or ``"test"``.
        root: folder holding ``attributes.txt`` and ``CUB_200_2011/`` (in Cole et al.'s layout,
            ``data/cub/CUB_200_2011``).
    """

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = "data/cub",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("CUB split", split, tuple(SPLITS))
        layout = (
            f"{root}/{{attributes.txt, {IMAGE_LIST}, {SPLIT_LIST}, {LABEL_FILE}, "
            f"{FOLDER}/images/<class folder>/<file>.jpg}}"
        )
        require_files(root, [IMAGE_LIST, SPLIT_LIST, LABEL_FILE], layout)
        root_path = Path(root)
        self.classes = read_attribute_names(root_path, layout)
        image_ids, paths = read_id_table(root_path / IMAGE_LIST)
        check_distinct(image_ids, root_path / IMAGE_LIST)
        check_label_file_size(root_path / LABEL_FILE, len(image_ids))
        keep = read_split_flags(root_path / SPLIT_LIST, image_ids) == SPLITS[split]
        labels = read_attribute_labels(root_path / LABEL_FILE, image_ids)
        self.labels = torch.from_numpy(labels[keep])
        folder = os.path.join(root, FOLDER, "images")
        self.samples = [Sample(os.path.join(folder, paths[i])) for i in np.flatnonzero(keep).tolist()]
