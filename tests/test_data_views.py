"""dataset.unseen_classes: the training split restricted to the seen classes (mlcls.data), the config check
of the head, and the names read from a file."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import compose_config
from hostile import bounded

from mlcls.data import DatasetConfigError, build_dataset
from mlcls.data.datasets.labels import label_counts
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.views import unseen_class_names
from mlcls.engine.config_checks import check_config
from mlcls.errors import ConfigError

UNSEEN = ["red_circle", "green_square", "blue_triangle"]
SMALL = ["dataset=synthetic", "dataset.train_size=64", "dataset.val_size=16", "dataset.image_size=16"]


def dataset_config(*overrides: str):
    return compose_config([*SMALL, *overrides]).dataset


def test_the_training_split_loses_the_unseen_columns_and_keeps_its_images() -> None:
    cfg = dataset_config(f"dataset.unseen_classes=[{','.join(UNSEEN)}]")
    train = build_dataset(cfg, train=True)
    full = SyntheticMultiLabel(split="train", train_size=64, val_size=16)
    seen = [c for c, name in enumerate(full.classes) if name not in UNSEEN]
    assert set(UNSEEN) <= set(full.classes) and len(seen) == 9
    assert train.classes == [full.classes[c] for c in seen]
    assert torch.equal(train.labels, full.labels[:, seen])
    assert all(torch.equal(train.target(i), full.labels[i, seen]) for i in range(len(train)))
    counts = label_counts(train)
    assert torch.equal(counts.positives, (full.labels[:, seen] == 1).sum(0))
    # the images still show the unseen shapes: same pixels as the full dataset's
    row = int(torch.nonzero(full.labels[:, full.classes.index("red_circle")])[0])
    assert np.array_equal(np.asarray(train.load_image(row)), np.asarray(full.load_image(row)))
    assert build_dataset(cfg, train=False).classes == full.classes  # evaluation: every class


def test_unseen_images_drop_keeps_the_images_without_an_unseen_positive() -> None:
    cfg = dataset_config(f"dataset.unseen_classes=[{','.join(UNSEEN)}]", "dataset.unseen_images=drop")
    train = build_dataset(cfg, train=True)
    full = SyntheticMultiLabel(split="train", train_size=64, val_size=16)
    unseen = [full.classes.index(name) for name in UNSEEN]
    rows = [i for i in range(64) if not full.labels[i, unseen].eq(1).any()]
    seen = [c for c in range(12) if c not in unseen]
    assert 0 < len(rows) < 64 and len(train) == len(rows)
    assert torch.equal(torch.stack([train.target(i) for i in range(len(train))]), full.labels[rows][:, seen])
    assert torch.equal(label_counts(train).positives, (full.labels[rows][:, seen] == 1).sum(0))
    assert np.array_equal(np.asarray(train.load_image(3)), np.asarray(full.load_image(rows[3])))


def test_unseen_names_from_a_file(tmp_path) -> None:
    names = tmp_path / "unseen.txt"
    names.write_text("\n".join(UNSEEN[:2]) + "\n\n")
    train = build_dataset(dataset_config(f"dataset.unseen_classes={names}"), train=True)
    assert not set(UNSEEN[:2]) & set(train.classes) and len(train.classes) == 10


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[red_circle,purple_star,'bad\x1bname']", "2 unknown class name(s): 'purple_star', 'bad\\x1bname'"),
        ("/nonexistent/unseen.txt", "dataset.unseen_classes='/nonexistent/unseen.txt'"),
        ("42", "expected null, a list of class names, or the path"),
    ],
)
def test_bad_unseen_settings_are_one_line(value: str, message: str) -> None:
    cfg = dataset_config(f"dataset.unseen_classes={value}")
    with pytest.raises(DatasetConfigError) as error:
        build_dataset(cfg, train=True)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_bad_unseen_images_value_is_one_line() -> None:
    with pytest.raises(DatasetConfigError, match="dataset.unseen_images='all'; expected one of keep, drop"):
        build_dataset(dataset_config("dataset.unseen_images=all"), train=False)


def test_every_class_unseen_is_refused() -> None:
    names = SyntheticMultiLabel(split="val", val_size=1).classes
    with pytest.raises(DatasetConfigError, match="all 12 classes"):
        build_dataset(dataset_config(f"dataset.unseen_classes=[{','.join(names)}]"), train=True)


def test_a_regime_draws_over_the_seen_columns_only() -> None:
    """single_positive keeps one positive per image among its seen positives, never an unseen one."""
    cfg = dataset_config(f"dataset.unseen_classes=[{','.join(UNSEEN)}]", "dataset.observed=single_positive")
    train = build_dataset(cfg, train=True)
    for i in range(len(train)):
        target, seen_positives = train.target(i), int((train.labels[i] == 1).sum())
        assert int((target == 1).sum()) == min(1, seen_positives)
        assert bool(train.labels[i][target == 1].eq(1).all())


@pytest.mark.parametrize("head", ["linear", "mldecoder", "csra"])
def test_a_head_without_text_queries_is_refused_at_config_check(head: str) -> None:
    cfg = compose_config([*SMALL, f"model/head={head}", "dataset.unseen_classes=[red_circle]"])
    with pytest.raises(ConfigError) as error:
        check_config(cfg, world_size=1)
    message = str(error.value)
    assert f"model/head={head} has no text queries" in message and "\n" not in message


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "oversized"])
def test_a_hostile_unseen_class_file_is_one_line_in_bounded_time_and_memory(tmp_path, kind: str) -> None:
    """A FIFO (a read that would block) or a 65 MiB sparse file (over CAPS['class list']): one line."""
    path = tmp_path / "unseen.txt"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(65 * 2**20)
    outcome = bounded(unseen_class_names, str(path), ["red_circle", "blue_circle"], memory_mb=256, seconds=10)
    assert not outcome.escaped and outcome.error == "DatasetConfigError"
    message = outcome.message.strip()
    assert message.startswith("dataset.unseen_classes='") and "\n" not in message
    assert ("64.0 MiB" if kind == "oversized" else "regular file") in message
