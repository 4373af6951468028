"""VAW (Visual Attributes in the Wild): 620 attributes per object instance, one sample per instance crop
(layout: docs/datasets.md). An instance: ``{"image_id", "instance_bbox": [x, y, w, h],
"positive_attributes": [names], "negative_attributes": [names]}``. Labels: positive -> 1 (also when listed
negative too), negative -> 0, others -1; empty boxes are dropped. ``train`` = train_part1 + train_part2 + val.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlcls.data.datasets.base import (
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
    check_choice,
    load_json,
    require_files,
    resolve_path,
)
from mlcls.data.images import nonempty_boxes

SPLIT_FILES = {
    "train": ("train_part1", "train_part2", "val"),
    "test": ("test",),
    "val": ("val",),
    "train_part1": ("train_part1",),
    "train_part2": ("train_part2",),
}
DEFAULT_IMAGE_DIRS = ("VG_100K", "VG_100K_2")


def read_attribute_index(path: Path) -> list[str]:
    """The names of ``attribute_index.json`` (name -> index, 0..C-1) in index order."""
    index = load_json(path)
    if not isinstance(index, dict) or set(index.values()) != set(range(len(index))):
        raise DatasetFormatError(f"{path}: expected {{attribute name: index}} with indices 0..N-1")
    return sorted(index, key=index.__getitem__)


class VAW(MultiLabelDataset):
    """VAW instance crops; ``image_dirs``: folders searched in order for ``<image_id>.jpg`` (relative to
    ``root`` or absolute)."""

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = "data/vaw",
        image_dirs: Sequence[str] = DEFAULT_IMAGE_DIRS,
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("VAW split", split, tuple(SPLIT_FILES))
        files = [f"data/{name}.json" for name in SPLIT_FILES[split]]
        dirs = [resolve_path(root, d) for d in image_dirs]
        layout = (
            f"{root}/data/{{train_part1,train_part2,val,test,attribute_index}}.json and Visual Genome images "
            f"in {' or '.join(str(d) for d in dirs)}"
        )
        require_files(root, ["data/attribute_index.json", *files], layout)
        if not any(d.is_dir() for d in dirs):
            raise DatasetLayoutError(f"missing {dirs[0]}; expected layout: {layout}")

        self.classes = read_attribute_index(Path(root) / "data/attribute_index.json")
        instances = []
        for rel in files:
            content = load_json(Path(root) / rel)
            if not isinstance(content, list):
                raise DatasetFormatError(f"{Path(root) / rel}: expected a list of instances")
            instances.extend(content)
        source = " + ".join(str(Path(root) / rel) for rel in files)

        try:
            boxes = np.asarray([inst["instance_bbox"] for inst in instances], dtype=np.float64).reshape(-1, 4)
            image_ids = [str(inst["image_id"]) for inst in instances]
            positives = [inst["positive_attributes"] for inst in instances]
            negatives = [inst["negative_attributes"] for inst in instances]
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetFormatError(
                f"{source}: every instance needs image_id, instance_bbox [x, y, w, h], positive_attributes "
                f"and negative_attributes ({exc})"
            ) from exc

        kept = np.flatnonzero(nonempty_boxes(boxes)).tolist()
        if len(kept) < len(instances):
            boxes, image_ids = boxes[kept], [image_ids[i] for i in kept]
            positives, negatives = [positives[i] for i in kept], [negatives[i] for i in kept]

        class_index = {name: i for i, name in enumerate(self.classes)}
        labels = np.full((len(image_ids), len(self.classes)), -1.0, dtype=np.float32)
        for value, lists in ((0.0, negatives), (1.0, positives)):  # positive last: it wins a conflict
            rows, cols = _flatten(lists, class_index, source)
            labels[rows, cols] = value

        locate: dict[str, str] = {}  # file name -> its path in the first of dirs that holds it
        for folder in reversed(dirs):
            if folder.is_dir():
                locate.update((name, os.path.join(folder, name)) for name in os.listdir(folder))
        samples = []
        for image_id, box in zip(image_ids, boxes.tolist(), strict=True):
            path = locate.get(f"{image_id}.jpg")
            if path is None:
                raise DatasetLayoutError(f"missing {image_id}.jpg in {' and '.join(map(str, dirs))}")
            samples.append(Sample(path, tuple(box)))
        self.labels = labels
        self.samples = samples


def _flatten(
    lists: list[list[str]], class_index: dict[str, int], source: str
) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) index arrays of the attribute names in ``lists`` (one list per instance)."""
    try:
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    except TypeError as exc:
        raise DatasetFormatError(f"{source}: attributes must be lists of names ({exc})") from exc
    names = list(itertools.chain.from_iterable(lists))
    try:
        cols = np.fromiter(map(class_index.__getitem__, names), dtype=np.int64, count=len(names))
    except KeyError as exc:
        raise DatasetFormatError(f"{source}: attribute {exc} is not in attribute_index.json") from exc
    return np.repeat(np.arange(len(lists)), lengths), cols
