"""WIDER-Attribute: one sample per box, 1/-1/0 -> 1/0/-1, class order, crops clamped to the image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_fixtures import BLUE, RED, WIDER_NAMES, close, mean_colour, write_wider

from mlcls.data.datasets.base import DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.wider import WIDERAttribute


def row(positive: list[int], negative: list[int]) -> list[float]:
    return [1.0 if i in positive else 0.0 if i in negative else -1.0 for i in range(14)]


def test_classes_in_numeric_key_order(tmp_path: Path) -> None:
    dataset = WIDERAttribute("trainval", root=str(write_wider(tmp_path)))
    assert dataset.classes == WIDER_NAMES
    assert dataset.classes[10] == "skirt" and dataset.classes[2] == "sunglass"


def test_one_sample_per_box_with_mapped_values(tmp_path: Path) -> None:
    root = write_wider(tmp_path)
    train = WIDERAttribute("trainval", root=str(root))
    # +Male -hat; +longHair +tshirt -Male; (zero-width box dropped); -stripe
    assert train.labels.tolist() == [row([0], [3]), row([1, 4], [0]), row([], [13])]
    assert [s.box for s in train.samples] == [(22, 5, 30, 40), (0, 0, 10, 10), (-4, -3, 14, 13)]
    assert [Path(s.path) for s in train.samples] == [
        root / "Image/train/0--Parade/0_Parade_a.jpg",
        root / "Image/train/0--Parade/0_Parade_a.jpg",
        root / "Image/val/1--Handshaking/1_Handshaking_b.jpg",
    ]
    test = WIDERAttribute("test", root=str(root))
    assert test.labels.tolist() == [row([10], [])]


def test_crops_are_clamped_to_the_image(tmp_path: Path) -> None:
    train = WIDERAttribute("trainval", root=str(write_wider(tmp_path)))
    crops = [train.load_image(i) for i in range(3)]
    assert [c.size for c in crops] == [(18, 25), (10, 10), (10, 10)]
    assert close(mean_colour(crops[0]), BLUE)  # x >= 22 lies in the blue right half of the 40x30 image
    assert close(mean_colour(crops[1]), RED)
    assert close(mean_colour(crops[2]), RED)


def test_wider_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetLayoutError, match=r"missing .*Annotations/wider_attribute_trainval\.json"):
        WIDERAttribute("trainval", root=str(tmp_path))
    root = write_wider(tmp_path / "w")
    path = root / "Annotations/wider_attribute_test.json"
    payload = json.loads(path.read_text())
    payload["images"][0]["targets"][0]["attribute"] = [2] * 14
    path.write_text(json.dumps(payload))
    with pytest.raises(DatasetFormatError, match="attribute values must be 1, -1 or 0"):
        WIDERAttribute("test", root=str(root))
    payload["images"][0]["targets"][0]["attribute"] = [1] * 13
    path.write_text(json.dumps(payload))
    with pytest.raises(DatasetFormatError, match="hold 14 values"):
        WIDERAttribute("test", root=str(root))
    del payload["attribute_id_map"]
    path.write_text(json.dumps(payload))
    with pytest.raises(DatasetFormatError, match="attribute_id_map"):
        WIDERAttribute("test", root=str(root))
