"""A real (tiny) zero-shot training run: the unseen classes' positives never reach the loss, evaluation scores
all twelve classes through the text head and results.json holds metrics.zsl and metrics.gzsl."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import TINY, compose_config

from mlcls.cli import eval as eval_cli
from mlcls.cli import tables as tables_cli
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.engine.trainer import Trainer
from mlcls.models.heads.text_query import text_query_head

UNSEEN = ["red_circle", "green_square", "blue_triangle"]
RUN = [
    *TINY,
    "dataset.train_size=64",
    "dataset.val_size=48",
    "trainer.epochs=1",
    "model/head=cosine",
    "text=words",
    f"dataset.unseen_classes=[{','.join(UNSEEN)}]",
]


@pytest.fixture(scope="module")
def zero_shot_run(tmp_path_factory):
    """The trainer after one epoch of 2 steps, the targets every loss call received, and the run dir."""
    run_dir = tmp_path_factory.mktemp("zsl")
    trainer = Trainer(compose_config([*RUN]), run_dir=run_dir)
    targets: list[torch.Tensor] = []
    trainer.criterion.register_forward_pre_hook(lambda module, args: targets.append(args[1].detach().cpu()))
    trainer.fit()
    return trainer, targets, run_dir


@pytest.mark.slow
def test_no_unseen_positive_reaches_the_loss(zero_shot_run) -> None:
    trainer, targets, _ = zero_shot_run
    full = SyntheticMultiLabel(split="train", train_size=64, val_size=48)
    unseen_columns = [full.classes.index(name) for name in UNSEEN]
    assert full.labels[:, unseen_columns].sum() > 0  # the training images do show unseen classes
    seen = torch.cat(targets)
    assert seen.shape == (64, 9) and len(targets) == 2  # every training sample once, 9 columns
    names = trainer.classes
    unseen_positives = sum(int((seen[:, c] == 1).sum()) for c, name in enumerate(names) if name in UNSEEN)
    assert unseen_positives == 0
    # the targets are the seen columns of the full labels: as many positives, class by class
    seen_columns = [full.classes.index(name) for name in names]
    assert torch.equal((seen == 1).sum(0), (full.labels[:, seen_columns] == 1).sum(0))


@pytest.mark.slow
def test_evaluation_scores_every_class_and_results_hold_zsl_and_gzsl(zero_shot_run, capsys) -> None:
    trainer, _, run_dir = zero_shot_run
    results = json.loads((run_dir / "results.json").read_text())
    metrics = results["metrics"]
    assert metrics["zsl"]["classes"] == 3 and metrics["gzsl"]["classes"] == 12
    assert {"mAP_class", "mAP_sample", "F1_top3", "F1_top5", "P_top3", "R_top5"} <= set(metrics["zsl"])
    assert metrics["gzsl"]["mAP_class"] == pytest.approx(metrics["mAP_class"])
    assert len(results["per_class_ap"]) == 12 and results["dataset"]["unseen_classes"] == [
        name for name in SyntheticMultiLabel(split="val", val_size=1).classes if name in UNSEEN
    ]
    # the head is back on the seen classes after evaluating: what the checkpoint holds
    assert text_query_head(trainer.model).num_classes == 9 and len(trainer.state.thresholds) == 9
    assert tables_cli.main(["--runs", str(run_dir), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["zsl.mAP_class"] == pytest.approx(metrics["zsl"]["mAP_class"])


@pytest.mark.slow
def test_mlcls_eval_scores_the_unseen_classes_of_the_checkpoint(zero_shot_run, monkeypatch, capsys) -> None:
    """The run's last.pt stores dataset.unseen_classes: mlcls-eval reports the trainer's ZSL / GZSL."""
    _, _, run_dir = zero_shot_run
    metrics = json.loads((run_dir / "results.json").read_text())["metrics"]
    argv = ["mlcls-eval", f"checkpoint={run_dir / 'checkpoints' / 'last.pt'}", "device=cpu", "workers=0"]
    monkeypatch.setattr(sys, "argv", argv)
    eval_cli.main()
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for group in ("zsl", "gzsl"):
        for key in ("mAP_class", "mAP_sample", "F1_top3", "F1_top5"):
            assert figures[group][key] == pytest.approx(metrics[group][key], abs=1e-6)
    # metrics.zsl_images=unseen_positive: the ZSL figures of the validation images with an unseen positive
    # (ML-Decoder's get_relevant_samples), GZSL unchanged; a value of neither kind is one line
    val = SyntheticMultiLabel(split="val", train_size=64, val_size=48)
    unseen_columns = [val.classes.index(name) for name in UNSEEN]
    relevant = int((torch.as_tensor(val.labels)[:, unseen_columns] == 1).any(1).sum())
    assert 0 < relevant < 48 and figures["zsl"]["images"] == 48
    monkeypatch.setattr(sys, "argv", [*argv, "metrics.zsl_images=unseen_positive"])
    eval_cli.main()
    chosen = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert chosen["zsl"]["images"] == relevant and chosen["gzsl"] == figures["gzsl"]
    monkeypatch.setattr(sys, "argv", [*argv, "metrics.zsl_images=seen"])
    with pytest.raises(SystemExit):
        eval_cli.main()
    assert "metrics.zsl_images='seen'; expected one of all, unseen_positive" in capsys.readouterr().err
