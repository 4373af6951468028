"""NUS-WIDE: 269,648 Flickr images, 81 concepts (ground truth of the release's ``TrainTestLabels``).

Layout (as the release unpacks: ``NUS-WIDE.zip`` gives ``Groundtruth/`` and ``ConceptsList/``,
``ImageList.zip`` gives ``ImageList/``; the images, sent by the authors on request, unpack into ``Flickr/``)::

    root/ConceptsList/Concepts81.txt        the 81 concept names, one a line (or root/Concepts81.txt)
    root/ImageList/{Train,Test}Imagelist.txt  one image a line, e.g. ``actor\\0001_2124494179.jpg``
    root/Groundtruth/TrainTestLabels/Labels_<concept>_{Train,Test}.txt   one 0 or 1 a line, line k for
                                            image k of the split's image list
    root/Flickr/<folder>/<file>.jpg         704 folders

* classes: the concepts in the order of ``Concepts81.txt`` (alphabetical in the release);
* labels: 1 / 0 from the label files (NUS-WIDE has no unknown labels);
* image paths: Windows backslashes become ``/``, and a prefix up to a ``Flickr`` folder is dropped (the form
  ``C:\\ImageData\\Flickr\\actor\\0001_2124494179.jpg`` of ``Imagelist.txt``); then relative to ``images``;
* images without any of the 81 concepts are dropped unless ``keep_empty`` (then their row is all 0);
* images missing from the download (many Flickr URLs are dead) or unreadable: ``on_bad_image``, as for
  every dataset (``mlcls-data stats --check`` lists them).

Splits: ``train`` (161,789 images in the release's list) / ``test`` (107,859).

Zero-shot label set (``label_set=zero_shot``, ``dataset=nuswide_zsl``): the split of LESA (Huynh &
Elhamifar, CVPR 2020) that ML-Decoder's zero-shot table uses, 925 seen tags and 81 unseen concepts, read from
the release's tag files (``NUS_WID_Tags.zip``)::

    root/NUS_WID_Tags/TagList1k.txt                 the 1,000 tag names, one a line
    root/NUS_WID_Tags/{Train,Test}_Tags1k.dat        one line per image of the split's list: 1,000 values
                                                    0 or 1 separated by tabs (column j: tag j of TagList1k)

* classes: the tags of ``TagList1k.txt`` that are not concepts (925 in the release: 75 of the 1,000 tags
  are concept names), in file order, then the 81 concepts in the order of ``Concepts81.txt``;
* labels: the tag columns from ``<Split>_Tags1k.dat`` (the user tags, noisy), the concept columns from
  the 81-concept ground truth (``Groundtruth/TrainTestLabels``), as in LESA's preparation;
* images: ``train`` keeps the images with a positive seen tag (the only labels zero-shot training reads),
  ``test`` those with any positive; ``keep_empty`` keeps every image.

``dataset.unseen_classes`` (``Concepts81.txt``, in ``configs/dataset/nuswide_zsl.yaml``) then removes the
concept columns from training (:func:`mlcls.data.apply_training_policies`).
"""

from __future__ import annotations

import os
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
    resolve_path,
)
from mlcls.io import CAPS, read_regular_bytes

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


def read_concepts(root: Path, layout: str) -> list[str]:
    """The 81 concept names of the first of :data:`CONCEPT_LISTS` under ``root``, in file order."""
    found = [root / name for name in CONCEPT_LISTS if (root / name).is_file()]
    if not found:
        raise DatasetLayoutError(f"missing {root / CONCEPT_LISTS[0]}; expected layout: {layout}")
    return read_names(found[0], NUM_CONCEPTS, "concept")


def read_names(path: Path, count: int, what: str) -> list[str]:
    """The ``count`` names of the class list ``path``, one a line, in file order; another count, or a name
    given twice, is a one-line dataset error."""
    names = read_regular_bytes(path, CAPS["class list"], "class list").decode("utf-8", "replace").split()
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


def read_binary_column(path: Path, count: int) -> np.ndarray:
    """uint8 (``count``,) of a label file holding one 0 or 1 a line; a missing file, another value or another
    number of lines is a one-line dataset error."""
    try:
        tokens = read_regular_bytes(path).split()
    except FileNotFoundError as exc:
        raise DatasetLayoutError(f"missing {path}; expected one label file per concept and split") from exc
    values = np.frombuffer(b"".join(tokens), dtype=np.uint8) - ord("0")
    if len(tokens) != count or len(values) != count or (values > 1).any():
        raise DatasetFormatError(
            f"{path}: {len(tokens)} lines; expected {count} lines (one per image of the list), each 0 or 1"
        )
    return values


def read_tag_list(root: Path) -> list[str]:
    """The 1,000 tag names of ``root/NUS_WID_Tags/TagList1k.txt`` (:func:`read_names`)."""
    try:
        return read_names(root / TAG_LIST, NUM_TAGS, "tag")
    except FileNotFoundError as exc:
        raise DatasetLayoutError(
            f"missing {root / TAG_LIST}; expected the release's NUS_WID_Tags folder"
        ) from exc


def read_tag_matrix(path: Path, count: int) -> np.ndarray:
    """uint8 (``count``, 1000) of a ``<Split>_Tags1k.dat`` file: ``count`` non-empty lines of 1,000 values 0
    or 1 separated by whitespace (tabs in the release, each line ending in one). Another byte, a value of
    several digits, another number of values or of lines is a one-line dataset error naming the line.
    Lines of equal length are checked together, :data:`TAG_LINES_AT_ONCE` at a time (the release's are all
    2,000 bytes long)."""
    try:
        data = read_regular_bytes(path, CAPS["label file"], "label file")
    except FileNotFoundError as exc:
        raise DatasetLayoutError(f"missing {path}; expected one tag file per split") from exc
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
    """NUS-WIDE with the release's train/test split and 81-concept ground truth.

    Args:
        split: ``"train"`` or ``"test"``.
        root: folder holding ``ImageList/``, ``Groundtruth/``, ``ConceptsList/`` and the image folder.
        images: the image folder (relative to ``root`` or absolute), holding ``<folder>/<file>.jpg``.
        keep_empty: keep images without any of the 81 concepts (all-0 rows); with ``zero_shot``, every
            image.
        label_set: ``concepts`` (the 81) or ``zero_shot`` (925 seen tags + 81 concepts; module docstring).
    """

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
        concepts = read_concepts(root_path, layout)
        lines = read_regular_bytes(root_path / list_file).decode("utf-8", errors="replace").splitlines()
        paths = [image_path(line) for line in lines if line.strip()]
        labels = np.stack(
            [
                read_binary_column(root_path / LABEL_DIR / f"Labels_{concept}_{part}.txt", len(paths))
                for concept in concepts
            ],
            axis=1,
        ).astype(np.float32)
        keep = labels.any(axis=1)
        if label_set == "zero_shot":
            tags = read_tag_list(root_path)
            seen = [j for j, tag in enumerate(tags) if tag not in set(concepts)]
            seen_labels = read_tag_matrix(root_path / TAG_DIR / f"{part}_Tags1k.dat", len(paths))[:, seen]
            concepts = [tags[j] for j in seen] + concepts
            labels = np.concatenate([seen_labels.astype(np.float32), labels], axis=1)
            keep = seen_labels.any(axis=1) if split == "train" else labels.any(axis=1)
        self.classes = concepts
        keep = np.ones(len(paths), dtype=bool) if keep_empty else keep
        self.labels = torch.from_numpy(labels[keep])
        folder = str(resolve_path(root, images))
        self.samples = [Sample(os.path.join(folder, paths[i])) for i in np.flatnonzero(keep).tolist()]
