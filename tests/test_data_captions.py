"""dataset=captions: a folder of images with caption files; tags parsed, the vocabulary chosen from the
training split, validation held out or read from a second folder, and bad caption files refused in one
line within bounded memory and time."""

from __future__ import annotations

import hashlib
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
from hostile import bounded

from mlcls.cli.data import main as data_main
from mlcls.data.datasets.base import DatasetConfigError, DatasetFormatError
from mlcls.data.datasets.captions import CaptionFolder
from mlcls.data.datasets.folds import rarest_label_holdout
from mlcls.data.datasets.labels import SparseLabels
from mlcls.io import CAPS, NotRegularFileError

CAPTIONS = {  # image -> caption file text
    "a.jpg": "1girl, long_hair, smile\n",
    "b.png": "\ufeff1girl,smile , smile",  # a byte-order mark, a tag twice
    "sub/c.jpg": "long hair\nsolo",  # line breaks separate tags too
    "sub/deeper/d.webp": "cat, smile,, ",  # empty tags skipped
    "e.jpg": "",
}


def write_folder(root: Path, captions: dict[str, str], uncaptioned: tuple[str, ...] = ()) -> Path:
    """Image stubs (the index never opens them) and their caption files under ``root``."""
    for image, text in captions.items():
        path = root / image
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not decoded")
        path.with_suffix(".txt").write_text(text, encoding="utf-8")
    for image in uncaptioned:
        (root / image).parent.mkdir(parents=True, exist_ok=True)
        (root / image).write_bytes(b"not decoded")
    return root


def rows(dataset: CaptionFolder) -> dict[str, set[str]]:
    """Each sample's relative path and the names of its positive tags (from the dense labels)."""
    root = dataset.samples.root
    return {
        os.path.relpath(sample.path, root): {dataset.classes[c] for c in np.flatnonzero(row.numpy() == 1)}
        for sample, row in zip(dataset.samples, dataset.labels, strict=True)
    }


def test_tags_are_split_stripped_and_counted_once(tmp_path, caplog):
    root = write_folder(tmp_path, CAPTIONS, uncaptioned=("f.jpg", "notes.txt.bak"))
    with caplog.at_level(logging.INFO, logger="mlcls"):
        dataset = CaptionFolder("train", root=str(root), val_fraction=0.0)
    assert rows(dataset) == {
        "a.jpg": {"1girl", "long_hair", "smile"},
        "b.png": {"1girl", "smile"},
        "e.jpg": set(),
        "sub/c.jpg": {"long hair", "solo"},
        "sub/deeper/d.webp": {"cat", "smile"},
    }
    # most frequent first, ties by name
    assert dataset.classes == ["smile", "1girl", "cat", "long hair", "long_hair", "solo"]
    assert [r.message for r in caplog.records if "without a caption" in r.message] == [
        f"{root}: 1 image without a caption file skipped (e.g. f.jpg)"
    ]
    spaced = CaptionFolder("train", root=str(root), val_fraction=0.0, underscores="spaces", min_tag_count=2)
    assert spaced.classes == ["smile", "1girl", "long hair"]  # long_hair and "long hair" are one tag
    assert rows(spaced)["a.jpg"] == {"1girl", "long hair", "smile"}
    assert spaced.dropped == {"tags": 2, "uses": 2}  # cat, solo
    top = CaptionFolder("train", root=str(root), val_fraction=0.0, max_tags=2)
    assert top.classes == ["smile", "1girl"]
    with pytest.raises(DatasetFormatError, match="f.jpg has no caption file f.txt"):
        CaptionFolder("train", root=str(root), val_fraction=0.0, uncaptioned="error")


def test_a_tag_list_sets_the_order_keeps_unseen_tags_and_drops_others_in_one_line(tmp_path, caplog):
    root = write_folder(tmp_path / "data", CAPTIONS)
    (tmp_path / "tags.txt").write_text("solo\nsmile\n\nnever_seen\n1girl\n")
    with caplog.at_level(logging.INFO, logger="mlcls"):
        dataset = CaptionFolder(
            "train", root=str(root), val_fraction=0.0, vocabulary=str(tmp_path / "tags.txt")
        )
    assert dataset.classes == ["solo", "smile", "never_seen", "1girl"]
    assert dataset.label_counts().positives.tolist() == [1, 3, 0, 2]
    dropped = [r.message for r in caplog.records if "outside the vocabulary" in r.message]
    # long_hair, long hair, cat: 3 tags used once each
    assert dropped == [
        "CaptionFolder (train split): 3 uses of 3 tags outside the vocabulary of 4 tags dropped "
        "(e.g. 'long_hair', 'long hair', 'cat')"
    ]
    with pytest.raises(DatasetConfigError, match="set one or the other"):
        CaptionFolder("train", root=str(root), vocabulary="tags.txt", min_tag_count=2)


def test_labels_stay_sparse_and_rows_match_the_captions(tmp_path):
    """Random captions over 300 tags: each target row equals the caption file's tags (a reference read
    with plain Python), and the dataset holds no dense matrix."""
    generator = random.Random(0)
    vocabulary = [f"tag_{i}" for i in range(300)]
    captions = {f"{i:03d}.jpg": ", ".join(generator.sample(vocabulary, 8)) for i in range(40)}
    dataset = CaptionFolder("train", root=str(write_folder(tmp_path, captions)), val_fraction=0.0)
    assert isinstance(dataset.sparse_labels, SparseLabels) and dataset._dense_labels is None
    for index, sample in enumerate(dataset.samples):
        expected = set(captions[Path(sample.path).name].split(", "))
        target = dataset.target(index)
        assert {dataset.classes[c] for c in np.flatnonzero(target.numpy() == 1)} == expected
        assert int((target == 0).sum()) == len(dataset.classes) - len(expected)
    assert dataset._dense_labels is None


def test_a_second_folder_validates_with_the_training_vocabulary(tmp_path):
    train = write_folder(tmp_path / "train", {"a.jpg": "cat, dog", "b.jpg": "cat"})
    val = write_folder(tmp_path / "val", {"x.jpg": "dog, bird", "y.jpg": "cat"})
    dataset = CaptionFolder("val", root=str(train), val_root=str(val))
    assert dataset.classes == ["cat", "dog"]
    assert rows(dataset) == {"x.jpg": {"dog"}, "y.jpg": {"cat"}}
    assert dataset.dropped == {"tags": 1, "uses": 1}
    given = CaptionFolder("val", root="/nowhere", val_root=str(val), classes=["bird", "cat"])  # mlcls-eval's
    assert rows(given) == {"x.jpg": {"bird"}, "y.jpg": {"cat"}}


def test_hashed_holdout_is_sha1_of_the_relative_path(tmp_path):
    captions = {f"dir{i % 3}/{i:02d}.jpg": "cat" for i in range(30)}
    root = write_folder(tmp_path, captions)
    options = dict(root=str(root), val_fraction=0.3, val_by="hashed", val_seed=4)
    val = {os.path.relpath(s.path, root) for s in CaptionFolder("val", **options).samples}
    train = {os.path.relpath(s.path, root) for s in CaptionFolder("train", **options).samples}
    expected = {
        image
        for image in captions
        if int.from_bytes(hashlib.sha1(f"4:{image}".encode()).digest()[:8], "big") < 0.3 * 2**64
    }
    assert val == expected and train == set(captions) - expected


def test_stratified_holdout_gives_each_rarest_tag_group_its_share():
    """Groups of 10, 20, 40 and 80 rows (their rarest tag a, b, c, d), a common tag on every row: each
    group holds out its fraction to within one row, round(0.25 N) rows in all."""
    sizes = {"a": 10, "b": 20, "c": 40, "d": 80}
    entries = [[c, 4] for c, size in enumerate(sizes.values()) for _ in range(size)]
    labels = SparseLabels.from_stored_entries([np.array([[c, 1], [4, 1]]) for c, _ in entries], 5, fill=0)
    for seed in (0, 1):
        in_val = rarest_label_holdout(labels, 0.25, seed)
        assert in_val.sum() == 38  # round(0.25 * 150) = 37.5 -> 38 by the half-row phase
        start = 0
        for size in sizes.values():
            assert abs(in_val[start : start + size].sum() - 0.25 * size) <= 1
            start += size
    assert not np.array_equal(rarest_label_holdout(labels, 0.25, 0), rarest_label_holdout(labels, 0.25, 1))


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        ("cat\ndog\ncat\n", r"tags\.txt, line 3: tag 'cat' is listed twice \(first on line 1\)"),
        ("\n \n", r"tags\.txt lists no tag; expected one tag a line"),
        ("cat\nd\x1bog\n", r"tags\.txt, line 2: control character '\\x1b' \(U\+001B\)"),
    ],
)
def test_bad_tag_lists_are_one_line(tmp_path, tags, message):
    root = write_folder(tmp_path / "data", {"a.jpg": "cat"})
    (tmp_path / "tags.txt").write_text(tags)
    with pytest.raises(DatasetFormatError, match=message):
        CaptionFolder("train", root=str(root), val_fraction=0.0, vocabulary=str(tmp_path / "tags.txt"))


def test_an_empty_vocabulary_and_control_characters_are_one_line(tmp_path):
    root = write_folder(tmp_path / "data", {"a.jpg": "cat", "b.jpg": "dog"})
    with pytest.raises(DatasetFormatError, match="the vocabulary has 0 tags"):
        CaptionFolder("train", root=str(root), val_fraction=0.0, min_tag_count=3)
    empty = write_folder(tmp_path / "empty", {}, uncaptioned=("x.jpg",))
    with pytest.raises(DatasetFormatError, match=r"holds no image with a caption file \(1 image without\)"):
        CaptionFolder("train", root=str(empty), val_fraction=0.0)
    (root / "b.txt").write_text("dog,\n c\x00at")
    with pytest.raises(DatasetFormatError, match=r"b\.txt, line 2: control character '\\x00' \(U\+0000\)"):
        CaptionFolder("train", root=str(root), val_fraction=0.0)


def index_size(root: str, **options) -> int:
    return len(CaptionFolder("train", root=root, val_fraction=0.0, **options))


@pytest.mark.slow
def test_a_fifo_or_huge_caption_file_is_refused_in_one_line(tmp_path):
    root = write_folder(tmp_path, {"a.jpg": "cat"})
    (root / "b.jpg").write_bytes(b"")
    os.mkfifo(root / "b.txt")  # no writer: a plain read blocks forever
    outcome = bounded(index_size, str(root), seconds=10)
    assert outcome.error == NotRegularFileError.__name__ and not outcome.escaped
    assert outcome.message == f"{root / 'b.txt'} is a pipe (FIFO); expected a regular file"
    (root / "b.txt").unlink()
    with open(root / "b.txt", "wb") as huge:  # sparse: 8 GiB declared, nothing written
        huge.truncate(8 * 2**30)
    outcome = bounded(index_size, str(root), memory_mb=256, seconds=10)
    assert outcome.error == DatasetFormatError.__name__ and not outcome.escaped
    assert outcome.message == (
        f"{root / 'b.txt'} is 8192.0 MiB; a caption file of at most {CAPS['caption'] // 2**20}.0 MiB expected"
    )


@pytest.mark.slow
def test_indexing_holds_no_images_by_tags_matrix(tmp_path):
    """1,000 captions over a 40,000-tag list: a dense float32 label table would take 160 MB; the index
    stays within a 120 MB allowance."""
    generator = random.Random(1)
    vocabulary = [f"t{i}" for i in range(40_000)]
    (tmp_path / "tags.txt").write_text("\n".join(vocabulary))
    captions = {f"{i:04d}.jpg": ",".join(generator.sample(vocabulary, 5)) for i in range(1_000)}
    root = write_folder(tmp_path / "data", captions)
    outcome = bounded(index_size, str(root), vocabulary=str(tmp_path / "tags.txt"), memory_mb=120)
    assert outcome.error is None and outcome.value == 1_000


def test_mlcls_data_stats_reads_a_caption_folder(tmp_path, capsys):
    root = write_folder(tmp_path, {f"{i}.jpg": "cat, dog" if i % 2 else "cat" for i in range(10)})
    assert data_main(["stats", "dataset=captions", f"dataset.root={root}", "dataset.val_fraction=0.2"]) == 0
    out = capsys.readouterr().out
    assert "classes (2), in label order:\n  cat, dog" in out
    # 8 training images: 8 cat, 4 dog -> 12 positives; 2 held out
    assert "train split (train): 8 samples" in out and "positive labels per sample: 1.50" in out
    assert "most frequent: cat 8, dog 4" in out
    assert "val split (val): 2 samples" in out


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"underscores": "dashes"}, r"dataset.underscores='dashes'; expected one of keep, spaces"),
        ({"uncaptioned": "ignore"}, r"dataset.uncaptioned='ignore'; expected one of skip, error"),
        ({"tag_separator": " "}, r"dataset.tag_separator=' '; expected a character that is not a space"),
        ({"caption_ext": "txt"}, r"dataset.caption_ext='txt'; expected a suffix like .txt"),
        ({"min_tag_count": 0}, r"dataset.min_tag_count=0; expected an integer >= 1"),
        ({"max_tags": True}, r"dataset.max_tags=True; expected an integer >= 1 or null"),
        ({"val_fraction": "0.1"}, r"dataset.val_fraction='0.1'; expected a number in \[0, 1\)"),
    ],
)
def test_bad_settings_are_one_line_before_any_file_is_read(option, message):
    with pytest.raises(DatasetConfigError, match=message):
        CaptionFolder("train", root="/nowhere", **option)
