"""VISPR: the real attribute file, class index = idx column, split composition, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_fixtures import VISPR_ATTRIBUTES, write_vispr

from mlcls.data.datasets.base import DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.vispr import VISPR

# idx of the attributes used by the fixture, read off /work/shared/fixtures/vispr/attributes.tsv
INDEX = {"a0_safe": 0, "a4_gender": 4, "a9_face_complete": 9, "a16_race": 14, "a17_color": 15,
         "a104_license_plate_partial": 67}  # fmt: skip


def row(*names: str) -> list[float]:
    return [1.0 if i in {INDEX[n] for n in names} else 0.0 for i in range(68)]


def test_classes_are_the_68_attribute_ids_in_idx_order(tmp_path: Path) -> None:
    dataset = VISPR("test", root=str(write_vispr(tmp_path)))
    assert len(dataset.classes) == 68
    assert dataset.classes[0] == "a0_safe"
    assert dataset.classes[14] == "a16_race"
    assert dataset.classes[67] == "a104_license_plate_partial"


def test_train_is_train2017_plus_val2017(tmp_path: Path) -> None:
    root = write_vispr(tmp_path)
    train = VISPR("train", root=str(root))
    assert train.labels.tolist() == [
        row("a0_safe"),
        row("a4_gender", "a16_race", "a17_color"),
        row("a104_license_plate_partial"),
    ]
    assert [Path(s.path) for s in train.samples] == [
        root / "images/train2017/2017_10001018.jpg",
        root / "images/train2017/2017_10002000.jpg",
        root / "images/val2017/2017_20000001.jpg",
    ]
    test = VISPR("test", root=str(root))
    assert test.labels.tolist() == [row(), row("a4_gender", "a9_face_complete")]
    assert len(VISPR("val2017", root=str(root))) == 1


def test_class_index_is_the_idx_column_not_the_row_order(tmp_path: Path) -> None:
    root = write_vispr(tmp_path)
    header, *rows = VISPR_ATTRIBUTES.read_text().splitlines()
    (root / "attributes.tsv").write_text("\n".join([header, *reversed(rows)]) + "\n")
    dataset = VISPR("train", root=str(root))
    assert dataset.classes[0] == "a0_safe" and dataset.classes[67] == "a104_license_plate_partial"
    assert dataset.labels[2].tolist() == row("a104_license_plate_partial")


def test_vispr_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetLayoutError, match=r"missing .*attributes\.tsv; expected layout"):
        VISPR("train", root=str(tmp_path))
    root = write_vispr(tmp_path / "v")
    (root / "test2017.txt").unlink()
    with pytest.raises(DatasetLayoutError, match=r"missing .*test2017\.txt"):
        VISPR("test", root=str(root))
    annotation = root / "annotations/train2017/2017_10001018.json"
    annotation.write_text(json.dumps({"id": "x", "image_path": "images/x.jpg", "labels": ["a999_unknown"]}))
    with pytest.raises(DatasetFormatError, match="label 'a999_unknown' is not in attributes.tsv"):
        VISPR("train", root=str(root))
    annotation.write_text("{not json")
    with pytest.raises(DatasetFormatError, match=r"cannot parse .*2017_10001018\.json"):
        VISPR("train", root=str(root))


def test_an_attribute_file_not_utf8_is_one_line_naming_it(tmp_path: Path) -> None:
    """Read through the annotation files' error door (old: a bare UnicodeDecodeError naming no file)."""
    root = write_vispr(tmp_path)
    (root / "attributes.tsv").write_bytes(b"idx\tattribute_id\n0\ta0_\xffsafe\n")
    with pytest.raises(DatasetFormatError, match=rf"^cannot parse {root / 'attributes.tsv'}: 'utf-8' codec"):
        VISPR("test", root=str(root))
