"""COCO: class order by category id, crowd annotations, images without annotations, layouts, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from data_fixtures import write_coco

from mlcls.data.datasets.base import DatasetConfigError, DatasetFormatError, DatasetLayoutError
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


# ------------------------------------------------------------------------------- ids, names, field types
def _edited_coco(tmp_path: Path, edit) -> tuple[str, Path]:
    """A fixture root whose train instances file was changed by ``edit(payload)``, and that file."""
    root = write_coco(tmp_path)
    path = root / "annotations" / "instances_train2014.json"
    payload = json.loads(path.read_text())
    edit(payload)
    path.write_text(json.dumps(payload))
    return str(root), path


def _category(payload: dict, name: str) -> dict:
    return next(c for c in payload["categories"] if c["name"] == name)


@pytest.mark.parametrize(
    ("edit", "field", "shown"),
    [
        (lambda p: _category(p, "person").update(id=1.9), r"categories\[1\]\.id", "1.9"),
        (lambda p: _category(p, "car").update(id="3"), r"categories\[3\]\.id", "'3'"),
        (lambda p: _category(p, "car").update(id=True), r"categories\[3\]\.id", "True"),
        (lambda p: p["images"][0].update(id=42.5), r"images\[0\]\.id", "42.5"),
        (lambda p: p["images"][0].update(id=2.0**70), r"images\[0\]\.id", r"1\.18"),
        (lambda p: p["annotations"][0].update(category_id=3.7), r"annotations\[0\]\.category_id", "3.7"),
        (lambda p: p["annotations"][1].update(image_id=None), r"annotations\[1\]\.image_id", "None"),
    ],
    ids=["category-1.9", "category-str", "category-bool", "image-42.5", "image-2**70", "ann-3.7", "ann-null"],
)
def test_ids_that_are_not_integers_are_refused_not_truncated(tmp_path: Path, edit, field, shown) -> None:
    """Old code: 1.9 -> 1, 42.5 -> 42 and 3.7 -> 3 silently (an image labelled with another category)."""
    root, path = _edited_coco(tmp_path, edit)
    with pytest.raises(DatasetFormatError) as info:
        COCO("train", root=root)
    message = str(info.value)
    assert re.fullmatch(rf"{re.escape(str(path))}: {field} is {shown}.*; expected an integer id", message)


def test_integral_float_ids_are_those_integers(tmp_path: Path) -> None:
    """JSON has one number type: 1.0 is read as the id 1, 42.0 as 42 (the fixture's labels, unchanged)."""

    def as_floats(payload: dict) -> None:
        _category(payload, "person")["id"] = 1.0
        next(i for i in payload["images"] if i["id"] == 42)["id"] = 42.0
        for annotation in payload["annotations"]:
            annotation["image_id"], annotation["category_id"] = (
                float(annotation["image_id"]),
                float(annotation["category_id"]),
            )

    root, _ = _edited_coco(tmp_path, as_floats)
    dataset = COCO("train", root=root)
    assert dataset.classes == CLASSES
    assert dataset.labels.tolist() == [[1, 0, 1, 0], [0, 1, 0, 0], [0, 1, 0, 1]]
    assert Path(dataset.samples[2].path).name == "COCO_train2014_000000000042.jpg"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda p: _category(p, "car").update(name="dog"),
            r"categories\[0\] and categories\[3\] have the same name 'dog'; expected distinct names",
        ),
        (
            lambda p: _category(p, "car").update(id=18),
            r"categories\[0\] and categories\[3\] have the same id 18; expected distinct ids",
        ),
        (
            lambda p: p["images"][1].update(id=p["images"][0]["id"]),
            r"images\[0\] and images\[1\] have the same id 42; expected distinct ids",
        ),
        (
            lambda p: _category(p, "dog").update(name={"en": "dog"}),
            r"categories\[0\]\.name is \{'en': 'dog'\}; expected a non-empty string",
        ),
        (lambda p: _category(p, "dog").update(name=""), r"categories\[0\]\.name is ''; expected a non-empty"),
        (
            lambda p: p["images"][2].update(file_name=["a.jpg"]),
            r"images\[2\]\.file_name is \['a\.jpg'\]; expected a non-empty string",
        ),
        (lambda p: p["categories"].append("cat"), r"categories\[4\] is str 'cat'; expected an object"),
        (lambda p: p.update(images={"id": 1}), r"'images' is dict; expected a list"),
    ],
    ids=[
        "dup-name",
        "dup-category-id",
        "dup-image-id",
        "dict-name",
        "empty-name",
        "list-file-name",
        "str-category",
        "dict-images",
    ],
)
def test_duplicate_and_wrongly_typed_entries_are_one_line(tmp_path: Path, edit, expected) -> None:
    """Old code: duplicate names and ids were accepted (one class twice, an image or category lost), a dict
    name became a class, a list file name a TypeError traceback."""
    root, path = _edited_coco(tmp_path, edit)
    with pytest.raises(DatasetFormatError) as info:
        COCO("train", root=root)
    assert re.fullmatch(rf"{re.escape(str(path))}: {expected}.*", str(info.value))
    assert "\n" not in str(info.value)
