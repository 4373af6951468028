"""The base class: crop clamping, on_bad_image (error / skip, with DataLoader workers), build errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import corrupt, truncate, write_csv
from PIL import Image
from torch.utils.data import DataLoader

from mlcls.data import build_dataset
from mlcls.data.datasets import synthetic
from mlcls.data.datasets.base import (
    BadImageError,
    DatasetConfigError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
)
from mlcls.data.datasets.csv_dataset import CSVDataset
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.images import crop_box
from mlcls.data.pipeline.transforms import build_transform
from mlcls.data.views import apply_training_policies


def one_hot_dataset(root: Path, count: int, on_bad_image: str) -> CSVDataset:
    """``count`` images; row i is positive for class i only."""
    header = "image," + ",".join(f"c{i}" for i in range(count))
    lines = [f"{i}.jpg," + ",".join("1" if j == i else "0" for j in range(count)) for i in range(count)]
    write_csv(root, "\n".join([header, *lines]) + "\n", images=[f"{i}.jpg" for i in range(count)])
    return CSVDataset(
        "train",
        transform=build_transform("light", 8, train=False),
        root=str(root),
        labels_column=None,
        val_fraction=0.0,
        on_bad_image=on_bad_image,
    )


def test_crop_box_clamps_and_falls_back_to_the_whole_image() -> None:
    assert crop_box((22, 5, 30, 40), 40, 30) == (22, 5, 40, 30)
    assert crop_box((-4.5, -3, 14, 13), 40, 30) == (0, 0, 10, 10)
    assert crop_box((50, 5, 10, 10), 40, 30) == (0, 0, 40, 30)


def test_error_mode_names_the_file(tmp_path: Path) -> None:
    dataset = one_hot_dataset(tmp_path, 3, "error")
    corrupt(tmp_path / "1.jpg")
    truncate(tmp_path / "2.jpg")
    assert dataset[0][1].tolist() == [1, 0, 0]
    with pytest.raises(BadImageError, match=f"cannot read image {re.escape(str(tmp_path / '1.jpg'))}"):
        dataset[1]
    with pytest.raises(
        BadImageError, match=f"(?i)cannot read image {re.escape(str(tmp_path / '2.jpg'))}.*truncated"
    ):
        dataset[2]


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_skip_mode_replaces_and_counts_across_worker_processes(tmp_path: Path, persistent: bool) -> None:
    dataset = one_hot_dataset(tmp_path, 6, "skip")
    corrupt(tmp_path / "1.jpg")
    truncate(tmp_path / "2.jpg")
    loader = DataLoader(dataset, batch_size=2, num_workers=2, shuffle=False, persistent_workers=persistent)
    for _ in range(2):  # two epochs: the record is per epoch
        targets = torch.cat([target for _, target in loader])
        # samples 1 and 2 are replaced by the next readable one, sample 3
        assert targets.argmax(dim=1).tolist() == [0, 3, 3, 3, 4, 5]
        assert dataset.pop_bad_images() == [str(tmp_path / "1.jpg"), str(tmp_path / "2.jpg")]
        assert dataset.pop_bad_images() == []


def test_skip_mode_wraps_around_and_gives_up_on_a_wrong_folder(tmp_path: Path) -> None:
    dataset = one_hot_dataset(tmp_path, 3, "skip")
    corrupt(tmp_path / "2.jpg")
    assert dataset[2][1].tolist() == [1, 0, 0]
    for i in range(3):
        corrupt(tmp_path / f"{i}.jpg")
    with pytest.raises(BadImageError, match="3 consecutive unreadable images"):
        dataset[0]


def test_on_bad_image_value_is_checked(tmp_path: Path) -> None:
    with pytest.raises(DatasetConfigError, match="unknown on_bad_image 'ignore'"):
        one_hot_dataset(tmp_path, 2, "ignore")


def test_build_dataset_raises_the_dataset_error_itself(tmp_path: Path) -> None:
    cfg = {"_target_": "mlcls.data.datasets.voc.VOC", "name": "voc2007", "root": str(tmp_path),
           "image_size": 32, "transform": "paper", "train_split": "trainval", "val_split": "test",
           "year": 2007}  # fmt: skip
    with pytest.raises(DatasetLayoutError, match=r"^missing .*trainval\.txt; expected layout"):
        build_dataset(cfg, train=True)


class _Labelled(MultiLabelDataset):
    """A dataset whose label matrix is given as it is."""

    def __init__(self, labels: torch.Tensor) -> None:
        super().__init__()
        self.split = "train"
        self.classes = ["cat", "dog", "bird"]
        self.labels = labels


def test_labels_are_checked_when_the_dataset_is_built() -> None:
    labels = _Labelled(torch.tensor([[1, 0, -1], [0, 0, 1]])).labels
    assert labels.dtype == torch.float32 and labels.tolist() == [[1, 0, -1], [0, 0, 1]]
    message = (
        "_Labelled (train split): label 2 for sample 1, class 'dog'; "
        "expected 1 (positive), 0 (negative) or -1 (unknown)"
    )
    with pytest.raises(DatasetFormatError, match=f"^{re.escape(message)}$"):
        _Labelled(torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.5]]))
    with pytest.raises(DatasetFormatError, match=r"label nan for sample 0, class 'bird'"):
        _Labelled(torch.tensor([[1.0, 0.0, float("nan")]]))
    with pytest.raises(DatasetFormatError, match=r"labels of shape \(2, 2\); expected \(samples, 3\)"):
        _Labelled(torch.zeros(2, 2))


def test_dataset_configs_instantiate_as_they_are(tmp_path: Path) -> None:
    """The shipped config, less the training policies and the pipeline keys (build_dataset's), gives the
    dataset as it is; build_dataset builds the named transform for the split; a misspelt key is refused."""
    from conftest import compose_config
    from data_fixtures import write_voc
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    root = write_voc(tmp_path, 2007)
    from mlcls.data import PIPELINE_KEYS
    from mlcls.data.views import POLICY_KEYS

    composed = compose_config(["dataset=voc2007", f"dataset.root={root}", "dataset.image_size=48"]).dataset
    # the training policies and the pipeline keys are build_dataset's, not the dataset's: the rest
    # instantiates as it is
    plain = OmegaConf.to_container(composed)
    cfg = OmegaConf.create({k: v for k, v in plain.items() if k not in (*POLICY_KEYS, *PIPELINE_KEYS)})
    train = instantiate(cfg, split=cfg.train_split)
    test = instantiate(cfg, split=cfg.val_split)
    assert (train.name, train.train_split, train.val_split) == ("voc2007", "trainval", "test")
    assert train.transform is None
    built_train, built_test = build_dataset(composed, train=True), build_dataset(composed, train=False)
    assert repr(built_train.transform) == repr(build_transform("paper", 48, train=True))
    assert repr(built_test.transform) == repr(build_transform("paper", 48, train=False))
    assert len(train) == 3 and len(test) == 2
    built = build_dataset(composed, train=True, backend="fast")
    assert (
        type(built.transform).__name__ == "FastTrainTransform"
        and built.labels.tolist() == train.labels.tolist()
    )
    typo = {**OmegaConf.to_container(cfg), "image_sise": 48}
    with pytest.raises(InstantiationException, match="image_sise"):
        instantiate(typo, split="test")


@pytest.mark.parametrize("size", ["-8", "0", "4097"])
def test_an_image_size_out_of_range_is_refused_where_the_dataset_is_built(size, capsys):
    """Checked once, by the data package, before any data is read (the config check no longer repeats it)."""
    from conftest import assert_dataset_setting_refused

    assert_dataset_setting_refused(f"dataset.image_size={size}", f"dataset.image_size={size}", capsys)


# Keys whose Python default means "none given" and whose config value is the user's to set: a dataset built
# in Python gets no transform (the PIL image) and reads its folder from the caller.
USER_KEYS = {"transform", "root", "split"}
# The keys each config sets for its own dataset, which MultiLabelDataset takes with a generic default.
PER_DATASET_KEYS = {"name", "image_size", "train_split", "val_split"}


@pytest.mark.slow
def test_python_defaults_equal_the_dataset_configs_defaults() -> None:
    """For every key a dataset config and its class (or function, and the classes it passes the keys to)
    both have, the default is one value. old: CSVDataset defaulted to holdout="hashed", its config to
    stratified."""
    import inspect

    from conftest import compose_config
    from hydra.utils import get_method
    from omegaconf import OmegaConf

    from mlcls import config_dir
    from mlcls.data.shards.datasets import ShardTrainSet

    compared, nodes = 0, {}
    for path in sorted((config_dir() / "dataset").glob("*.yaml")):
        if path.stem != "base":
            node = compose_config([f"dataset={path.stem}"]).dataset
            nodes[path] = OmegaConf.to_container(node, resolve=True)
    for path, node in nodes.items():
        # a key in which two configs of one class differ (VOC's year) chooses between them: no default
        chosen = {
            key
            for other in nodes.values()
            if other["_target_"] == node["_target_"]
            for key in node
            if other.get(key) != node[key]
        }
        target = get_method(node["_target_"])
        owners = [*inspect.getmro(target)] if inspect.isclass(target) else [target, ShardTrainSet]
        defaults: dict = {}
        for owner in reversed([*owners, MultiLabelDataset]):
            function = owner.__init__ if inspect.isclass(owner) else owner
            for name, parameter in inspect.signature(function).parameters.items():
                if parameter.default is not inspect.Parameter.empty:
                    defaults[name] = parameter.default
        for key in sorted(set(node) & set(defaults) - USER_KEYS - PER_DATASET_KEYS - chosen):
            expected = list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key]
            assert node[key] == expected, f"{path.name}: {key}={node[key]!r}, Python default {expected!r}"
            compared += 1
    assert compared > 30


class _DecodesItself:
    """A transform with its own ``decode_bytes`` (as the fast pipeline's), which yields no image."""

    def decode_bytes(self, data: bytes, box: object) -> str:
        return f"decoded {len(data)} bytes"

    def __call__(self, decoded: str) -> str:
        return decoded


def test_the_picture_is_the_file_whatever_the_transform_decodes(tmp_path: Path) -> None:
    """``load_image`` gives the transform's own decoding; ``picture`` (the reports' thumbnails) the file as
    PIL decodes it, through a training view too (the audit page's dataset)."""
    dataset = one_hot_dataset(tmp_path, 2, "error")
    dataset.transform = _DecodesItself()
    assert dataset.load_image(1) == f"decoded {(tmp_path / '1.jpg').stat().st_size} bytes"
    with Image.open(tmp_path / "1.jpg") as reference:
        expected = np.asarray(reference.convert("RGB"))
    assert np.array_equal(np.asarray(dataset.picture(1)), expected)
    view = apply_training_policies(dataset, observed="single_positive")
    assert np.array_equal(np.asarray(view.picture(1)), expected)


def test_a_synthetic_picture_is_kept_once_drawn_and_drawn_again_for_other_labels(monkeypatch) -> None:
    """A kept picture is the one a dataset that keeps none draws (pixel for pixel), for the labels the row
    has now; a split whose pixels exceed ``KEPT_BYTES`` keeps none."""
    kept = SyntheticMultiLabel("train", train_size=6, canvas_size=24, seed=3)

    def drawn(labels: torch.Tensor) -> list[np.ndarray]:
        with monkeypatch.context() as patch:
            patch.setattr(synthetic, "KEPT_BYTES", 0)
            fresh = SyntheticMultiLabel("train", train_size=6, canvas_size=24, seed=3)
        assert fresh._drawn is None
        fresh.labels = labels
        return [np.asarray(fresh.picture(i)) for i in range(6)]

    first = [np.asarray(kept.picture(i)) for i in range(6)]
    assert len(kept._drawn) == 6
    assert all(np.array_equal(a, np.asarray(kept.picture(i))) for i, a in enumerate(first))
    assert all(np.array_equal(a, b) for a, b in zip(first, drawn(kept.labels), strict=True))
    kept.labels = 1 - kept.labels  # every row relabelled: each picture drawn again, with the other shapes
    again = [np.asarray(kept.picture(i)) for i in range(6)]
    assert all(np.array_equal(a, b) for a, b in zip(again, drawn(kept.labels), strict=True))
    assert not any(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
