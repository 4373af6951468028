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
from mlcls.io import read_regular_bytes

SPLITS = {"train": "Train", "test": "Test"}
NUM_CONCEPTS = 81
CONCEPT_LISTS = ("ConceptsList/Concepts81.txt", "Concepts81.txt")
LABEL_DIR = "Groundtruth/TrainTestLabels"


def read_concepts(root: Path, layout: str) -> list[str]:
    """The 81 concept names of the first of :data:`CONCEPT_LISTS` under ``root``, in file order."""
    found = [root / name for name in CONCEPT_LISTS if (root / name).is_file()]
    if not found:
        raise DatasetLayoutError(f"missing {root / CONCEPT_LISTS[0]}; expected layout: {layout}")
    concepts = read_regular_bytes(found[0]).decode("utf-8", errors="replace").split()
    if len(concepts) != NUM_CONCEPTS or len(set(concepts)) != NUM_CONCEPTS:
        raise DatasetFormatError(
            f"{found[0]}: {len(concepts)} names ({len(set(concepts))} distinct); expected the "
            f"{NUM_CONCEPTS} distinct concept names, one a line"
        )
    return concepts


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


class NUSWIDE(MultiLabelDataset):
    """NUS-WIDE with the release's train/test split and 81-concept ground truth.

    ``on_bad_image`` and the config's ``name``, ``image_size``, ``train_split`` and ``val_split``
    (``**config_keys``) are those of :class:`MultiLabelDataset`.

    Args:
        split: ``"train"`` or ``"test"``.
        transform: applied to the PIL image, or a transform name (see :class:`MultiLabelDataset`).
        root: folder holding ``ImageList/``, ``Groundtruth/``, ``ConceptsList/`` and the image folder.
        images: the image folder (relative to ``root`` or absolute), holding ``<folder>/<file>.jpg``.
        keep_empty: keep images without any of the 81 concepts (all-0 rows).
    """

    def __init__(
        self,
        split: str = "train",
        transform: Callable | str | None = None,
        root: str = "data/nuswide",
        images: str = "Flickr",
        keep_empty: bool = False,
        on_bad_image: str = "error",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, on_bad_image, split=split, **config_keys)
        self.split = check_choice("NUS-WIDE split", split, tuple(SPLITS))
        part = SPLITS[split]
        layout = (
            f"{root}/{{ConceptsList/Concepts81.txt, ImageList/{part}Imagelist.txt, "
            f"{LABEL_DIR}/Labels_<concept>_{part}.txt, {images}/<folder>/<file>.jpg}}"
        )
        list_file = f"ImageList/{part}Imagelist.txt"
        require_files(root, [list_file], layout)
        root_path = Path(root)
        self.classes = read_concepts(root_path, layout)
        lines = read_regular_bytes(root_path / list_file).decode("utf-8", errors="replace").splitlines()
        paths = [image_path(line) for line in lines if line.strip()]
        labels = np.stack(
            [
                read_binary_column(root_path / LABEL_DIR / f"Labels_{concept}_{part}.txt", len(paths))
                for concept in self.classes
            ],
            axis=1,
        ).astype(np.float32)
        keep = np.ones(len(paths), dtype=bool) if keep_empty else labels.any(axis=1)
        self.labels = torch.from_numpy(labels[keep])
        folder = str(resolve_path(root, images))
        self.samples = [Sample(os.path.join(folder, paths[i])) for i in np.flatnonzero(keep).tolist()]
