"""WIDER-Attribute: 14 binary attributes per person box, one sample per box crop (layout:
docs/datasets.md). Labels: 1 -> 1, -1 -> 0, 0 (unspecified) -> -1; empty boxes are dropped (the official
files hold 28,345 / 29,179 boxes; the paper, Table 6, reports 28,340 / 29,117).
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
    load_json,
    require_files,
)
from mlcls.data.images import nonempty_boxes

SPLITS = ("trainval", "test")


def attribute_names(id_map: dict[str, str], source: Path) -> list[str]:
    """The names of ``attribute_id_map`` in the order of its keys, 0..C-1."""
    try:
        by_index = {int(key): str(name) for key, name in id_map.items()}
    except (AttributeError, ValueError) as exc:
        raise DatasetFormatError(f"{source}: 'attribute_id_map' must map integer keys to names") from exc
    if sorted(by_index) != list(range(len(by_index))) or not by_index:
        raise DatasetFormatError(f"{source}: 'attribute_id_map' keys must be 0..{len(by_index) - 1}")
    return [by_index[i] for i in range(len(by_index))]


class WIDERAttribute(MultiLabelDataset):
    """WIDER-Attribute person crops (``split``: ``trainval`` or ``test``)."""

    def __init__(
        self,
        split: str = "trainval",
        transform: Callable | None = None,
        root: str = "data/wider",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("WIDER-Attribute split", split, SPLITS)
        annotation_file = f"Annotations/wider_attribute_{split}.json"
        layout = f"{root}/Annotations/wider_attribute_{{trainval,test}}.json and images under {root}/Image/"
        require_files(root, [annotation_file, "Image"], layout)
        source = Path(root) / annotation_file
        data = load_json(source)
        image_dir = str(Path(root) / "Image")
        try:
            self.classes = attribute_names(data["attribute_id_map"], source)
            boxes, values, paths = [], [], []
            for image in data["images"]:
                path = os.path.join(image_dir, image["file_name"])
                for target in image["targets"]:
                    boxes.append(target["bbox"])
                    values.append(target["attribute"])
                    paths.append(path)
        except (KeyError, TypeError) as exc:
            raise DatasetFormatError(
                f"{source}: expected images[].file_name, images[].targets[].bbox / .attribute and "
                f"attribute_id_map (missing {exc})"
            ) from exc

        try:
            box_array = np.asarray(boxes, dtype=np.float64).reshape(len(boxes), 4)
            value_array = np.asarray(values, dtype=np.int64).reshape(len(values), len(self.classes))
        except ValueError as exc:
            raise DatasetFormatError(
                f"{source}: every bbox must be [x, y, w, h] and every attribute list hold "
                f"{len(self.classes)} values"
            ) from exc
        if not np.isin(value_array, (-1, 0, 1)).all():
            raise DatasetFormatError(f"{source}: attribute values must be 1, -1 or 0")
        keep = nonempty_boxes(box_array)
        labels = np.select([value_array == 1, value_array == -1], [1.0, 0.0], default=-1.0).astype(np.float32)

        self.labels = labels[keep]
        kept = np.flatnonzero(keep).tolist()
        self.samples = [Sample(paths[i], tuple(box_array[i].tolist())) for i in kept]
