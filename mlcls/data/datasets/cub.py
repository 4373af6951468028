"""CUB-200-2011 attributes: 11,788 bird images, the 312 binary attributes as classes (layout:
docs/datasets.md). As Cole et al.'s ``preproc/format_cub.py`` (single-positive benchmark, CVPR 2021, commit
30ce86cb): labels ``is_present`` (1 / 0); like its ``read_csv(usecols=...)``, the first three fields of a
line of ``image_attribute_labels.txt`` are read and any others ignored (a few official lines hold more than
five); no image is dropped.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlcls.data.datasets.base import (
    DatasetFormatError,
    MultiLabelDataset,
    Sample,
    check_choice,
    first_file,
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
    """The ids and values of a ``"<id> <value>"`` file, in file order, blank lines skipped."""
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


def read_attribute_labels(path: Path, image_ids: list[int]) -> np.ndarray:
    """float32 (N, 312): ``is_present`` of image ``image_ids[i]`` and attribute ``j + 1`` at ``[i, j]``.

    NumPy reads the official 3.7 million lines in about half a second; a file it refuses, or that breaks a
    rule, is read again by :func:`read_labels_by_line` (ten times slower), which names the line at fault."""
    try:
        with (
            open_regular(path, "r", max_bytes=CAPS["label file"], encoding="utf-8") as f,
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", UserWarning)  # an empty file: the line reader says so
            table = np.loadtxt(f, dtype=np.int64, usecols=(0, 1, 2), comments=None, ndmin=2)
    except (ValueError, UnicodeDecodeError):
        return read_labels_by_line(path, image_ids)
    if not image_ids or table.shape[1:] != (3,):
        return read_labels_by_line(path, image_ids)
    ids = np.asarray(image_ids, dtype=np.int64)
    order = np.argsort(ids)
    image_id, attribute_id, present = table.T
    rows = order[np.minimum(np.searchsorted(ids, image_id, sorter=order), len(ids) - 1)]
    valid = (ids[rows] == image_id) & (attribute_id >= 1) & (attribute_id <= NUM_ATTRIBUTES)
    valid &= (present == 0) | (present == 1)
    cells = rows * NUM_ATTRIBUTES + attribute_id - 1
    # A line that breaks a rule of the line reader, or a pair missing or repeated: it names the line.
    if not valid.all() or (np.bincount(cells, minlength=len(ids) * NUM_ATTRIBUTES) != 1).any():
        return read_labels_by_line(path, image_ids)
    labels = np.zeros(len(ids) * NUM_ATTRIBUTES, dtype=np.float32)
    labels[cells] = present
    return labels.reshape(len(ids), NUM_ATTRIBUTES)


def read_labels_by_line(path: Path, image_ids: list[int]) -> np.ndarray:
    """:func:`read_attribute_labels` line by line: one :class:`DatasetFormatError` line naming the first line
    at fault (or the first pair without a line)."""
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
            if row is None:
                problem = f"image_id {image_id} is not in images.txt"
            elif not 1 <= attribute_id <= NUM_ATTRIBUTES:
                problem = f"attribute_id {attribute_id} is outside 1..{NUM_ATTRIBUTES}"
            elif present not in (0, 1):
                problem = f"is_present {present}; expected 0 or 1"
            elif seen[row, attribute_id - 1]:
                problem = f"image_id {image_id}, attribute_id {attribute_id} was given before; expected one "
                problem += "line each"
            else:
                seen[row, attribute_id - 1] = True
                labels[row, attribute_id - 1] = present
                continue
            raise DatasetFormatError(f"{path}, line {number}: {line.strip()!r}: {problem}")
    if not seen.all():
        row, column = np.argwhere(~seen)[0].tolist()
        raise DatasetFormatError(
            f"{path}: no line for image_id {image_ids[row]}, attribute_id {column + 1}; expected one line "
            f"per image of images.txt and attribute ({len(image_ids)} x {NUM_ATTRIBUTES})"
        )
    return labels


class CUB(MultiLabelDataset):
    """CUB-200-2011's 312 attributes with the official train/test split, as Cole et al. format them."""

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
        attribute_list = first_file(root_path, ATTRIBUTE_LISTS, layout)
        attribute_ids, self.classes = read_id_table(attribute_list)
        if attribute_ids != list(range(1, NUM_ATTRIBUTES + 1)):
            raise DatasetFormatError(
                f"{attribute_list}: {len(attribute_ids)} attributes; expected the {NUM_ATTRIBUTES} "
                f"attributes with ids 1..{NUM_ATTRIBUTES} in order, one '<attribute_id> <name>' a line"
            )
        image_ids, paths = read_id_table(root_path / IMAGE_LIST)
        seen: set[int] = set()
        for image_id in image_ids:
            if image_id in seen:
                raise DatasetFormatError(
                    f"{root_path / IMAGE_LIST}: image_id {image_id} is listed twice; expected one line per "
                    "image"
                )
            seen.add(image_id)
        # Each label line takes MIN_LABEL_LINE bytes at least, so the tables of read_attribute_labels (about
        # 60 bytes per image and attribute) stay within ten times the label file's size, whatever
        # images.txt lists.
        label_file = root_path / LABEL_FILE
        size, needed = os.stat(label_file).st_size, len(image_ids) * NUM_ATTRIBUTES * MIN_LABEL_LINE - 1
        if size < needed:  # (the last line may lack its newline)
            raise DatasetFormatError(
                f"{label_file} is {size} bytes; {len(image_ids)} images x {NUM_ATTRIBUTES} attributes need "
                f"at least {needed} (one line of {LABEL_FORMAT} each)"
            )
        split_ids, flags = read_id_table(root_path / SPLIT_LIST)
        flag_of = dict(zip(split_ids, flags, strict=True))
        for image_id in image_ids:
            if flag_of.get(image_id) not in ("0", "1"):
                found = "no line" if image_id not in flag_of else f"{flag_of[image_id]!r}"
                raise DatasetFormatError(
                    f"{root_path / SPLIT_LIST}: image_id {image_id} has {found}; expected '<image_id> "
                    "<1 train | 0 test>' for every image of images.txt"
                )
        keep = np.array([int(flag_of[image_id]) == SPLITS[split] for image_id in image_ids], dtype=bool)
        self.labels = read_attribute_labels(label_file, image_ids)[keep]
        folder = os.path.join(root, FOLDER, "images")
        self.samples = [Sample(os.path.join(folder, paths[i])) for i in np.flatnonzero(keep).tolist()]
