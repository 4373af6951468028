"""The user's CSV/TSV: labels column or one-hot columns, given or inferred classes, validation data."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
from data_fixtures import write_csv
from hostile import bounded

from mlcls.data.datasets.base import DatasetConfigError, DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.csv_dataset import CSVDataset, read_table
from mlcls.data.datasets.folds import held_out

NAMES_CSV = "image,labels\nimg/a.jpg,cat dog\nimg/b.jpg,dog\n\nimg/c.jpg,\nimg/d.jpg,bird  cat\n"
IMAGES = ["img/a.jpg", "img/b.jpg", "img/c.jpg", "img/d.jpg"]


def test_labels_column_with_inferred_sorted_classes(tmp_path: Path) -> None:
    root = write_csv(tmp_path, NAMES_CSV, images=IMAGES)
    dataset = CSVDataset("train", root=str(root), val_fraction=0.0)
    assert dataset.classes == ["bird", "cat", "dog"]
    assert dataset.labels.tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 0], [1, 1, 0]]
    assert [s.path for s in dataset.samples] == [str(root / i) for i in IMAGES]
    with pytest.raises(DatasetConfigError, match="no validation data"):
        CSVDataset("val", root=str(root), val_fraction=0.0)


def test_given_classes_keep_their_order_and_reject_other_names(tmp_path: Path) -> None:
    text = "path;tags\na.jpg;cat|dog\nb.jpg;dog\n"
    root = write_csv(tmp_path, text, images=["pics/a.jpg", "pics/b.jpg"])
    options = dict(
        image_column="path", labels_column="tags", label_delimiter="|", delimiter=";", image_dir="pics"
    )
    dataset = CSVDataset("train", root=str(root), val_fraction=0.0, classes=["dog", "cat", "bird"], **options)
    assert dataset.classes == ["dog", "cat", "bird"]
    assert dataset.labels.tolist() == [[1, 1, 0], [1, 0, 0]]
    assert dataset.samples[0].path == str(root / "pics/a.jpg")
    with pytest.raises(
        DatasetFormatError, match=r"train\.csv, line 2: label 'cat' is not one of the given classes"
    ):
        CSVDataset("train", root=str(root), val_fraction=0.0, classes=["dog"], **options)


def test_one_hot_tsv_with_unknowns(tmp_path: Path) -> None:
    text = "image\tzebra\tant\tmoose\nx.jpg\t1\t\t0\ny.jpg\t-1\t1\t1\n"
    root = write_csv(tmp_path, text, name="labels.tsv", images=["x.jpg", "y.jpg"])
    dataset = CSVDataset(
        "train", root=str(root), train_file="labels.tsv", labels_column=None, val_fraction=0.0
    )
    assert dataset.classes == ["zebra", "ant", "moose"]  # header order
    assert dataset.labels.tolist() == [[1, -1, 0], [-1, 1, 1]]
    subset = CSVDataset(
        "train",
        root=str(root),
        train_file="labels.tsv",
        labels_column=None,
        val_fraction=0.0,
        classes=["moose", "zebra"],
    )
    assert subset.labels.tolist() == [[0, 1], [1, -1]]


def test_one_hot_rejects_other_values(tmp_path: Path) -> None:
    root = write_csv(tmp_path, "image,a,b\nx.jpg,1,0\ny.jpg,0,yes\n", images=["x.jpg", "y.jpg"])
    with pytest.raises(DatasetFormatError, match=r"line 3: column 'b' holds 'yes'"):
        CSVDataset("train", root=str(root), labels_column=None, val_fraction=0.0)
    root = write_csv(tmp_path / "two", "image,a,b\nx.jpg,1,0\ny.jpg,0,2\n", images=["x.jpg", "y.jpg"])
    with pytest.raises(DatasetFormatError, match=r"line 3: column 'b' holds '2'"):
        CSVDataset("train", root=str(root), labels_column=None, val_fraction=0.0)


def test_val_file_and_classes_from_both_files(tmp_path: Path) -> None:
    root = write_csv(tmp_path, NAMES_CSV, images=IMAGES)
    write_csv(root, "image,labels\nimg/e.jpg,emu cat\n", name="val.csv", images=["img/e.jpg"])
    train = CSVDataset("train", root=str(root), val_file="val.csv")
    val = CSVDataset("val", root=str(root), val_file="val.csv")
    assert train.classes == val.classes == ["bird", "cat", "dog", "emu"]
    assert len(train) == 4  # val_fraction is ignored when a val_file is given
    assert val.labels.tolist() == [[0, 1, 0, 1]]


def _split_names(
    root: str, split: str, seed: int = 0, val_fraction: float = 0.25, val_by: str = "hashed"
) -> list[str]:
    dataset = CSVDataset(split, root=root, val_fraction=val_fraction, val_seed=seed, val_by=val_by)
    return [Path(s.path).name for s in dataset.samples]


def test_val_fraction_is_a_seeded_disjoint_holdout(tmp_path: Path) -> None:
    images = [f"{i:02d}.jpg" for i in range(20)]
    text = "image,labels\n" + "".join(f"{name},c{i % 3}\n" for i, name in enumerate(images))
    root = str(write_csv(tmp_path, text, images=images))
    train, val = _split_names(root, "train"), _split_names(root, "val")
    assert 0 < len(val) < 20 and len(train) + len(val) == 20
    assert sorted(train + val) == images
    assert _split_names(root, "val") == val
    assert _split_names(root, "val", seed=1) != val


def test_appending_rows_moves_no_image_between_train_and_val(tmp_path: Path) -> None:
    """The old split (a permutation of the row count) moved images when rows were appended; now each
    image's side depends on its own path only."""
    images = [f"img_{i:03d}.jpg" for i in range(60)]
    header = "image,labels\n"
    rows = [f"{name},c{i % 4}\n" for i, name in enumerate(images)]
    root = write_csv(tmp_path, header + "".join(rows[:40]), images=images)
    before = {name: "val" for name in _split_names(str(root), "val")}
    before.update({name: "train" for name in _split_names(str(root), "train")})
    (root / "train.csv").write_text(header + "".join(rows))  # 20 rows appended
    after = {name: "val" for name in _split_names(str(root), "val")}
    after.update({name: "train" for name in _split_names(str(root), "train")})
    assert len(before) == 40 and len(after) == 60
    assert {name: after[name] for name in before} == before
    assert {after[name] for name in images[40:]} == {"train", "val"}


def test_held_out_share_is_close_to_val_fraction() -> None:
    """Over 20,000 paths the share held out is val_fraction within 4 standard deviations of a binomial."""
    count = 20_000
    for fraction in (0.05, 0.1, 0.3):
        share = sum(held_out(f"photos/{k:05d}.jpg", fraction, 0) for k in range(count)) / count
        assert abs(share - fraction) < 4 * math.sqrt(fraction * (1 - fraction) / count), (fraction, share)
    assert not any(held_out(f"{k}.jpg", 0.0, 0) for k in range(1000))


def test_a_file_too_small_for_val_fraction_still_holds_out_one_image(tmp_path: Path) -> None:
    names = ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]
    root = str(write_csv(tmp_path, "image,labels\n" + "".join(f"{n},cat\n" for n in names), images=names))
    seed = next(s for s in range(100) if not any(held_out(n, 0.2, s) for n in names))
    smallest = min(names, key=lambda n: hashlib.sha1(f"{seed}:{n}".encode()).digest())
    assert _split_names(root, "val", seed, 0.2) == [smallest]
    assert _split_names(root, "train", seed, 0.2) == [n for n in names if n != smallest]


def test_csv_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetLayoutError, match=r"missing .*train\.csv; expected layout"):
        CSVDataset("train", root=str(tmp_path))
    root = write_csv(tmp_path / "a", "file,labels\nx.jpg,cat\n", images=["x.jpg"])
    with pytest.raises(DatasetFormatError, match=r"no column 'image' \(columns: file, labels\)"):
        CSVDataset("train", root=str(root), val_fraction=0.0)
    root = write_csv(tmp_path / "b", "image,labels\nx.jpg,cat,extra\n", images=["x.jpg"])
    with pytest.raises(DatasetFormatError, match="line 2: 3 fields but the header has 2"):
        CSVDataset("train", root=str(root), val_fraction=0.0)
    root = write_csv(tmp_path / "c", "image,labels\nmissing.jpg,cat\n")
    with pytest.raises(DatasetLayoutError, match=r"missing .*missing\.jpg \(first image of"):
        CSVDataset("train", root=str(root), val_fraction=0.0)
    root = write_csv(tmp_path / "d", "")
    with pytest.raises(DatasetFormatError, match="is empty"):
        CSVDataset("train", root=str(root))
    with pytest.raises(DatasetConfigError, match=r"val_fraction must be in \[0, 1\)"):
        CSVDataset("train", root=str(tmp_path / "a"), val_fraction=1.5)


# ------------------------------------------------------------------ repeated rows, class names, small splits
def test_repeated_image_rows_are_merged_when_alike_and_refused_when_not(tmp_path: Path, caplog) -> None:
    alike = "image,labels\nimg/a.jpg,cat dog\nimg/b.jpg,dog\nimg/a.jpg,dog cat\n"
    root = write_csv(tmp_path, alike, images=["img/a.jpg", "img/b.jpg"])
    with caplog.at_level("WARNING", logger="mlcls"):
        dataset = CSVDataset("train", root=str(root), val_fraction=0.0)
    assert [Path(s.path).name for s in dataset.samples] == ["a.jpg", "b.jpg"]
    assert dataset.labels.tolist() == [[1, 1], [0, 1]]
    assert "1 repeated image row listed more than once with the same labels" in caplog.text
    write_csv(tmp_path, "image,labels\nimg/a.jpg,cat\nimg/b.jpg,dog\nimg/a.jpg,dog\n")
    with pytest.raises(
        DatasetFormatError, match=r"lines 2 and 4: image 'img/a.jpg' is listed twice with other"
    ):
        CSVDataset("train", root=str(root), val_fraction=0.0)


def _spellings(root: Path) -> list[str]:
    """Other ways to write ``img/a.jpg`` in a file under ``root`` (whose image_dir is ``root`` itself)."""
    return ["./img/a.jpg", "img//a.jpg", "img/./a.jpg", "other/../img/a.jpg", str(root / "img" / "a.jpg")]


def test_one_image_written_differently_is_one_image(tmp_path: Path, caplog) -> None:
    """Old code: each spelling was another sample (the image counted 6 times)."""
    root = write_csv(tmp_path, "", images=["img/a.jpg", "img/b.jpg"])
    rows = ["img/a.jpg,cat dog", "img/b.jpg,dog"] + [f"{image},dog cat" for image in _spellings(root)]
    (root / "train.csv").write_text("image,labels\n" + "\n".join(rows) + "\n")
    with caplog.at_level("WARNING", logger="mlcls"):
        dataset = CSVDataset("train", root=str(root), val_fraction=0.0)
    assert [s.path for s in dataset.samples] == [str(root / "img/a.jpg"), str(root / "img/b.jpg")]
    assert dataset.labels.tolist() == [[1, 1], [0, 1]]
    assert "5 repeated image rows listed more than once with the same labels" in caplog.text


@pytest.mark.parametrize("spelling", range(5))
def test_one_image_written_differently_with_other_labels_is_refused(tmp_path: Path, spelling: int) -> None:
    """Old code: accepted, the image in training as both a dog and a cat."""
    root = write_csv(tmp_path, "", images=["img/a.jpg", "img/b.jpg"])
    other = _spellings(root)[spelling]
    (root / "train.csv").write_text(f"image,labels\nimg/a.jpg,dog\nimg/b.jpg,dog\n{other},cat\n")
    with pytest.raises(DatasetFormatError) as info:
        CSVDataset("train", root=str(root), val_fraction=0.0)
    assert str(info.value) == (
        f"{root / 'train.csv'}, lines 2 and 4: image 'img/a.jpg' is listed twice (line 4 writes it "
        f"{other!r}) with other labels; list each image once, with all its labels"
    )


def test_a_held_out_split_holds_each_image_on_one_side_whatever_its_spellings(tmp_path: Path) -> None:
    """Old code: the two spellings were hashed apart, the image in training and in validation (a leak)."""
    images = [f"img/{k}.jpg" for k in range(8)]
    seed = next(s for s in range(1000) if held_out("img/0.jpg", 0.5, s) != held_out("./img/0.jpg", 0.5, s))
    text = "image,labels\n" + "".join(f"{image},cat\n" for image in [*images, "./img/0.jpg"])
    root = str(write_csv(tmp_path, text, images=images))
    held = [held_out(image, 0.5, seed) for image in images]
    assert any(held) and not all(held)  # both sides hold images of this fixture
    for split, side in (("val", True), ("train", False)):
        dataset = CSVDataset(split, root=root, val_fraction=0.5, val_seed=seed, val_by="hashed")
        # img/0.jpg on the side of its first spelling only
        assert [s.path for s in dataset.samples] == [
            f"{root}/{image}" for image, h in zip(images, held, strict=True) if h == side
        ]


def test_an_image_in_both_the_training_and_the_validation_file_is_warned(tmp_path: Path, caplog) -> None:
    """Old code: silent, the image scored in validation after training on it."""
    root = write_csv(tmp_path, "image,labels\nimg/a.jpg,cat\nimg/b.jpg,dog\n", images=IMAGES[:3])
    write_csv(root, "image,labels\nimg/c.jpg,dog\n./img//b.jpg,dog\n", name="val.csv")
    expected = (
        f"{root / 'val.csv'}: 1 image is also in the training file {root / 'train.csv'}, e.g. line 3 "
        "'./img//b.jpg' (line 3 there, as 'img/b.jpg'): validation figures include images the model "
        "trained on"
    )
    for split, classes in (("train", None), ("val", None), ("train", ["cat", "dog"])):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mlcls"):
            CSVDataset(split, root=str(root), val_file="val.csv", classes=classes)
        assert [r.getMessage() for r in caplog.records if "also in the training" in r.getMessage()] == [
            expected
        ]
    # a test list evaluated with the model's classes is read alone; val_file = the training file is deliberate
    assert len(CSVDataset("val", root=str(root), val_file="val.csv", classes=["cat", "dog"])) == 2
    assert len(CSVDataset("val", root=str(root), val_file="train.csv")) == 2


def test_class_names_differing_in_case_are_warned(tmp_path: Path, caplog) -> None:
    root = write_csv(tmp_path, "image,labels\nimg/a.jpg,Cat dog\nimg/b.jpg,cat\n", images=IMAGES[:2])
    with caplog.at_level("WARNING", logger="mlcls"):
        dataset = CSVDataset("train", root=str(root), val_fraction=0.0)
    assert dataset.classes == ["Cat", "cat", "dog"]
    assert "differ only in case are separate classes: Cat and cat;" in caplog.text


def test_a_held_out_split_with_few_positives_of_a_class_names_them(tmp_path: Path, caplog) -> None:
    images = [f"{i:03d}.jpg" for i in range(60)]
    held = [i for i, name in enumerate(images) if held_out(name, 0.2, 0)]
    assert len(held) >= 3  # the hash rule holds out enough images of this fixture
    rare = set(held[:2]) | {i for i in range(60) if i % 7 == 0 and i not in held}  # 2 held out, more in train
    tags = ["common" + (" rare" if i in rare else "") for i in range(60)]
    text = "image,labels\n" + "".join(f"{name},{tag}\n" for name, tag in zip(images, tags, strict=True))
    root = str(write_csv(tmp_path, text, images=images))
    with caplog.at_level("WARNING", logger="mlcls"):
        CSVDataset("val", root=root, val_fraction=0.2, val_by="hashed")
    warnings = [r.getMessage() for r in caplog.records if "fewer than 5 positives" in r.getMessage()]
    assert len(warnings) == 1
    assert "of 1 class (rare 2)" in warnings[0]
    assert "dataset.val_fraction" in warnings[0] and "dataset.val_file" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlcls"):
        CSVDataset("train", root=root, val_fraction=0.2, val_by="hashed")
        CSVDataset("val", root=root, val_file="train.csv")  # a validation list: no warning
    assert "fewer than 5 positives" not in caplog.text


def test_a_test_list_with_given_classes_needs_no_training_file(tmp_path: Path) -> None:
    root = write_csv(tmp_path, "image,labels\nimg/a.jpg,dog\nimg/b.jpg,cat dog\n", "test.csv", IMAGES[:2])
    dataset = CSVDataset("val", root=str(root), val_file="test.csv", classes=["dog", "cat"])
    assert dataset.labels.tolist() == [[1, 0], [1, 1]]
    with pytest.raises(DatasetLayoutError, match="train.csv"):
        CSVDataset("val", root=str(root), val_file="test.csv")  # classes to infer: the training file too


def _rare_class_csv(tmp_path: Path) -> tuple[str, list[str], list[str]]:
    """A 20-image CSV: every image ``common``, besides ``a``/``b`` alternately; ``rare`` on 2 images that the
    hashed split at val_fraction 0.1, seed 0 keeps in training. Returns the root, the images and the
    hashed split's validation images."""
    images = [f"{i:02d}.jpg" for i in range(20)]
    hashed_val = [name for name in images if held_out(name, 0.1, 0)]
    rare = [name for name in images if name not in hashed_val][:2]
    tags = [f"common {'ab'[i % 2]}" + (" rare" if name in rare else "") for i, name in enumerate(images)]
    text = "image,labels\n" + "".join(f"{name},{tag}\n" for name, tag in zip(images, tags, strict=True))
    return str(write_csv(tmp_path, text, images=images)), images, rare


def test_the_stratified_holdout_gives_a_class_of_2_positives_one_in_validation(tmp_path: Path) -> None:
    """The hashed split (the only one of the old code) held out none of the 2 positives of ``rare``."""
    root, images, rare = _rare_class_csv(tmp_path)
    hashed = _split_names(root, "val", val_fraction=0.1)
    assert hashed and not set(rare) & set(hashed)  # the hashed split: no positive of rare held out
    for seed in range(5):
        val = _split_names(root, "val", seed, 0.1, "stratified")
        train = _split_names(root, "train", seed, 0.1, "stratified")
        assert sorted(train + val) == images and not set(train) & set(val)
        assert len(set(rare) & set(val)) == 1 and len(set(rare) & set(train)) == 1
        assert _split_names(root, "val", seed, 0.1, "stratified") == val  # deterministic for a seed
    assert len({tuple(_split_names(root, "val", s, 0.1, "stratified")) for s in range(5)}) > 1


def test_the_stratified_holdout_counts_unknown_labels_as_negatives(tmp_path: Path) -> None:
    """One-hot columns with unknown (-1, empty) cells: each class with 2+ positives keeps one on each side."""
    rows = [f"{i:02d}.jpg,1,{'' if i % 3 else 0},{1 if i in (4, 11) else -1}\n" for i in range(20)]
    root = str(write_csv(tmp_path, "image,a,b,c\n" + "".join(rows), images=[r[:6] for r in rows]))
    for seed in range(3):
        val = CSVDataset(
            "val", root=root, labels_column=None, val_fraction=0.1, val_seed=seed, val_by="stratified"
        )
        train = CSVDataset(
            "train", root=root, labels_column=None, val_fraction=0.1, val_seed=seed, val_by="stratified"
        )
        assert len(val) + len(train) == 20
        assert (val.labels[:, 2] == 1).sum() == 1 and (train.labels[:, 2] == 1).sum() == 1


def test_the_csv_config_holds_out_by_stratification_and_refuses_other_holdouts(tmp_path: Path) -> None:
    from mlcls.cli.overrides import compose_config

    assert compose_config("train", ["dataset=csv"]).dataset.val_by == "stratified"
    root, _, _ = _rare_class_csv(tmp_path)
    with pytest.raises(
        DatasetConfigError, match=r"unknown dataset.val_by 'random'; expected one of 'stratified', 'hashed'"
    ):
        CSVDataset("val", root=root, val_by="random")
    with pytest.raises(DatasetConfigError, match=r"dataset.val_seed=-1; expected an integer >= 0"):
        CSVDataset("val", root=root, val_by="stratified", val_seed=-1)


def test_the_csv_validation_split_keys_are_val_keys():
    """``dataset.holdout`` / ``dataset.seed`` (never released names of ``val_by`` / ``val_seed``) are unknown
    options, the closest keys named."""
    from mlcls.cli.overrides import compose_config
    from mlcls.errors import ConfigError

    dataset = compose_config("train", ["dataset=csv", "dataset.val_by=hashed", "dataset.val_seed=3"]).dataset
    assert (dataset.val_by, dataset.val_seed) == ("hashed", 3)
    assert "holdout" not in dataset and "seed" not in dataset
    with pytest.raises(
        ConfigError, match=r"^unknown option dataset.holdout: dataset has .* val_by, val_file"
    ):
        compose_config("train", ["dataset=csv", "dataset.holdout=hashed"])
    with pytest.raises(ConfigError, match=r"^unknown option dataset.seed: did you mean dataset.val_seed"):
        compose_config("train", ["dataset=csv", "dataset.seed=3"])


@pytest.mark.slow
def test_a_sparse_or_streaming_label_file_is_one_line_in_bounded_memory(tmp_path: Path) -> None:
    """A sparse 1 GiB CSV (no line break, 0 bytes on disk) is parsed as read and refused at its first
    2^24 characters; /proc/self/pagemap (st_size 0, streams about 2^38 bytes) is refused unread. Before:
    each a MemoryError under 128 MB (the sparse file's bytes, a copy, its text and a UCS-4 StringIO: 6 GiB
    without a cap; the issue: pagemap 4.64 GB)."""
    sparse = tmp_path / "train.csv"
    with sparse.open("wb") as file:
        file.truncate(2**30)
    outcome = bounded(read_table, sparse, None, memory_mb=128, seconds=20)
    assert outcome.error == "DatasetFormatError" and not outcome.escaped, outcome
    assert outcome.message == f"{sparse}, line 1: over {2**24} characters; expected one image's row per line"
    streaming = tmp_path / "labels.csv"
    streaming.symlink_to("/proc/self/pagemap")
    outcome = bounded(read_table, streaming, None, memory_mb=128, seconds=20)
    assert outcome.error == "NotRegularFileError" and "declares 0 bytes and yet streams" in outcome.message
