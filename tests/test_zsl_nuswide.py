"""NUS-WIDE's zero-shot split (925 seen tags / 81 unseen concepts) from files written here in the release's
format: NUS_WID_Tags/TagList1k.txt and {Train,Test}_Tags1k.dat (tab-separated 0/1, a tab ending each line,
CRLF), beside the 81-concept layout of tests/data_fixtures.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import compose_config
from data_fixtures import NUSWIDE_CONCEPTS, NUSWIDE_LISTS, write_nuswide

from mlcls.data import build_dataset
from mlcls.data.datasets.base import DatasetFormatError
from mlcls.data.datasets.nuswide import NUSWIDE

# 1,000 tags: 925 plain ones and 75 of the concept names (the release's TagList1k shares 75 with Concepts81),
# interleaved so that the seen order must follow the file's.
OVERLAP = NUSWIDE_CONCEPTS[:75]
TAGS = [f"tag{j:03d}" for j in range(925)]
for position, concept in enumerate(OVERLAP):
    TAGS.insert(13 * position, concept)
SEEN = [tag for tag in TAGS if tag not in NUSWIDE_CONCEPTS]
# Positive tags of each image, in list order (the beach image: a tag but no concept; water: none at all).
TAG_POSITIVES = {
    "Train": [["tag000", "person"], ["animal"], ["tag500"], ["tag924", "tag001"]],
    "Test": [["tag002"], []],
}


def write_tags(root: Path) -> Path:
    tags = root / "NUS_WID_Tags"
    tags.mkdir(parents=True)
    (tags / "TagList1k.txt").write_bytes("".join(f"{t}\r\n" for t in TAGS).encode())
    for part, positives in TAG_POSITIVES.items():
        lines = ["".join(f"{int(tag in row)}\t" for tag in TAGS) + "\r\n" for row in positives]
        (tags / f"{part}_Tags1k.dat").write_bytes("".join(lines).encode())
    return root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return write_tags(write_nuswide(tmp_path / "nuswide"))


def expected_row(tags: list[str], concepts: list[str]) -> list[float]:
    return [float(t in tags) for t in SEEN] + [float(c in concepts) for c in NUSWIDE_CONCEPTS]


def test_classes_are_925_seen_tags_then_81_concepts(root: Path) -> None:
    assert len(TAGS) == 1000 and len(SEEN) == 925
    train = NUSWIDE("train", root=str(root), label_set="zero_shot")
    assert train.classes == SEEN + NUSWIDE_CONCEPTS and len(train.classes) == 1006
    concepts = list(NUSWIDE_LISTS["Train"].values())
    tags = TAG_POSITIVES["Train"]
    # the second image (animal) has no seen tag ("animal" is a concept): dropped from training; the third
    # (beach, no concept) has one: kept
    kept = [0, 2, 3]
    assert train.labels.tolist() == [expected_row(tags[i], concepts[i]) for i in kept]
    assert [Path(train.samples[k].path).name for k in range(3)] == [
        "0001_2124494179.jpg",
        "0003_11.jpg",
        "0004_5.jpg",
    ]
    test = NUSWIDE("test", root=str(root), label_set="zero_shot")
    test_concepts = list(NUSWIDE_LISTS["Test"].values())
    assert test.labels.tolist() == [expected_row(TAG_POSITIVES["Test"][i], test_concepts[i]) for i in (0, 1)]


def test_the_config_trains_on_the_seen_tags_and_evaluates_all(root: Path) -> None:
    cfg = compose_config(["dataset=nuswide_zsl", f"dataset.root={root}", "dataset.image_size=16"]).dataset
    train, test = build_dataset(cfg, train=True), build_dataset(cfg, train=False)
    assert train.classes == SEEN and len(test.classes) == 1006
    targets = np.stack([train.target(i).numpy() for i in range(len(train))])
    assert targets.shape == (3, 925) and targets.sum() == 4  # tag000; tag500; tag924 + tag001


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("0\t" * 999 + "\r\n", "line 1 does not hold 1000 values"),
        ("0\t" * 998 + "10\t\r\n", "line 1 does not hold 1000 values"),
        ("0\t" * 999 + "2\t\r\n", "line 1 does not hold 1000 values"),
    ],
)
def test_a_malformed_tag_file_is_one_line(root: Path, line: str, message: str) -> None:
    path = root / "NUS_WID_Tags" / "Test_Tags1k.dat"
    path.write_bytes((line + "0\t" * 1000 + "\r\n").encode())
    with pytest.raises(DatasetFormatError) as error:
        NUSWIDE("test", root=str(root), label_set="zero_shot")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_tag_file_of_another_length_is_one_line(root: Path) -> None:
    (root / "NUS_WID_Tags" / "Test_Tags1k.dat").write_bytes(("0\t" * 1000 + "\r\n").encode())
    with pytest.raises(DatasetFormatError, match="1 lines; expected 2"):
        NUSWIDE("test", root=str(root), label_set="zero_shot")
