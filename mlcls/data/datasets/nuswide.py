"""NUS-WIDE: 269,648 Flickr images, 81 concepts (the release's ``TrainTestLabels``; layout:
docs/datasets.md). Image paths: ``\\`` becomes ``/`` and a prefix up to a ``Flickr`` folder is dropped.
Images without a positive are dropped unless ``keep_empty``.

``label_set=zero_shot`` (``dataset=nuswide_zsl``): LESA's split (Huynh & Elhamifar, CVPR 2020), as in
ML-Decoder's zero-shot table: the 925 tags of ``NUS_WID_Tags/TagList1k.txt`` that are no concept, then the
81 concepts; ``train`` keeps the images with a positive seen tag (ML-Decoder's ``get_relevant_samples``),
``test`` those with any positive; ``keep_empty`` keeps every image of both (LESA's). Which test images the
ZSL figures score is the evaluation's choice (``metrics.zsl_images``, :mod:`mlcls.metrics.zero_shot`).
"""

from __future__ import annotations

import os
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
    reading,
    require_files,
    resolve_path,
)
from mlcls.io import CAPS, read_regular_bytes, read_text

SPLITS = {"train": "Train", "test": "Test"}
NUM_CONCEPTS = 81
CONCEPT_LISTS = ("ConceptsList/Concepts81.txt", "Concepts81.txt")
LABEL_DIR = "Groundtruth/TrainTestLabels"
# label_set: the 81 concepts (the release's ground truth), or the zero-shot split's 925 tags + 81 concepts
LABEL_SETS = ("concepts", "zero_shot")
TAG_DIR = "NUS_WID_Tags"
TAG_LIST = f"{TAG_DIR}/TagList1k.txt"
NUM_TAGS = 1000
# The bytes a tag file may hold between its values; lines checked at once (about 16 MB of the release's).
TAG_LINES_AT_ONCE = 8192
_WHITESPACE = np.frombuffer(b" \t\r\n", dtype=np.uint8)


def read_names(path: Path, count: int, what: str) -> list[str]:
    """The ``count`` distinct names of the class list ``path``, one a line, in file order."""
    names = read_text(path, "class list", errors="replace").split()
    if len(names) != count or len(set(names)) != count:
        raise DatasetFormatError(
            f"{path}: {len(names)} names ({len(set(names))} distinct); expected the {count} distinct {what} "
            "names, one a line"
        )
    return names


def image_path(line: str) -> str:
    """A line of an image list as a path relative to the ``Flickr/`` folder: ``actor/0001_2124494179.jpg``."""
    parts = [part for part in line.strip().replace("\\", "/").split("/") if part]
    folders = [i for i, part in enumerate(parts) if part.lower() == "flickr"]
    return "/".join(parts[folders[-1] + 1 :] if folders else parts)


def read_tag_matrix(path: Path, count: int) -> np.ndarray:
    """uint8 (``count``, 1000) of a ``<Split>_Tags1k.dat`` file: ``count`` non-empty lines of 1,000 values 0
    or 1 separated by whitespace; else one dataset error line naming the line. Lines of equal length (all
    2,000 bytes in the release) are checked together, :data:`TAG_LINES_AT_ONCE` at a time."""
    with reading(path, "one tag file per split"):
        data = read_regular_bytes(path, CAPS["label file"], "label file")
    lines = [line for line in data.split(b"\n") if line.strip()]
    if len(lines) != count:
        raise DatasetFormatError(f"{path}: {len(lines)} lines; expected {count}, one per image of the list")
    matrix = np.empty((count, NUM_TAGS), dtype=np.uint8)
    by_length: dict[int, list[int]] = {}
    for row, line in enumerate(lines):
        by_length.setdefault(len(line), []).append(row)
    blocks = [
        rows[i : i + TAG_LINES_AT_ONCE]
        for rows in by_length.values()
        for i in range(0, len(rows), TAG_LINES_AT_ONCE)
    ]
    for rows in blocks:
        block = np.frombuffer(b"".join(lines[row] for row in rows), dtype=np.uint8).reshape(len(rows), -1)
        digit = (block == ord("0")) | (block == ord("1"))
        bad = ~(digit | np.isin(block, _WHITESPACE)) | (digit[:, 1:] & digit[:, :-1]).any(1, keepdims=True)
        wrong = bad.any(1) | (digit.sum(1) != NUM_TAGS)
        if wrong.any():
            first = rows[int(np.flatnonzero(wrong)[0])]
            raise DatasetFormatError(
                f"{path}: line {first + 1} does not hold {NUM_TAGS} values 0 or 1 separated by whitespace"
            )
        matrix[rows] = (block[digit] - ord("0")).reshape(len(rows), NUM_TAGS)
    return matrix


class NUSWIDE(MultiLabelDataset):
    """NUS-WIDE with the release's train/test split; ``images``: the image folder (relative to ``root`` or
    absolute); ``label_set``: ``concepts`` or ``zero_shot``."""

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = "data/nuswide",
        images: str = "Flickr",
        keep_empty: bool = False,
        label_set: str = "concepts",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("NUS-WIDE split", split, tuple(SPLITS))
        check_choice("NUS-WIDE label_set", label_set, LABEL_SETS)
        part = SPLITS[split]
        layout = (
            f"{root}/{{ConceptsList/Concepts81.txt, ImageList/{part}Imagelist.txt, "
            f"{LABEL_DIR}/Labels_<concept>_{part}.txt, {images}/<folder>/<file>.jpg}}"
        )
        list_file = f"ImageList/{part}Imagelist.txt"
        require_files(root, [list_file], layout)
        root_path = Path(root)
        concepts = read_names(first_file(root_path, CONCEPT_LISTS, layout), NUM_CONCEPTS, "concept")
        lines = read_text(root_path / list_file, "label file", errors="replace").splitlines()
        paths = [image_path(line) for line in lines if line.strip()]
        labels = np.empty((len(paths), len(concepts)), dtype=np.float32)
        for column, concept in enumerate(concepts):  # a file of one 0 or 1 a line per concept
            path = root_path / LABEL_DIR / f"Labels_{concept}_{part}.txt"
            with reading(path, "one label file per concept and split"):
                tokens = read_regular_bytes(path, CAPS["label file"], "label file").split()
            values = np.frombuffer(b"".join(tokens), dtype=np.uint8) - ord("0")
            if len(tokens) != len(paths) or len(values) != len(paths) or (values > 1).any():
                raise DatasetFormatError(
                    f"{path}: {len(tokens)} lines; expected {len(paths)} lines (one per image of the list), "
                    "each 0 or 1"
                )
            labels[:, column] = values
        keep = labels.any(axis=1)
        if label_set == "zero_shot":
            with reading(root_path / TAG_LIST, "the release's NUS_WID_Tags folder"):
                tags = read_names(root_path / TAG_LIST, NUM_TAGS, "tag")
            seen = [j for j, tag in enumerate(tags) if tag not in set(concepts)]
            seen_labels = read_tag_matrix(root_path / TAG_DIR / f"{part}_Tags1k.dat", len(paths))[:, seen]
            concepts = [tags[j] for j in seen] + concepts
            labels = np.concatenate([seen_labels.astype(np.float32), labels], axis=1)
            keep = seen_labels.any(axis=1) if split == "train" else labels.any(axis=1)
        self.classes = concepts
        keep = np.ones(len(paths), dtype=bool) if keep_empty else keep
        self.labels = labels[keep]
        folder = str(resolve_path(root, images))
        self.samples = [Sample(os.path.join(folder, paths[i])) for i in np.flatnonzero(keep).tolist()]
