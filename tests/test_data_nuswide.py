"""NUS-WIDE from the release's layout: concept order, 0/1 label files aligned with the image lists, Windows
paths, images without concepts dropped, missing images reported, malformed files named."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_fixtures import NUSWIDE_CONCEPTS, write_nuswide

from mlcls.data import build_dataset
from mlcls.data.datasets.base import BadImageError, DatasetConfigError, DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.nuswide import NUSWIDE, image_path


def row(*positives: str) -> list[float]:
    return [1.0 if name in positives else 0.0 for name in NUSWIDE_CONCEPTS]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return write_nuswide(tmp_path / "nuswide")


def test_splits_labels_and_paths(root: Path) -> None:
    train = NUSWIDE("train", root=str(root))
    assert train.classes == NUSWIDE_CONCEPTS and train.classes[42] == "person"
    # beach/0003_11.jpg has none of the 81 concepts: dropped
    assert train.labels.tolist() == [
        row("person", "sky"),
        row("animal", "dog"),
        row("zebra", "grass", "animal"),
    ]
    assert [Path(s.path) for s in train.samples] == [
        root / "Flickr/actor/0001_2124494179.jpg",
        root / "Flickr/animal/0002_38457.jpg",
        root / "Flickr/zebra/0004_5.jpg",
    ]
    test = NUSWIDE("test", root=str(root))
    assert test.labels.tolist() == [row("sky", "clouds"), row("water")]
    kept = NUSWIDE("train", root=str(root), keep_empty=True)
    assert (
        kept.labels.tolist()[2] == row() and Path(kept.samples[2].path) == root / "Flickr/beach/0003_11.jpg"
    )


def test_config_builds_train_and_test_with_the_strong_recipe(root: Path) -> None:
    from conftest import compose_config

    cfg = compose_config(["dataset=nuswide"]).dataset
    cfg.root, cfg.image_size, cfg.transform = str(root), 32, "strong"
    train, test = build_dataset(cfg, train=True, backend="fast"), build_dataset(cfg, train=False)
    assert (len(train), len(test), train.num_classes) == (3, 2, 81)
    image, target = train[0]
    assert image.shape == (3, 32, 32) and target.tolist() == row("person", "sky")


def test_image_list_paths() -> None:
    assert image_path("actor\\0001_2124494179.jpg\r") == "actor/0001_2124494179.jpg"
    assert image_path("C:\\ImageData\\Flickr\\actor\\0001_2124494179.jpg") == "actor/0001_2124494179.jpg"
    assert image_path("Flickr/sky/0005_77.jpg") == "sky/0005_77.jpg"


def test_a_missing_image_is_reported_or_skipped(root: Path) -> None:
    missing = root / "Flickr/animal/0002_38457.jpg"
    missing.unlink()
    with pytest.raises(BadImageError, match=r"cannot read image .*animal/0002_38457\.jpg.*on_bad_image=skip"):
        NUSWIDE("train", root=str(root))[1]
    skipping = NUSWIDE("train", root=str(root), on_bad_image="skip")
    _, target = skipping[1]
    assert target.tolist() == row("zebra", "grass", "animal")  # the next readable sample
    assert skipping.pop_bad_images() == [str(missing)]


def test_layout_and_format_errors(root: Path) -> None:
    with pytest.raises(DatasetConfigError, match="unknown NUS-WIDE split 'val'"):
        NUSWIDE("val", root=str(root))
    with pytest.raises(DatasetLayoutError, match=r"missing .*ImageList/TestImagelist\.txt; expected layout"):
        NUSWIDE("test", root=str(root / "nowhere"))
    labels = root / "Groundtruth/TrainTestLabels"
    (labels / "Labels_water_Test.txt").write_text("0\n1\n0\n")
    with pytest.raises(DatasetFormatError, match=r"Labels_water_Test\.txt: 3 lines; expected 2 lines"):
        NUSWIDE("test", root=str(root))
    (labels / "Labels_water_Test.txt").write_text("0\n2\n")
    with pytest.raises(DatasetFormatError, match=r"Labels_water_Test\.txt: .* each 0 or 1"):
        NUSWIDE("test", root=str(root))
    (labels / "Labels_water_Test.txt").unlink()
    with pytest.raises(DatasetLayoutError, match=r"missing .*Labels_water_Test\.txt"):
        NUSWIDE("test", root=str(root))
    concepts = root / "ConceptsList/Concepts81.txt"
    concepts.write_text("\n".join(NUSWIDE_CONCEPTS[:80]))
    with pytest.raises(DatasetFormatError, match=r"Concepts81\.txt: 80 names .*expected the 81 distinct"):
        NUSWIDE("train", root=str(root))
    concepts.unlink()
    with pytest.raises(DatasetLayoutError, match=r"missing .*ConceptsList/Concepts81\.txt"):
        NUSWIDE("train", root=str(root))
