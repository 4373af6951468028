"""VAW: positive / negative / unknown, split composition, image folders, crops, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from data_fixtures import BLUE, RED, close, mean_colour, write_vaw

from mlcls.data.datasets.base import DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.vaw import VAW

CLASSES = ["red", "wooden", "white", "tall", "striped", "metal"]


def row(positive: list[str], negative: list[str]) -> list[float]:
    return [1.0 if c in positive else 0.0 if c in negative else -1.0 for c in CLASSES]


def test_train_is_part1_part2_val_with_unknowns(tmp_path: Path) -> None:
    root = write_vaw(tmp_path)
    train = VAW("train", root=str(root))
    assert train.classes == CLASSES
    assert train.labels.tolist() == [
        row(["white"], ["red"]),
        row(["red", "tall"], ["metal"]),  # tall is listed positive and negative: positive wins
        row(["striped"], []),
        row([], ["wooden"]),
    ]
    assert [Path(s.path) for s in train.samples] == [
        root / "VG_100K/1001.jpg",
        root / "VG_100K/1001.jpg",
        root / "VG_100K_2/2002.jpg",
        root / "VG_100K_2/2002.jpg",
    ]
    assert [train.load_image(i).size for i in range(4)] == [(18, 25), (10, 10), (6, 4), (40, 30)]
    assert close(mean_colour(train.load_image(0)), BLUE)
    assert close(mean_colour(train.load_image(2)), RED)


def test_test_split_drops_empty_boxes(tmp_path: Path) -> None:
    test = VAW("test", root=str(write_vaw(tmp_path)))
    assert test.labels.tolist() == [row(["metal"], [])]
    assert test.samples[0].box == (1, 1, 5, 5)
    assert len(VAW("val", root=str(tmp_path))) == 1


def test_image_dirs_are_searched_in_order(tmp_path: Path) -> None:
    root = write_vaw(tmp_path)
    shutil.copy(root / "VG_100K_2/2002.jpg", root / "VG_100K/2002.jpg")
    assert VAW("train_part2", root=str(root)).samples[0].path == str(root / "VG_100K/2002.jpg")
    moved = tmp_path / "elsewhere"
    shutil.move(root / "VG_100K_2", moved)
    dataset = VAW("test", root=str(root), image_dirs=["VG_100K", str(moved)])
    assert dataset.samples[0].path == str(moved / "3003.jpg")


def test_vaw_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetLayoutError, match=r"missing .*data/attribute_index\.json; expected layout"):
        VAW("train", root=str(tmp_path))
    root = write_vaw(tmp_path / "v")
    with pytest.raises(DatasetLayoutError, match=r"missing 1001\.jpg in .*VG_100K_2"):
        VAW("train", root=str(root), image_dirs=["VG_100K_2"])
    with pytest.raises(DatasetLayoutError, match=r"missing .*nowhere"):
        VAW("train", root=str(root), image_dirs=["nowhere"])
    (root / "data/val.json").write_text(
        json.dumps(
            [
                {
                    "image_id": 2002,
                    "instance_bbox": [0, 0, 1, 1],
                    "positive_attributes": ["plaid"],
                    "negative_attributes": [],
                }
            ]
        )
    )
    with pytest.raises(DatasetFormatError, match="attribute 'plaid' is not in attribute_index.json"):
        VAW("train", root=str(root))
    (root / "data/val.json").write_text(json.dumps([{"image_id": 2002}]))
    with pytest.raises(DatasetFormatError, match="every instance needs"):
        VAW("val", root=str(root))
