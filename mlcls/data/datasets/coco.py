"""MS-COCO (2014 or 2017) as a multi-label dataset: an image is labelled with every category it holds.

Layout (as the official zips unpack)::

    root/annotations/instances_{train,val}{year}.json
    root/{train,val}{year}/*.jpg          (``train_images`` / ``val_images`` override these folders)

* classes: the 80 categories in category-id order (person, bicycle, car, ..., toothbrush);
* labels: 1 for every category with at least one annotation, crowd annotations included; 0 otherwise
  (COCO has no unknown labels);
* images without any annotation are dropped unless ``keep_empty`` (then their row is all 0).
  COCO-2014 gives 82,081 train / 40,137 val images (82,783 / 40,504 with ``keep_empty``).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pycocotools.coco import COCO as COCOApi

from mlcls.data.datasets.base import (
    DatasetFormatError,
    MultiLabelDataset,
    Sample,
    check_choice,
    load_json,
    require_files,
    resolve_path,
)

SPLITS = ("train", "val")
YEARS = (2014, 2017)


class COCO(MultiLabelDataset):
    """COCO instances annotations as multi-label targets.

    ``on_bad_image`` and the config's ``name``, ``image_size``, ``train_split`` and ``val_split``
    (``**config_keys``) are those of :class:`MultiLabelDataset`.

    Args:
        split: ``"train"`` or ``"val"``.
        transform: applied to the PIL image, or a transform name (see :class:`MultiLabelDataset`).
        root: folder holding ``annotations/`` and the image folders.
        year: 2014 or 2017.
        train_images, val_images: image folders (relative to ``root`` or absolute); default
            ``{split}{year}``, e.g. ``images/train2014`` for the other common layout.
        keep_empty: keep images without any annotation (all-negative rows).
    """

    def __init__(
        self,
        split: str = "train",
        transform: Callable | str | None = None,
        root: str = "data/coco",
        year: int = 2014,
        train_images: str | None = None,
        val_images: str | None = None,
        keep_empty: bool = False,
        on_bad_image: str = "error",
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, on_bad_image, split=split, **config_keys)
        self.split = check_choice("COCO split", split, SPLITS)
        year = int(check_choice("COCO year", str(year), tuple(map(str, YEARS))))
        image_dir = (train_images if split == "train" else val_images) or f"{split}{year}"
        annotation_file = f"annotations/instances_{split}{year}.json"
        images_root = resolve_path(root, image_dir)
        layout = f"{root}/annotations/instances_{{train,val}}{year}.json and images in {images_root}/"
        require_files(root, [annotation_file, image_dir], layout)
        self.year = year

        api = COCOApi()
        api.dataset = load_json(Path(root) / annotation_file)
        if not isinstance(api.dataset, dict) or not {"images", "categories"} <= api.dataset.keys():
            raise DatasetFormatError(
                f"{Path(root) / annotation_file} is not a COCO instances file "
                "(needs 'images' and 'categories')"
            )
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress messages
                api.createIndex()
        except (KeyError, TypeError) as exc:
            raise DatasetFormatError(
                f"{Path(root) / annotation_file}: an entry lacks the field {exc}"
            ) from exc

        category_ids = np.array(sorted(api.cats), dtype=np.int64)
        if len(category_ids) == 0:
            raise DatasetFormatError(f"{Path(root) / annotation_file} lists no categories")
        self.classes = [api.cats[int(c)]["name"] for c in category_ids]
        image_ids = np.array(sorted(api.imgs), dtype=np.int64)
        labels = _multi_hot(api, image_ids, category_ids, Path(root) / annotation_file)
        if not keep_empty:
            keep = labels.any(axis=1)
            image_ids, labels = image_ids[keep], labels[keep]
        self.labels = torch.from_numpy(labels)
        folder = str(images_root)
        self.samples = [Sample(os.path.join(folder, api.imgs[i]["file_name"])) for i in image_ids.tolist()]


def _multi_hot(api: COCOApi, image_ids: np.ndarray, category_ids: np.ndarray, source: Path) -> np.ndarray:
    """(images, categories) float32 matrix: 1 where the image has an annotation of the category.

    Both id arrays must be sorted; annotations of images not in ``image_ids`` are ignored.
    """
    annotations = api.dataset.get("annotations", [])
    try:
        ann_images = np.fromiter((a["image_id"] for a in annotations), dtype=np.int64, count=len(annotations))
        ann_cats = np.fromiter(
            (a["category_id"] for a in annotations), dtype=np.int64, count=len(annotations)
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetFormatError(f"{source}: an annotation lacks an integer image_id or category_id") from exc
    labels = np.zeros((len(image_ids), len(category_ids)), dtype=np.float32)
    if len(annotations) == 0 or len(image_ids) == 0:
        return labels
    rows = np.searchsorted(image_ids, ann_images).clip(max=len(image_ids) - 1)
    cols = np.searchsorted(category_ids, ann_cats).clip(max=len(category_ids) - 1)
    unknown = category_ids[cols] != ann_cats
    if unknown.any():
        bad = int(ann_cats[unknown.argmax()])
        raise DatasetFormatError(
            f"{source}: an annotation has category_id {bad}, which is not in 'categories'"
        )
    known_image = image_ids[rows] == ann_images
    labels[rows[known_image], cols[known_image]] = 1.0
    return labels
