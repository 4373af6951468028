"""COCO: class order by category id, crowd annotations, images without annotations, layouts, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from data_fixtures import write_coco

from mlcls.data.datasets.base import DatasetConfigError, DatasetLayoutError
from mlcls.data.datasets.coco import COCO
from mlcls.data.pipeline.transforms import build_transform

CLASSES = ["person", "car", "dog", "toothbrush"]  # category ids 1, 3, 18, 90


def test_classes_follow_category_id_order(tmp_path: Path) -> None:
    dataset = COCO("train", root=str(write_coco(tmp_path)))
    assert dataset.classes == CLASSES


def test_train_labels_count_crowd_and_drop_images_without_annotations(tmp_path: Path) -> None:
    dataset = COCO("train", root=str(write_coco(tmp_path)))
    # images 9 (person x2, dog), 25 (a crowd car only), 42 (toothbrush, crowd car, car); 30 has none
    assert dataset.labels.dtype == torch.float32
    assert dataset.labels.tolist() == [[1, 0, 1, 0], [0, 1, 0, 0], [0, 1, 0, 1]]
    assert [Path(s.path).name for s in dataset.samples] == [
        "COCO_train2014_000000000009.jpg",
        "COCO_train2014_000000000025.jpg",
        "COCO_train2014_000000000042.jpg",
    ]
    assert all(Path(s.path).parent == tmp_path / "train2014" and s.box is None for s in dataset.samples)


def test_keep_empty_keeps_all_negative_rows(tmp_path: Path) -> None:
    root = str(write_coco(tmp_path))
    train = COCO("train", root=root, keep_empty=True)
    assert train.labels.tolist() == [[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]]
    val = COCO("val", root=root, keep_empty=True)
    assert val.labels.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    assert COCO("val", root=root).labels.tolist() == [[0, 0, 1, 0]]


def test_year_2017_and_images_folder_override(tmp_path: Path) -> None:
    root = write_coco(tmp_path / "c17", year=2017)
    dataset = COCO("val", root=str(root), year=2017)
    assert [s.path for s in dataset.samples] == [str(root / "val2017" / "000000000005.jpg")]

    root = write_coco(tmp_path / "c14", image_dirs=("images/train2014", "images/val2014"))
    dataset = COCO("train", root=str(root), train_images="images/train2014", val_images="images/val2014")
    assert Path(dataset.samples[0].path) == root / "images/train2014/COCO_train2014_000000000009.jpg"
    assert len(COCO("val", root=str(root), train_images="x", val_images="images/val2014")) == 1


def test_getitem_returns_transformed_image_and_target(tmp_path: Path) -> None:
    dataset = COCO("train", root=str(write_coco(tmp_path)), transform=build_transform("paper", 32, False))
    image, target = dataset[2]
    assert image.shape == (3, 32, 32)
    assert target.tolist() == [0, 1, 0, 1]


def test_wrong_root_names_the_first_missing_file(tmp_path: Path) -> None:
    with pytest.raises(
        DatasetLayoutError, match=r"missing .*annotations/instances_train2014\.json; expected"
    ):
        COCO("train", root=str(tmp_path))
    root = write_coco(tmp_path / "c", image_dirs=("images/train2014", "images/val2014"))
    with pytest.raises(DatasetLayoutError) as info:
        COCO("train", root=str(root))  # the images are in images/train2014, not train2014
    assert str(info.value).startswith(f"missing {root / 'train2014'};")
    assert "\n" not in str(info.value)


def test_bad_options_are_reported(tmp_path: Path) -> None:
    root = str(write_coco(tmp_path))
    with pytest.raises(DatasetConfigError, match="unknown COCO year '2015'; expected one of '2014', '2017'"):
        COCO("train", root=root, year=2015)
    with pytest.raises(DatasetConfigError, match="unknown COCO year 'latest'"):
        COCO("train", root=root, year="latest")
    with pytest.raises(DatasetConfigError, match="unknown COCO split 'test'"):
        COCO("test", root=root)
