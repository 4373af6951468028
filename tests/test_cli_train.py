"""End-to-end training on the embedded dataset: outputs, resume, torchrun, and user errors."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
from conftest import compose_config, run_main
from ranks import free_port, run_ranks
from sklearn.metrics import average_precision_score

from mlcls.cli.eval import main as eval_main
from mlcls.cli.train import main as train_main
from mlcls.cli.train import run
from mlcls.engine.trainer import Trainer


def chance_map_class(labels: np.ndarray, draws: int = 20, seed: int = 0) -> float:
    """Expected mAP@class (percent) of random scores on ``labels``, estimated with scikit-learn."""
    rng = np.random.default_rng(seed)
    values = [
        np.mean(
            [average_precision_score(labels[:, c], rng.random(len(labels))) for c in range(labels.shape[1])]
        )
        for _ in range(draws)
    ]
    return 100.0 * float(np.mean(values))


@pytest.mark.slow
def test_default_run_writes_results_and_beats_chance(tmp_path, tiny):
    cfg = compose_config([*tiny, "trainer.report=true"])  # with its plots
    results = run(cfg, run_dir=tmp_path)

    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["epochs_completed"] == 2
    assert set(on_disk["metrics"]) >= {"mAP_class", "mAP_sample"}
    held_out = on_disk["metrics"]["thresholds"]  # calibrated on 37 of the 75 validation images
    assert (held_out["rule"], held_out["calibrated_rows"], held_out["measured_rows"]) == ("f1", 37, 38)
    assert 0 <= held_out["per_class"]["F1_mean"] <= 100 and 0 <= held_out["global"]["F1_mean"] <= 100
    assert (
        set(on_disk["best"]) >= {"epoch", "mAP_class", "mAP_sample"} and on_disk["best"]["weights"] == "raw"
    )
    assert on_disk["dataset"] == {"name": "synthetic", "num_classes": 12, "train_size": 192, "val_size": 75}
    assert len(on_disk["per_class_ap"]) == 12 and "red_circle" in on_disk["per_class_ap"]
    assert on_disk["metrics"]["mAP_class"] == pytest.approx(results["metrics"]["mAP_class"])
    for name in ("config.yaml", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (tmp_path / name).is_file(), name
    assert any((tmp_path / "tb").iterdir())
    for png in ("per_class_ap.png", "pr_curves.png", "training_curves.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000, png
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=False)
    assert best["thresholds"].shape == (12,) and best["preprocess"]["image_size"] == 32
    assert best["classes"] == on_disk_classes(on_disk)

    from mlcls.data.datasets.synthetic import SyntheticMultiLabel

    val_labels = SyntheticMultiLabel("val", val_size=75).labels.numpy()
    chance = chance_map_class(val_labels)
    assert on_disk["metrics"]["mAP_class"] > chance + 10, (on_disk["metrics"], chance)


def on_disk_classes(results: dict) -> list[str]:
    return list(results["per_class_ap"])


class _StopAfterFirstEpoch(Trainer):
    """A trainer that dies right after writing the checkpoint of epoch 1, as a killed job would."""

    def save(self, is_best: bool) -> None:
        super().save(is_best)
        if self.state.epoch == 1:
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    "head",
    [
        [],
        # the other heads (model.head), with EMA weights in the checkpoint too
        ["model/head=mldecoder", "model.head.num_groups=5", "trainer.ema_decay=0.9"],
        ["model/head=csra", "model.head.num_heads=2", "trainer.ema_decay=0.9"],
    ],
    ids=["linear", "mldecoder", "csra"],
)
@pytest.mark.slow
def test_resume_after_epoch_matches_uninterrupted_run(tmp_path, tiny, head):
    # 3 steps of 16 images per epoch, on 16-pixel images: the point is the bitwise equality, not learning
    tiny = [*tiny, *head, "dataset.train_size=48", "trainer.batch_size=16", "dataset.val_size=16"]
    tiny += ["dataset.image_size=16"]
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight = run(compose_config([*tiny]), run_dir=straight_dir)

    with pytest.raises(KeyboardInterrupt):
        _StopAfterFirstEpoch(compose_config(tiny), run_dir=resumed_dir).fit()
    assert (resumed_dir / "checkpoints" / "last.pt").is_file()
    resumed = run(compose_config([*tiny, "trainer.resume=auto"]), run_dir=resumed_dir)

    a = torch.load(straight_dir / "checkpoints" / "last.pt", weights_only=False)["model"]
    b = torch.load(resumed_dir / "checkpoints" / "last.pt", weights_only=False)["model"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["metrics"]["mAP_class"] == straight["metrics"]["mAP_class"]
    assert resumed["metrics"]["mAP_sample"] == straight["metrics"]["mAP_sample"]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]


def _train_rank(rank: int, port: int, cwd: str, argv: list[str]) -> None:
    """``mlcls-train *argv`` in directory ``cwd`` as rank ``rank`` of 2, in the environment that
    ``torchrun --standalone --nproc_per_node=2`` gives its processes (gloo on the CPU)."""
    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    os.chdir(cwd)
    sys.argv = ["mlcls-train", *argv]
    train_main()


@pytest.mark.slow
@pytest.mark.parametrize(
    # the linear head on two ranks: test_engine_distributed.py (two torchrun nodes) and
    # test_engine_trainer_cluster.py
    "head",
    [["model/head=mldecoder", "model.head.num_groups=5"]],
    ids=["mldecoder"],
)
def test_two_ranks_one_run_dir_and_exact_evaluation(tmp_path, tiny, head, monkeypatch, capsys):
    """Two ranks forked from this process (torchrun itself: test_engine_distributed.py), one run directory,
    and an evaluation of the 75 validation images split unevenly over the ranks equal to one process's."""
    run_dir = tmp_path / "ddp"
    # 64 training images of 16 pixels: one step of 32 per process; 75 validation images, split unevenly
    overrides = [o for o in tiny if not o.startswith("trainer.epochs")] + [
        "trainer.epochs=1",
        "dataset.train_size=64",
        "dataset.image_size=16",
        *head,
        "trainer.device=cpu",
    ]
    run_ranks(_train_rank, (free_port(), str(tmp_path), overrides), 2, 300, "the two training ranks")
    # Hydra's default directory (outputs/<date>/<time>, each rank reading its own clock): rank 0's holds the
    # run, and no stray per-process directory is left
    made = [path for path in (tmp_path / "outputs").glob("*/*") if path.is_dir()]
    assert len(made) == 1, made
    made[0].rename(run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 2 and results["epochs_completed"] == 1

    monkeypatch.chdir(tmp_path)
    argv = ["mlcls-eval", f"checkpoint={run_dir / 'checkpoints' / 'last.pt'}", "workers=0", "batch_size=16"]
    code, err, out = run_main(eval_main, argv, monkeypatch, capsys)
    assert code == 0, err[-20:]
    single = json.loads(out.strip().splitlines()[-1])
    assert single["num_samples"] == 75
    assert single["mAP_class"] == pytest.approx(results["metrics"]["mAP_class"], abs=1e-6)
    assert single["mAP_sample"] == pytest.approx(results["metrics"]["mAP_sample"], abs=1e-6)


def test_unknown_option_lists_valid_ones(tmp_path, monkeypatch, capsys):
    """In this process (test_missing_dataset_root_is_one_line runs the installed mlcls-train)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    code, err, _ = run_main(train_main, ["mlcls-train", "loss=nope"], monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert "Could not find 'loss/nope'" in err[0]
    assert "Available options in 'loss'" in err[0] and "bce" in err[0]


def test_missing_dataset_root_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    missing = tmp_path / "no-such-coco"
    code, err, _ = run_main(
        train_main, ["mlcls-train", "dataset=coco", f"dataset.root={missing}"], monkeypatch, capsys
    )
    assert code == 2 and len(err) == 1, err
    assert str(missing) in err[0] and "expected layout" in err[0]
