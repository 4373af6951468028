"""The held-out selection split (dataset.val_fraction): the cut, its labels, the epoch it selects, and
its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import TINY, assert_dataset_setting_refused, compose_config
from torchvision.transforms.functional import pil_to_tensor

from mlcls.data import DatasetConfigError
from mlcls.data.datasets.labels import LabelCounts, label_counts
from mlcls.data.datasets.observed import HoldoutSplit
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.shards.datasets import ShardTrainSet
from mlcls.data.views import POLICY_KEYS, DatasetView, apply_training_policies, split_holdout
from mlcls.engine import trainer as trainer_module
from mlcls.engine.trainer import Trainer
from mlcls.inference.predictor import load_inference_model
from mlcls.metrics.thresholds import NEVER_PREDICTED, calibrate_thresholds, describe_rule

MASK = 2**64 - 1
# The trained tests' data: half of TINY's training images, 40 validation images.
TRAIN, VAL = 96, 40
SMALL = [*TINY, f"dataset.train_size={TRAIN}", f"dataset.val_size={VAL}"]


def splitmix(value: int) -> int:
    """SplitMix64's output function in Python integers: the reference of the documented draw."""
    z = (value + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_held_out(fraction: float, seed: int, index: int) -> bool:
    """Sample ``index`` is held out when the top 53 bits of the hash of (seed, index), stream 3, fall below
    ``fraction``."""
    return (splitmix(splitmix(seed ^ 3) ^ index) >> 11) < fraction * 2**53


def synthetic(size: int = 200, **keys) -> SyntheticMultiLabel:
    """The synthetic training split, the policies among ``keys`` applied as ``build_dataset`` applies them."""
    policies = {key: keys.pop(key) for key in POLICY_KEYS if key in keys}
    dataset = SyntheticMultiLabel("train", train_size=size, val_size=8, **keys)
    return apply_training_policies(dataset, **policies)


def targets(dataset, indices) -> torch.Tensor:
    return torch.stack([dataset.target(int(i)) for i in indices])


@pytest.mark.slow
def test_the_cut_is_a_pure_function_of_seed_and_index() -> None:
    n, fraction = 20000, 0.2
    held = HoldoutSplit(fraction, "clean", 5).held_out(np.arange(n))
    assert [bool(h) for h in held[:300]] == [reference_held_out(fraction, 5, i) for i in range(300)]
    # about the fraction: within 4 standard deviations of the binomial
    assert abs(held.sum() - fraction * n) < 4 * np.sqrt(n * fraction * (1 - fraction))
    # each index alone, in any order: the same answer; another seed: another cut
    order = np.random.default_rng(0).permutation(n)[:500]
    assert np.array_equal(HoldoutSplit(fraction, "clean", 5).held_out(order), held[order])
    assert not np.array_equal(HoldoutSplit(fraction, "clean", 6).held_out(np.arange(n)), held)
    # another process (another rank) draws the same cut: a new interpreter runs the same module file, loaded
    # alone (numpy and torch imported, not mlcls.data's timm and torchvision: seconds of a child's start)
    code = (
        "import importlib.util, sys; import numpy as np; "
        "spec = importlib.util.spec_from_file_location('observed', sys.argv[1]); "
        "observed = sys.modules['observed'] = importlib.util.module_from_spec(spec); "
        "spec.loader.exec_module(observed); "
        f"held = observed.HoldoutSplit({fraction}, 'clean', 5).held_out(np.arange({n})); "
        "print(np.flatnonzero(held).tolist())"
    )
    source = sys.modules[HoldoutSplit.__module__].__file__
    other = subprocess.run([sys.executable, "-c", code, source], capture_output=True, text=True, check=True)
    assert json.loads(other.stdout) == np.flatnonzero(held).tolist()


@pytest.mark.parametrize("observed", ["all", "single_positive"])
def test_the_views_are_disjoint_and_do_not_depend_on_the_regime(observed: str) -> None:
    source = synthetic(observed=observed, val_fraction=0.25, val_seed=2)
    train, held = split_holdout(source, None)
    expected = np.array([reference_held_out(0.25, 2, i) for i in range(len(source))])
    assert np.array_equal(held.rows, np.flatnonzero(expected))
    assert np.array_equal(train.rows, np.flatnonzero(~expected))
    assert len(train) + len(held) == len(source) and not set(train.rows) & set(held.rows)


def test_clean_and_observed_held_out_labels() -> None:
    keys = {"observed": "single_positive", "observed_seed": 4, "val_fraction": 0.3}
    clean_source = synthetic(**keys, val_labels="clean")
    observed_source = synthetic(**keys, val_labels="observed")
    train, clean = split_holdout(clean_source, None)
    _, observed = split_holdout(observed_source, None)
    assert np.array_equal(clean.rows, observed.rows)
    # clean: the full labels of the held-out rows; observed: the regime's rows for those samples
    assert torch.equal(targets(clean, range(len(clean))), clean_source.labels[clean.rows])
    regime_rows = targets(observed_source, observed.rows)
    assert torch.equal(targets(observed, range(len(observed))), regime_rows)
    assert ((regime_rows == 1).sum(1) == 1).all() and not torch.equal(
        regime_rows, clean_source.labels[clean.rows]
    )
    # the training view: the regime's rows as without the cut, and their counts
    train_rows = targets(train, range(len(train)))
    assert torch.equal(train_rows, targets(clean_source, train.rows))
    counts, reference = label_counts(train), LabelCounts.of(train_rows)
    assert counts.num_samples == len(train)
    assert torch.equal(counts.positives, reference.positives)
    assert torch.equal(counts.negatives, reference.negatives)


def test_the_held_out_view_reads_with_the_evaluation_transform() -> None:
    source = synthetic(transform=lambda image: ("train", pil_to_tensor(image)), val_fraction=0.25)
    train, held = split_holdout(source, pil_to_tensor)
    image, target = held[3]
    assert torch.equal(image, pil_to_tensor(source.load_image(int(held.rows[3]))))
    assert torch.equal(target, source.labels[held.rows[3]])
    assert train[0][0][0] == "train" and source.transform is train.transform  # the source keeps its own


def scripted_evaluation(val: list[float], held: list[float], calls: list[tuple[str, int]]):
    """evaluate with its mAP@class replaced by ``val[e]`` / ``held[e]`` at the e-th evaluation of
    the validation / held-out set (the rows evaluated recorded in ``calls``)."""
    real = trainer_module.evaluate

    def evaluate(model, loader, *args, **kwargs):
        evaluation = real(model, loader, *args, **kwargs)
        which = "holdout" if isinstance(loader.dataset, DatasetView) else "val"
        count = sum(1 for name, _ in calls if name == which)
        calls.append((which, len(evaluation.scores)))
        evaluation.metrics["mAP_class"] = (held if which == "holdout" else val)[count]
        return evaluation

    return evaluate


@pytest.mark.slow
def test_the_held_out_split_selects_the_epoch(tmp_path, monkeypatch) -> None:
    calls: list[tuple[str, int]] = []
    # the validation split would pick epoch 3, the held-out split picks epoch 2
    monkeypatch.setattr(trainer_module, "evaluate", scripted_evaluation([10, 20, 30], [50, 60, 40], calls))
    cfg = compose_config([*SMALL, "trainer.epochs=3", "dataset.val_fraction=0.25"])
    trainer = Trainer(cfg, run_dir=tmp_path)
    results = trainer.fit()
    held = np.array([reference_held_out(0.25, 0, i) for i in range(TRAIN)])
    assert len(trainer.data.train_set) == (~held).sum() and len(trainer.data.holdout_set) == held.sum()
    assert calls == [("val", VAL), ("holdout", held.sum())] * 3
    assert json.loads((tmp_path / "results.json").read_text())["best"] == results["best"]
    best = results["best"]
    assert (best["epoch"], best["mAP_class"], best["selected_on"]) == (2, 20, "holdout")
    assert best["selection"]["mAP_class"] == 60 and trainer.state.best == best
    assert [record["mAP_class"] for record in results["history"]] == [10, 20, 30]
    assert [record["selection"]["mAP_class"] for record in results["history"]] == [50, 60, 40]
    assert results["metrics"]["mAP_class"] == 30 and results["metrics"]["selection"]["mAP_class"] == 40
    assert (
        results["dataset"]["train_size"] == (~held).sum() and results["dataset"]["holdout_size"] == held.sum()
    )
    best_pt = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    last_pt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert best_pt["epoch"] == 2 and best_pt["best"] == best
    assert any(not torch.equal(best_pt["model"][k], last_pt["model"][k]) for k in last_pt["model"])


@pytest.mark.parametrize(
    ("overrides", "split"),
    [
        (["dataset.val_fraction=0.25"], "holdout"),
        (["dataset.val_fraction=0.25", "dataset.observed=single_positive"], "holdout"),  # clean labels
        (
            [
                "dataset.val_fraction=0.25",
                "dataset.observed=partial",
                "dataset.observed_fraction=0.5",
                "dataset.val_labels=observed",
            ],
            "validation",
        ),  # fmt: skip
        ([], "validation"),
    ],
)
@pytest.mark.slow
def test_thresholds_are_calibrated_on_the_held_out_split_when_its_labels_are_the_datasets(
    tmp_path, monkeypatch, overrides: list[str], split: str
) -> None:
    """The deployed thresholds are not fitted on the split the run reports when a held-out split with the
    dataset's own labels exists; with observed labels only (few known negatives) they stay on validation."""
    real, seen = trainer_module.evaluate, {}

    def evaluate(model, loader, *args, **kwargs):
        evaluation = real(model, loader, *args, **kwargs)
        seen["holdout" if isinstance(loader.dataset, DatasetView) else "validation"] = evaluation
        return evaluation

    monkeypatch.setattr(trainer_module, "evaluate", evaluate)
    cfg = compose_config([*SMALL, "trainer.epochs=1", *overrides])
    Trainer(cfg, run_dir=tmp_path).fit()
    assert sorted(seen) == (["holdout", "validation"] if overrides else ["validation"])
    expected = {
        name: calibrate_thresholds(e.scores, e.labels, no_positive=NEVER_PREDICTED)
        for name, e in seen.items()
    }
    for name in ("last.pt", "best.pt"):  # one epoch: the raw weights of epoch 1 are the best
        stored = torch.load(tmp_path / "checkpoints" / name, weights_only=True)
        assert stored["thresholds_split"] == split
        assert torch.equal(stored["thresholds"], expected[split])
    if len(expected) == 2:
        assert not torch.equal(expected["holdout"], expected["validation"])
    inference = load_inference_model(tmp_path / "checkpoints" / "best.pt", device="cpu")
    assert inference.thresholds_split == split
    where = "held-out share of the training set" if split == "holdout" else "validation set"
    rule = describe_rule(inference.thresholds, None, None, inference.classes, inference.thresholds_split)
    assert rule.startswith(f"per-class thresholds calibrated on the {where} (max F1)")


@pytest.mark.slow
def test_without_a_held_out_split_results_keep_their_format(tmp_path) -> None:
    cfg = compose_config([*SMALL, "trainer.epochs=1"])
    results = Trainer(cfg, run_dir=tmp_path).fit()
    assert set(results["best"]) == {"epoch", "mAP_class", "mAP_sample", "weights"}
    assert "selection" not in results["metrics"] and "selection" not in results["history"][0]
    assert set(results["dataset"]) == {"name", "num_classes", "train_size", "val_size"}
    assert results["dataset"]["train_size"] == TRAIN


@pytest.mark.slow
def test_a_per_sample_loss_trains_on_the_rest(tmp_path) -> None:
    cfg = compose_config([*SMALL, "loss=role", "loss.expected_positives=2", "trainer.epochs=1",
                          "dataset.observed=single_positive", "dataset.val_fraction=0.25"])  # fmt: skip
    trainer = Trainer(cfg, run_dir=tmp_path)
    trainer.fit()
    rest = int(sum(not reference_held_out(0.25, 0, i) for i in range(TRAIN)))
    assert trainer.criterion.label_logits.shape == (rest, 12)
    assert int(trainer.criterion.seen.sum()) == trainer.iters_per_epoch * 32


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dataset.val_fraction=1", "dataset.val_fraction=1; expected a number in [0, 1)"),
        ("dataset.val_fraction=-0.1", "dataset.val_fraction=-0.1; expected a number in [0, 1)"),
        ("dataset.val_labels=full", "dataset.val_labels='full'; expected one of clean, observed"),
        ("dataset.val_seed=-1", "dataset.val_seed=-1; expected an integer from 0"),
    ],
)
def test_bad_settings_are_one_line(override: str, message: str, capsys) -> None:
    assert_dataset_setting_refused(override, message, capsys)


@pytest.mark.slow
def test_a_cut_with_an_empty_side_stops_before_training(tmp_path) -> None:
    size = 40
    assert not any(reference_held_out(0.001, 0, i) for i in range(size))
    cfg = compose_config([*TINY, f"dataset.train_size={size}", "trainer.batch_size=8",
                          "dataset.val_fraction=0.001"])  # fmt: skip
    with pytest.raises(DatasetConfigError, match="holds out 0 of the 40 training samples") as error:
        Trainer(cfg, run_dir=tmp_path)
    assert "\n" not in str(error.value)


def test_shards_refuse_a_held_out_split() -> None:
    shards = ShardTrainSet.__new__(ShardTrainSet)  # what open_shards gives, no file read
    shards.train_split, shards.val_split = "train", "val"
    with pytest.raises(DatasetConfigError, match="packed shards are read in sequence") as error:
        apply_training_policies(shards, val_fraction=0.2)
    assert "\n" not in str(error.value)
    with pytest.raises(DatasetConfigError, match="val_labels"):
        apply_training_policies(shards, val_labels="full")


def test_one_set_of_keys_holds_out_validation_or_selects_by_the_dataset(tmp_path) -> None:
    """``dataset.val_fraction``: the csv dataset without ``val_file`` cuts its validation split from its
    training file with it (no selection split); with ``val_file``, as every dataset with a validation split
    of its own, it is a share of the training split that selects the epoch."""
    from test_data_csv_dataset import write_csv

    from mlcls.data import build_dataset

    images = [f"{i:02d}.jpg" for i in range(20)]
    text = "image,labels\n" + "".join(f"{name},{'ab'[i % 2]}\n" for i, name in enumerate(images))
    root = write_csv(tmp_path, text, images=images)
    (root / "val.csv").write_text("image,labels\n00.jpg,a\n01.jpg,b\n")
    csv = compose_config(["dataset=csv", f"dataset.root={root}", "dataset.val_fraction=0.25"]).dataset
    train, val = build_dataset(csv, train=True), build_dataset(csv, train=False)
    assert train.selection_split.fraction == 0 and (len(train), len(val)) == (15, 5)  # ceil(0.25 * 20)
    csv.val_file = "val.csv"
    train, val = build_dataset(csv, train=True), build_dataset(csv, train=False)
    assert train.selection_split.fraction == 0.25 and (len(train), len(val)) == (20, 2)
    csv.val_fraction = None  # null: none selects beside a validation file
    assert build_dataset(csv, train=True).selection_split.fraction == 0


def test_a_stratified_selection_split_holds_out_a_positive_of_every_class_that_has_two() -> None:
    """``val_by=stratified`` on a dataset with a validation split of its own: ceil(fraction x N) samples held
    out (then one more per class left without), and each class with 2+ positives in the training split has
    one among them, where the hashed cut leaves some class without."""
    size, fraction = 60, 0.1
    covered = {}
    for by in ("stratified", "hashed"):
        train_set = synthetic(size, val_fraction=fraction, val_by=by)
        _, held = split_holdout(train_set, None)
        positives = np.asarray(train_set.source.labels) == 1
        has_two = positives.sum(0) >= 2
        covered[by] = bool(positives[held.rows][:, has_two].any(0).all())
        if by == "stratified":
            assert int(np.ceil(fraction * size)) <= len(held.rows) <= np.ceil(fraction * size) + has_two.sum()
    assert covered == {"stratified": True, "hashed": False}
