"""VOC 2007 / 2012: labels from each object's own name, difficult modes, splits, errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from data_fixtures import write_voc

from mlcls.data.datasets.base import DatasetConfigError, DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.voc import VOC

CLASSES = [
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "diningtable",
    "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
]  # fmt: skip


def row(**values: float) -> list[float]:
    """A 20-class label row: the given classes, 0 elsewhere."""
    return [values.get(name, 0.0) for name in CLASSES]


@pytest.mark.parametrize(
    ("difficult", "car", "sofa"), [("ignore", -1, -1), ("positive", 1, 1), ("negative", 0, 0)]
)
def test_voc2007_labels_and_difficult_modes(tmp_path: Path, difficult: str, car: float, sofa: float) -> None:
    root = str(write_voc(tmp_path, 2007))
    train = VOC("trainval", root=root, year=2007, difficult=difficult)
    assert train.classes == CLASSES
    # a1: dog, person; a2: car only difficult, chair easy and difficult; a3: person whose parts are not labels
    assert train.labels.tolist() == [row(dog=1, person=1), row(car=car, chair=1), row(person=1)]
    test = VOC("test", root=root, year=2007, difficult=difficult)
    # b1: bird without a <difficult> tag; b2: two difficult sofas and a tvmonitor
    assert test.labels.tolist() == [row(bird=1), row(sofa=sofa, tvmonitor=1)]
    assert [Path(s.path) for s in test.samples] == [
        tmp_path / "VOCdevkit/VOC2007/JPEGImages/b1.jpg",
        tmp_path / "VOCdevkit/VOC2007/JPEGImages/b2.jpg",
    ]


def test_voc2012_train_val(tmp_path: Path) -> None:
    root = str(write_voc(tmp_path, 2012))
    assert len(VOC("train", root=root, year=2012)) == 3
    val = VOC("val", root=root, year=2012)
    assert val.labels.tolist() == [row(bird=1), row(sofa=-1, tvmonitor=1)]
    with pytest.raises(DatasetConfigError, match="unknown VOC2012 split 'test'"):
        VOC("test", root=root, year=2012)


def test_voc_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetLayoutError, match=r"missing .*VOCdevkit/VOC2007/ImageSets/Main/trainval\.txt"):
        VOC("trainval", root=str(tmp_path), year=2007)
    root = write_voc(tmp_path / "v", 2007)
    (root / "VOCdevkit/VOC2007/Annotations/a2.xml").unlink()
    with pytest.raises(DatasetLayoutError, match=r"missing .*Annotations/a2\.xml"):
        VOC("trainval", root=str(root), year=2007)
    (root / "VOCdevkit/VOC2007/Annotations/a2.xml").write_text(
        "<annotation><object><name>unicorn</name></object>"
    )
    with pytest.raises(DatasetFormatError, match=r"cannot parse .*a2\.xml"):
        VOC("trainval", root=str(root), year=2007)
    (root / "VOCdevkit/VOC2007/Annotations/a2.xml").write_text(
        "<annotation><object><name>unicorn</name></object></annotation>"
    )
    with pytest.raises(DatasetFormatError, match="unknown class 'unicorn'"):
        VOC("trainval", root=str(root), year=2007)
    with pytest.raises(DatasetConfigError, match="unknown difficult mode 'drop'"):
        VOC("test", root=str(root), year=2007, difficult="drop")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pipe", "sparse"])
def test_an_annotation_that_is_a_pipe_or_too_large_is_one_line_at_once(tmp_path: Path, kind: str) -> None:
    """An annotation XML read through the door: a FIFO without a writer is refused, not waited on (old:
    ``ET.parse`` blocked for ever), and a 1 GiB sparse file past its cap is not read."""
    from hostile import bounded

    root = write_voc(tmp_path, 2007)
    xml = root / "VOCdevkit/VOC2007/Annotations/a2.xml"
    xml.unlink()
    if kind == "pipe":
        os.mkfifo(xml)
    else:
        with open(xml, "wb") as f:
            f.truncate(2**30)
    outcome = bounded(VOC, "trainval", root=str(root), year=2007, memory_mb=512, seconds=10)
    assert not outcome.escaped, outcome
    expected = "a pipe (FIFO)" if kind == "pipe" else "VOC annotation"
    assert "\n" not in outcome.message and str(xml) in outcome.message and expected in outcome.message
