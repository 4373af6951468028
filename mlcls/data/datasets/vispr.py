"""VISPR (Visual Privacy): 68 privacy attributes per image, ``a0_safe`` included (layout:
docs/datasets.md). Classes: ``attribute_id`` of ``attributes.tsv`` in ``idx`` order; labels: 1 if listed,
else 0. ``train`` = train2017 + val2017.
"""

from __future__ import annotations

import csv
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
    load_json,
    reading,
    require_files,
)
from mlcls.io import CAPS, open_regular, read_text

SPLIT_LISTS = {
    "train": ("train2017", "val2017"),
    "test": ("test2017",),
    "train2017": ("train2017",),
    "val2017": ("val2017",),
    "test2017": ("test2017",),
}


class VISPR(MultiLabelDataset):
    """VISPR privacy attributes (``split``: ``train``, ``test`` or one list name)."""

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = "data/vispr",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("VISPR split", split, tuple(SPLIT_LISTS))
        lists = [f"{name}.txt" for name in SPLIT_LISTS[split]]
        layout = (
            f"{root}/attributes.tsv, {root}/{{train2017,val2017,test2017}}.txt listing "
            "annotations/<split>2017/<id>.json, images in images/<split>2017/"
        )
        require_files(root, ["attributes.tsv", *lists], layout)
        root_path = Path(root)

        path = root_path / "attributes.tsv"  # the attribute ids in the order of the idx column, 0..C-1
        with (
            reading(path),
            open_regular(path, "r", max_bytes=CAPS["class list"], newline="", encoding="utf-8") as f,
        ):
            attributes = list(csv.DictReader(f, delimiter="\t"))
        if not attributes or not {"idx", "attribute_id"} <= attributes[0].keys():
            raise DatasetFormatError(f"{path}: expected tab-separated columns 'idx' and 'attribute_id'")
        try:
            by_index = {int(row["idx"]): row["attribute_id"].strip() for row in attributes}
        except (TypeError, ValueError) as exc:
            raise DatasetFormatError(f"{path}: the 'idx' column must hold integers ({exc})") from exc
        count = len(attributes)
        if sorted(by_index) != list(range(count)):
            raise DatasetFormatError(f"{path}: 'idx' must number the {count} attributes 0..{count - 1}")
        self.classes = [by_index[i] for i in range(count)]
        class_index = {name: i for i, name in enumerate(self.classes)}
        annotation_paths = [
            line.strip()
            for name in lists
            for line in read_text(root_path / name, "label file").splitlines()
            if line.strip()
        ]
        if annotation_paths:
            require_files(root, annotation_paths[:1], layout)

        labels = np.zeros((len(annotation_paths), len(self.classes)), dtype=np.float32)
        samples = []
        for row, rel in enumerate(annotation_paths):
            annotation = load_json(root_path / rel)
            try:
                image_path, names = annotation["image_path"], annotation["labels"]
            except (KeyError, TypeError) as exc:
                raise DatasetFormatError(
                    f"{root_path / rel}: expected keys 'image_path' and 'labels'"
                ) from exc
            for name in names:
                if name not in class_index:
                    raise DatasetFormatError(f"{root_path / rel}: label {name!r} is not in attributes.tsv")
                labels[row, class_index[name]] = 1.0
            samples.append(Sample(os.path.join(root, image_path)))
        self.labels = labels
        self.samples = samples
