"""mlcls-eval on a user's own test list: ``dataset.<key>=value`` replaces a key of the checkpoint's dataset
config (one line naming the closest keys for one it lacks); figures against scikit-learn on timm's logits."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch
import yaml
from inference_fixtures import IMAGE_SIZE, reference_logits, trained_run
from sklearn.metrics import average_precision_score

from mlcls.cli import eval as eval_cli
from mlcls.cli.eval import check_dataset_target, evaluation_dataset_config, packaged_dataset_targets
from mlcls.data import build_dataset
from mlcls.data.datasets.folds import held_out
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.errors import ConfigError

TEST_SIZE = 24


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory):
    """A checkpoint of the tiny run whose dataset config is a CSV folder (light transform, 32 px, classes
    inferred, validation held out of train.csv), the folder's test.csv, its image paths and labels."""
    run_dir = trained_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("mine")
    source = SyntheticMultiLabel("val", val_size=TEST_SIZE, seed=7)
    rows, paths = [], []
    for i in range(TEST_SIZE):
        path = root / "images" / f"{i:03d}.png"
        path.parent.mkdir(exist_ok=True)
        source.load_image(i).save(path)
        names = [name for name, y in zip(source.classes, source.labels[i].tolist(), strict=True) if y == 1]
        rows.append(f"images/{path.name},{' '.join(names)}\n")
        paths.append(path)
    (root / "train.csv").write_text("image,labels\n" + "".join(rows[:4]))
    (root / "test.csv").write_text("image,labels\n" + "".join(rows))
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert state["classes"] == list(source.classes)
    state["config"]["dataset"] = {
        "_target_": "mlcls.data.datasets.csv_dataset.CSVDataset",
        "name": "csv",
        "root": str(root),
        "image_size": IMAGE_SIZE,
        "transform": "light",
        "train_split": "train",
        "val_split": "val",
        "train_file": "train.csv",
        "val_file": None,
        "val_fraction": 0.5,
        "val_seed": 0,
        "image_column": "image",
        "labels_column": "labels",
        "label_delimiter": " ",
        "classes": None,
        "image_dir": "",
        "delimiter": None,
        "on_bad_image": "error",
    }
    checkpoint = root / "csv_run.pt"
    torch.save(state, checkpoint)
    return checkpoint, paths, source.labels.numpy()


def run_eval(argv, monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["mlcls-eval", *argv])
    code = 0
    try:
        eval_cli.main()
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_eval_on_a_test_csv_is_one_override(csv_run, monkeypatch, capsys, tmp_path):
    checkpoint, paths, labels = csv_run
    monkeypatch.chdir(tmp_path)
    argv = [f"checkpoint={checkpoint}", "dataset.val_file=test.csv", "workers=0", "device=cpu"]
    code, out, err = run_eval(argv, monkeypatch, capsys)
    assert code == 0, err
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["num_samples"] == TEST_SIZE
    logits = reference_logits(checkpoint, paths, "light").double().numpy()
    with_positive = labels.sum(0) > 0
    expected = np.mean(
        [average_precision_score(labels[:, c], logits[:, c]) for c in np.flatnonzero(with_positive)]
    )
    assert figures["mAP_class"] == pytest.approx(100 * expected, abs=1e-4)
    # the logits kept on disk, read a block of classes at a time: the same figures, bit for bit
    code, out, err = run_eval(
        [*argv, "metrics.in_memory_gb=0", f"metrics.scratch_dir={tmp_path}"], monkeypatch, capsys
    )
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == figures
    assert not list(tmp_path.glob("mlcls-eval-*"))  # its files removed


@pytest.mark.slow
def test_a_key_the_checkpoint_dataset_lacks_is_one_line(csv_run, monkeypatch, capsys, tmp_path):
    checkpoint, _, _ = csv_run
    monkeypatch.chdir(tmp_path)
    code, _, err = run_eval([f"checkpoint={checkpoint}", "dataset.val_fil=test.csv"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "mlcls: error: unknown option dataset.val_fil for the checkpoint's dataset (csv): "
        "did you mean dataset.val_file or dataset.val_fraction or dataset.val_split?"
    ]


def test_evaluation_dataset_config_replaces_keys_and_pins_the_checkpoint_classes():
    run = {"name": "csv", "root": "a", "val_file": None, "classes": None, "image_size": 32}
    merged = evaluation_dataset_config(run, {"val_file": "test.csv", "root": None}, ["b", "a"])
    assert merged == {
        "name": "csv",
        "root": "a",
        "val_file": "test.csv",
        "classes": ["b", "a"],
        "image_size": 32,
    }
    coco = {"name": "coco", "root": "/data/coco", "val_split": "val2014"}
    assert evaluation_dataset_config(coco, {"val_split": "val2017"}, ["x"]) == {
        **coco,
        "val_split": "val2017",
    }
    with pytest.raises(
        ConfigError, match=r"dataset \(coco\): coco has name, root, val_split$|coco\): dataset"
    ):
        evaluation_dataset_config(coco, {"year": 2017}, ["x"])


@pytest.mark.slow
def test_eval_prints_the_per_class_ap(csv_run, monkeypatch, capsys, tmp_path):
    checkpoint, paths, labels = csv_run
    monkeypatch.chdir(tmp_path)
    argv = [f"checkpoint={checkpoint}", "dataset.val_file=test.csv", "workers=0", "device=cpu"]
    code, out, err = run_eval(argv, monkeypatch, capsys)
    assert code == 0, err
    per_class = json.loads(out.strip().splitlines()[-1])["per_class_ap"]
    logits = reference_logits(checkpoint, paths, "light").double().numpy()
    classes = torch.load(checkpoint, weights_only=False)["classes"]
    assert list(per_class) == classes
    for c, name in enumerate(classes):
        if labels[:, c].sum() == 0:
            assert per_class[name] is None
        else:
            assert per_class[name] == pytest.approx(
                100 * average_precision_score(labels[:, c], logits[:, c]), abs=1e-4
            )


@pytest.mark.slow
def test_a_test_csv_is_evaluated_without_the_training_csv(csv_run, monkeypatch, capsys, tmp_path):
    checkpoint, paths, _ = csv_run
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(paths[0].parent.parent / "test.csv", mine / "test.csv")
    (mine / "images").symlink_to(paths[0].parent)
    state = torch.load(checkpoint, weights_only=False)
    state["config"]["dataset"]["root"] = str(mine)  # a folder without train.csv
    torch.save(state, tmp_path / "moved.pt")
    monkeypatch.chdir(tmp_path)
    argv = [f"checkpoint={tmp_path / 'moved.pt'}", "dataset.val_file=test.csv", "workers=0", "device=cpu"]
    code, out, err = run_eval(argv, monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["num_samples"] == TEST_SIZE


@pytest.mark.slow
def test_a_run_trained_with_a_relative_root_evaluates_from_another_directory(
    csv_run, monkeypatch, capsys, tmp_path
):
    from conftest import compose_config

    from mlcls.cli.train import run

    _, paths, _ = csv_run
    data = tmp_path / "a" / "data"
    data.mkdir(parents=True)
    shutil.copy(paths[0].parent.parent / "test.csv", data / "train.csv")
    (data / "images").symlink_to(paths[0].parent)
    monkeypatch.chdir(tmp_path / "a")
    overrides = [
        "dataset=csv", "dataset.root=data", "dataset.val_fraction=0.5", "dataset.val_by=hashed",
        "dataset.image_size=32", "dataset.transform=light", "model.name=resnet10t", "model.pretrained=false",
        "trainer.epochs=1",
        "trainer.batch_size=4", "trainer.limit_train_batches=1", "trainer.workers=0", "trainer.device=cpu",
        "trainer.report=false",
    ]  # fmt: skip
    run(compose_config(overrides), run_dir=tmp_path / "run")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["dataset"]["root"] == str(data)
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    argv = [f"checkpoint={tmp_path / 'run' / 'checkpoints' / 'best.pt'}", "workers=0", "device=cpu"]
    code, out, err = run_eval(argv, monkeypatch, capsys)
    assert code == 0, err
    held = [i for i in range(TEST_SIZE) if held_out(f"images/{i:03d}.png", 0.5, 0)]
    assert json.loads(out.strip().splitlines()[-1])["num_samples"] == len(held)


def test_a_dataset_target_of_no_released_format_is_refused_and_the_current_one_evaluates():
    """Every checkpoint comes from this version: a ``_target_`` at a module path mlcls never released (the
    old code mapped ``mlcls.data.synthetic...`` to its current module) is refused with one line."""
    old = {"_target_": "mlcls.data.synthetic.SyntheticMultiLabel", "name": "synthetic", "image_size": 32}
    with pytest.raises(ConfigError, match=r"^the checkpoint's dataset._target_='mlcls.data.synthetic.Synth"):
        check_dataset_target(evaluation_dataset_config(old, {}, ["x"]))
    run = {**old, "_target_": "mlcls.data.datasets.synthetic.SyntheticMultiLabel"}
    merged = evaluation_dataset_config(run, {}, ["x"])
    assert merged["_target_"] in packaged_dataset_targets()
    check_dataset_target(merged)  # a dataset of mlcls: accepted
    dataset = build_dataset({**merged, "val_size": 4, "transform": "light"}, train=False)
    assert isinstance(dataset, SyntheticMultiLabel) and len(dataset) == 4


@pytest.mark.slow
def test_eval_amp_runs_under_cpu_autocast(csv_run, monkeypatch, capsys, tmp_path):
    """amp=bf16 on the CPU evaluates under CPU autocast (the network's output is bf16), as training does."""
    checkpoint, _, _ = csv_run
    monkeypatch.chdir(tmp_path)
    dtypes = []
    forward = torch.nn.Module.__call__

    def recording_call(module, *args, **kwargs):
        out = forward(module, *args, **kwargs)
        if not dtypes and isinstance(out, torch.Tensor) and out.dim() == 2:
            dtypes.append(out.dtype)  # the first 2-D output: the classifier's logits
        return out

    monkeypatch.setattr(torch.nn.Module, "__call__", recording_call)
    argv = [f"checkpoint={checkpoint}", "dataset.val_file=test.csv", "workers=0", "device=cpu", "amp=bf16"]
    code, _, err = run_eval(argv, monkeypatch, capsys)
    assert code == 0, err
    assert dtypes == [torch.bfloat16]


@pytest.mark.slow
def test_nan_weights_are_one_line(csv_run, monkeypatch, capsys, tmp_path):
    """A classifier row of NaN: one line saying the scores are NaN, not the metrics' ValueError."""
    checkpoint, _, _ = csv_run
    state = torch.load(checkpoint, weights_only=False)
    state["model"]["fc.weight"][5].fill_(torch.nan)
    torch.save(state, tmp_path / "nan.pt")
    monkeypatch.chdir(tmp_path)
    argv = [f"checkpoint={tmp_path / 'nan.pt'}", "dataset.val_file=test.csv", "workers=0", "device=cpu"]
    code, out, err = run_eval(argv, monkeypatch, capsys)
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        f"mlcls: error: the model's scores are NaN for {TEST_SIZE} of {TEST_SIZE} images: its weights hold "
        "NaN or infinite values (a diverged run or a damaged checkpoint)"
    ]
