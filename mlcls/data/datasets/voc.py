"""PASCAL VOC 2007 / 2012 classification: an image is labelled with its objects' classes (layout:
docs/datasets.md). Labels come from each ``<object>``'s own ``<name>`` (not VOC2012's ``<part><name>``). A
class present only through difficult objects is -1 with ``difficult="ignore"`` (the official protocol), 1
with ``"positive"``, 0 with ``"negative"``.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlcls.data.datasets.base import (
    DatasetFormatError,
    MultiLabelDataset,
    Sample,
    check_choice,
    reading,
    require_files,
)
from mlcls.io import CAPS, read_regular_bytes, read_text

VOC_CLASSES = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "diningtable",
    "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)  # fmt: skip
SPLITS = {2007: ("train", "val", "trainval", "test"), 2012: ("train", "val", "trainval")}
DIFFICULT_MODES = {"ignore": -1.0, "positive": 1.0, "negative": 0.0}


class VOC(MultiLabelDataset):
    """PASCAL VOC classification labels parsed from the detection XML files (``split``: an
    ``ImageSets/Main`` list)."""

    def __init__(
        self,
        split: str = "trainval",
        transform: Callable | None = None,
        root: str = "data/voc",
        year: int = 2007,
        difficult: str = "ignore",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        year = int(check_choice("VOC year", str(year), tuple(map(str, SPLITS))))
        self.split = check_choice(f"VOC{year} split", split, SPLITS[year])
        difficult_value = DIFFICULT_MODES[check_choice("difficult mode", difficult, tuple(DIFFICULT_MODES))]
        base = f"VOCdevkit/VOC{year}"
        layout = f"{root}/{base}/{{Annotations/<id>.xml, JPEGImages/<id>.jpg, ImageSets/Main/{split}.txt}}"
        require_files(
            root, [f"{base}/ImageSets/Main/{split}.txt", f"{base}/Annotations", f"{base}/JPEGImages"], layout
        )
        voc_dir = Path(root) / base

        image_ids = read_text(voc_dir / "ImageSets/Main" / f"{split}.txt", "label file").split()
        class_index = {name: i for i, name in enumerate(VOC_CLASSES)}
        # Whether each (image, class) has an object that is not difficult, and one that is.
        has_easy, has_difficult = np.zeros((2, len(image_ids), len(VOC_CLASSES)), dtype=bool)
        for row, image_id in enumerate(image_ids):
            for name, difficult_flag in _objects(voc_dir / "Annotations" / f"{image_id}.xml", layout):
                if name not in class_index:
                    raise DatasetFormatError(
                        f"{voc_dir / 'Annotations' / image_id}.xml: unknown class {name!r}"
                    )
                (has_difficult if difficult_flag else has_easy)[row, class_index[name]] = True
        labels = np.where(has_easy, 1.0, np.where(has_difficult, difficult_value, 0.0)).astype(np.float32)

        self.year = year
        self.classes = list(VOC_CLASSES)
        self.labels = labels
        image_dir = str(voc_dir / "JPEGImages")
        self.samples = [Sample(os.path.join(image_dir, f"{i}.jpg")) for i in image_ids]


def _objects(xml_path: Path, layout: str) -> list[tuple[str, bool]]:
    """``(class name, difficult)`` of every top-level ``<object>`` of a VOC annotation file."""
    with reading(xml_path, f"layout: {layout}"):
        root = ET.fromstring(read_regular_bytes(xml_path, CAPS["annotation"], "VOC annotation"))
    objects = []
    for obj in root.findall("object"):
        name = obj.findtext("name")  # direct child only: <part><name> is not reached
        if name is None:
            raise DatasetFormatError(f"{xml_path}: an <object> has no <name>")
        objects.append((name.strip(), (obj.findtext("difficult") or "0").strip() == "1"))
    return objects
