"""``mlcls-data stats``: sizes, classes, label statistics, ``--check``, and one-line errors."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch
from data_fixtures import corrupt, write_voc

from mlcls.cli.data import main
from mlcls.data.datasets.labels import LabelCounts


def test_label_stats_of_a_small_matrix() -> None:
    labels = torch.tensor([[1.0, 0.0, -1.0], [1.0, 1.0, 0.0], [0.0, -1.0, -1.0], [1.0, 0.0, 0.0]])
    stats = LabelCounts.of(labels)
    assert stats.num_samples == 4
    assert stats.positives_per_sample == pytest.approx(4 / 4)
    assert stats.unknown_share == pytest.approx(3 / 12)
    assert stats.positives.tolist() == [3, 1, 0] and stats.negatives.tolist() == [1, 2, 2]
    assert stats.ranked(["a", "b", "c"], 2, most=True) == [("a", 3), ("b", 1)]
    assert stats.ranked(["a", "b", "c"], 2, most=False) == [("c", 0), ("b", 1)]


def test_stats_of_voc2007(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = write_voc(tmp_path, 2007)
    assert main(["stats", "dataset=voc2007", f"dataset.root={root}"]) == 0
    out = capsys.readouterr().out
    assert "classes (20), in label order:\n  aeroplane, bicycle, bird, boat, bottle," in out
    # trainval: a1 dog+person, a2 chair (+ car unknown), a3 person -> 4 positives / 3 images, 1 unknown of 60
    assert "train split (trainval): 3 samples" in out
    assert "positive labels per sample: 1.33" in out
    assert "unknown labels (-1): 1.67% of the 60 entries" in out
    assert "most frequent: person 2, chair 1, dog 1, aeroplane 0, bicycle 0" in out
    # test: b1 bird, b2 tvmonitor (+ sofa unknown) -> 2 positives / 2 images, 1 unknown of 40
    assert "val split (test): 2 samples" in out
    assert "positive labels per sample: 1.00" in out
    assert "unknown labels (-1): 2.50% of the 40 entries" in out
    assert "least frequent: aeroplane 0, bicycle 0, boat 0, bottle 0, bus 0" in out
    assert "images checked" not in out


def test_check_lists_unreadable_images(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = write_voc(tmp_path, 2007)
    bad = root / "VOCdevkit/VOC2007/JPEGImages/a2.jpg"
    corrupt(bad)
    assert main(["stats", "--check", "--split", "train", "dataset=voc2007", f"dataset.root={root}"]) == 1
    out = capsys.readouterr().out
    assert "images checked: 3, unreadable: 1" in out
    assert f"    {bad}: UnidentifiedImageError" in out
    assert "val split" not in out
    assert main(["stats", "dataset=voc2007", f"dataset.root={root}", "--split=val", "--check"]) == 0
    assert "images checked: 2, unreadable: 0" in capsys.readouterr().out


def test_user_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["stats", "dataset=voc2007", f"dataset.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"mlcls-data: error: missing {tmp_path}/VOCdevkit/VOC2007/ImageSets/Main/trainval.txt;"
    )
    assert err.count("\n") == 1
    assert main(["stats", "dataset=imagenet"]) == 2
    err = capsys.readouterr().err
    assert "Could not find 'dataset/imagenet'" in err and "voc2007" in err and err.count("\n") == 1


@pytest.mark.filterwarnings("ignore:'mlcls.cli.data' found in sys.modules:RuntimeWarning")  # imported above
def test_module_entry_point_exit_status(tmp_path: Path, monkeypatch, capsys) -> None:
    """``python -m mlcls.cli.data``, run as ``-m`` runs it (``runpy``) in this process."""
    monkeypatch.setattr(sys, "argv", ["mlcls-data", "stats", "dataset=coco", f"dataset.root={tmp_path}"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("mlcls.cli.data", run_name="__main__", alter_sys=True)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"mlcls-data: error: missing {tmp_path}/annotations/instances_train2014.json; expected layout: "
        f"{tmp_path}/annotations/instances_{{train,val}}2014.json and images in {tmp_path}/train2014/"
    ]
