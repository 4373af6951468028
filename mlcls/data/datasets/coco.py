"""MS-COCO (2014 or 2017) as a multi-label dataset (layout: docs/datasets.md, COCO). Classes: the 80
categories in id order; labels: 1 for a category with an annotation (crowd ones too), else 0; images without
any annotation are dropped unless ``keep_empty``. An id of integral float value (``1.0``: some exporters
write every number so) is that integer; ``1.9``, ``"1"`` or ``true`` is refused.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
from pycocotools.coco import COCO as COCOApi

from mlcls.data.datasets.base import (
    DatasetFormatError,
    MultiLabelDataset,
    Sample,
    check_choice,
    label_table,
    load_json,
    require_files,
    resolve_path,
)

SPLITS = ("train", "val")
YEARS = (2014, 2017)
# Ids are stored as int64.
ID_RANGE = (-(2**63), 2**63)


class COCO(MultiLabelDataset):
    """COCO instances annotations as multi-label targets; ``train_images`` / ``val_images``: image folders
    relative to ``root`` or absolute (default ``{split}{year}``)."""

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = "data/coco",
        year: int = 2014,
        train_images: str | None = None,
        val_images: str | None = None,
        keep_empty: bool = False,
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("COCO split", split, SPLITS)
        year = int(check_choice("COCO year", str(year), tuple(map(str, YEARS))))
        image_dir = (train_images if split == "train" else val_images) or f"{split}{year}"
        annotation_file = f"annotations/instances_{split}{year}.json"
        images_root = resolve_path(root, image_dir)
        layout = f"{root}/annotations/instances_{{train,val}}{year}.json and images in {images_root}/"
        require_files(root, [annotation_file, image_dir], layout)
        self.year = year

        source = Path(root) / annotation_file
        api = COCOApi()
        api.dataset = load_json(source)
        check_entries(api.dataset, source)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress messages
                api.createIndex()
        except (KeyError, TypeError) as exc:
            raise DatasetFormatError(f"{source}: an entry lacks the field {exc}") from exc

        category_ids = np.array(sorted(api.cats), dtype=np.int64)
        if len(category_ids) == 0:
            raise DatasetFormatError(f"{source} lists no categories")
        self.classes = [api.cats[int(c)]["name"] for c in category_ids]
        image_ids = np.array(sorted(api.imgs), dtype=np.int64)
        annotations = api.dataset.get("annotations", [])
        ann_images, ann_cats = (
            np.fromiter(
                (integer_field(a, field, f"annotations[{k}]", source) for k, a in enumerate(annotations)),
                dtype=np.int64,
                count=len(annotations),
            )
            for field in ("image_id", "category_id")
        )
        labels = label_table(len(image_ids), len(category_ids), [source], source)
        if len(annotations) and len(image_ids):  # 1 where the image has an annotation of the category
            rows = np.searchsorted(image_ids, ann_images).clip(max=len(image_ids) - 1)
            cols = np.searchsorted(category_ids, ann_cats).clip(max=len(category_ids) - 1)
            unknown = category_ids[cols] != ann_cats
            if unknown.any():
                raise DatasetFormatError(
                    f"{source}: an annotation has category_id {int(ann_cats[unknown.argmax()])}, which is "
                    "not in 'categories'"
                )
            known_image = image_ids[rows] == ann_images
            labels[rows[known_image], cols[known_image]] = 1.0
        if not keep_empty:
            keep = labels.any(axis=1)
            image_ids, labels = image_ids[keep], labels[keep]
        self.labels = labels
        folder = str(images_root)
        self.samples = [Sample(os.path.join(folder, api.imgs[i]["file_name"])) for i in image_ids.tolist()]


def integer_field(entry: Any, field: str, where: str, source: Path) -> int:
    """``entry[field]`` as an int: an integer, or a float of integral value (``1.0``), within int64; else a
    :class:`DatasetFormatError` naming ``source`` and ``{where}.{field}``."""
    if not isinstance(entry, dict):
        shown = f"{type(entry).__name__} {entry!r:.60}"
        raise DatasetFormatError(f"{source}: {where} is {shown}; expected an object")
    if field not in entry:
        raise DatasetFormatError(f"{source}: {where} has no {field!r}")
    value = entry[field]
    if type(value) is int and ID_RANGE[0] <= value < ID_RANGE[1]:  # the common case, first
        return value
    if type(value) is float and value.is_integer() and ID_RANGE[0] <= value < ID_RANGE[1]:
        return int(value)
    raise DatasetFormatError(f"{source}: {where}.{field} is {value!r:.60}; expected an integer id")


def check_entries(dataset: Any, source: Path) -> None:
    """Check the instances file ``dataset`` before it is indexed, its ids stored as ints (``1.0`` -> ``1``):
    ``images`` and ``categories`` lists of objects with distinct integer ids (:func:`integer_field`) and
    non-empty file names / distinct names, ``annotations`` a list. One :class:`DatasetFormatError` line a
    fault."""
    if not isinstance(dataset, dict) or not {"images", "categories"} <= dataset.keys():
        raise DatasetFormatError(f"{source} is not a COCO instances file (needs 'images' and 'categories')")
    for key in ("images", "categories", "annotations"):
        if not isinstance(dataset.get(key, []), list):
            raise DatasetFormatError(f"{source}: '{key}' is {type(dataset[key]).__name__}; expected a list")
    for key, text_field in (("images", "file_name"), ("categories", "name")):
        first: dict[Hashable, int] = {}
        for k, entry in enumerate(dataset[key]):
            entry["id"] = integer_field(entry, "id", f"{key}[{k}]", source)
            text = entry.get(text_field)
            if not isinstance(text, str) or not text:
                raise DatasetFormatError(
                    f"{source}: {key}[{k}].{text_field} is {text!r:.60}; expected a non-empty string"
                )
            unique = [("id", entry["id"])] + ([("name", text)] if key == "categories" else [])
            for field, value in unique:
                if (field, value) in first:
                    raise DatasetFormatError(
                        f"{source}: {key}[{first[field, value]}] and {key}[{k}] have the same {field} "
                        f"{value!r}; expected distinct {field}s"
                    )
                first[field, value] = k
