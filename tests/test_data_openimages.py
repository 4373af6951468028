"""Open Images V6: trainable classes, human-verified labels (1 / 0 / unknown), sparse storage, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from openimages_fixture import LABEL_FILES, MISSING_IMAGE, write_openimages

from mlcls.data import build_dataset
from mlcls.data.datasets.base import BadImageError, DatasetConfigError, DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.openimages import OpenImages

CLASSES = ["Dog", "Cat", "Bass (/m/bass_fish)", "Bass (/m/bass_guitar)", "Car"]
TRAIN_IDS = ["000000000000000b", "0000000000000a01", "0000000000000c03", "f00000000000000e"]
TRAIN_ROWS = [
    [1.0, -1.0, -1.0, -1.0, 1.0],
    [1.0, 0.0, -1.0, -1.0, -1.0],
    [-1.0, -1.0, 0.0, -1.0, -1.0],
    [-1.0, 0.0, -1.0, 1.0, -1.0],
]


def test_openimages_classes_labels_and_samples(tmp_path: Path) -> None:
    root = write_openimages(tmp_path)
    train = OpenImages("train", root=str(root))
    assert train.classes == CLASSES
    assert train.label_names == ["/m/dog", "/m/cat", "/m/bass_fish", "/m/bass_guitar", "/m/car"]
    assert [Path(s.path) for s in train.samples] == [root / "train" / f"{i}.jpg" for i in TRAIN_IDS]
    assert train.labels.tolist() == TRAIN_ROWS
    assert train.ignored == {
        "non_trainable_labels": 2,
        "conflicting_labels": 1,
        "images_without_trainable_label": 1,
    }
    for index in range(3):  # targets are built from the sparse rows, not from the dense matrix
        image, target = train[index]
        assert image.size == (24, 16) and target.tolist() == TRAIN_ROWS[index]
    validation = OpenImages("validation", root=str(root))
    assert validation.labels.tolist() == [[0.0, 1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0, 0.0]]


def test_openimages_sparse_counts_and_dense_limit(tmp_path: Path) -> None:
    train = OpenImages("train", root=str(write_openimages(tmp_path)), dense_labels_gb=1e-8)
    sparse = train.sparse_labels
    assert sparse.shape == (4, 5)
    assert sparse.count_per_class(1).tolist() == [2, 0, 0, 1, 1]
    assert sparse.count_per_class(0).tolist() == [0, 2, 1, 0, 0]
    assert sparse.counts().unknown == 20 - 7
    with pytest.raises(DatasetConfigError, match=r"4 x 5 float32\) would take 0\.0 GB, over dataset\.dense"):
        train.labels  # noqa: B018
    assert train[1][1].tolist() == TRAIN_ROWS[1]  # loading needs no dense matrix


def test_openimages_missing_image(tmp_path: Path) -> None:
    root = write_openimages(tmp_path)
    with pytest.raises(BadImageError, match=f"{MISSING_IMAGE}.jpg"):
        OpenImages("train", root=str(root))[3]
    skipping = OpenImages("train", root=str(root), on_bad_image="skip")
    _, target = skipping[3]
    assert target.tolist() == TRAIN_ROWS[0]  # the next readable sample, wrapping around
    assert skipping.pop_bad_images() == [str(root / "train" / f"{MISSING_IMAGE}.jpg")]


def test_openimages_config_and_image_folder(tmp_path: Path) -> None:
    from conftest import compose_config

    root = write_openimages(tmp_path / "oi")
    (root / "train").rename(root / "images_train")
    overrides = ["dataset=openimages", f"dataset.root={root}", "dataset.train_images=images_train"]
    cfg = compose_config(overrides).dataset
    train, validation = build_dataset(cfg, train=True), build_dataset(cfg, train=False)
    assert (train.split, validation.split) == ("train", "validation")
    assert Path(train.samples[0].path) == root / "images_train" / f"{TRAIN_IDS[0]}.jpg"
    assert tuple(train[0][0].shape) == (3, cfg.image_size, cfg.image_size)
    with pytest.raises(DatasetLayoutError, match=r"missing .*oi/images_val; expected layout"):
        build_dataset(
            compose_config([*overrides, "dataset.validation_images=images_val"]).dataset, train=False
        )


def test_openimages_errors(tmp_path: Path) -> None:
    root = write_openimages(tmp_path)
    with pytest.raises(DatasetConfigError, match="unknown Open Images split 'val'"):
        OpenImages("val", root=str(root))
    labels = root / LABEL_FILES["train"]
    text = labels.read_text()
    labels.write_text(text.replace("Confidence", "Score"))
    with pytest.raises(DatasetFormatError, match="lacks the column 'Confidence'"):
        OpenImages("train", root=str(root))
    labels.write_text(text + "0000000000000a02,verification,/m/dog,0.5\n")
    with pytest.raises(DatasetFormatError, match=r"line 14: .*Confidence 1 or 0"):
        OpenImages("train", root=str(root))
    labels.write_text(text + "a02,verification,/m/dog,1\n")
    with pytest.raises(DatasetFormatError, match=r"line 14: .*16 hexadecimal digits"):
        OpenImages("train", root=str(root))
    labels.write_text(text)
    (root / "oidv6-classes-trainable.txt").write_text("/m/dog\n/m/unicorn\n")
    with pytest.raises(DatasetFormatError, match="no DisplayName for the trainable class '/m/unicorn'"):
        OpenImages("train", root=str(root))
    (root / "oidv6-classes-trainable.txt").unlink()
    with pytest.raises(DatasetLayoutError, match=r"missing .*oidv6-classes-trainable\.txt"):
        OpenImages("train", root=str(root))
