"""The trainer's choice of weights after an evaluation: thresholds calibrated once per set of weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mlcls.engine.evaluate as evaluate_module
import mlcls.engine.trainer as trainer_module
from mlcls.engine.evaluate import Evaluation
from mlcls.engine.state import TrainState
from mlcls.engine.trainer import Trainer
from mlcls.metrics import compute_metrics
from mlcls.metrics.thresholds import NEVER_PREDICTED, ThresholdRule, calibrate_thresholds

CLASSES = ["a", "b", "c"]


def evaluation(seed: int) -> Evaluation:
    """The metrics, logits and int8 labels of 40 generated samples (one ranking per seed)."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.rand(40, 3, generator=generator) < 0.4).to(torch.int8)
    scores = torch.randn(40, 3, generator=generator) + labels
    return Evaluation(compute_metrics(scores, labels, CLASSES), scores, labels)


def fake_trainer(raw: Evaluation, ema: Evaluation | None, best: dict | None) -> SimpleNamespace:
    """What :meth:`Trainer.select_best` reads of a trainer, with evaluations given in advance."""
    state = TrainState(best=best)
    ema_weights = None if ema is None else SimpleNamespace(module="ema weights")
    return SimpleNamespace(
        measure=lambda model=None, loader=None: raw if model in (None, "raw weights") else ema,
        model="raw weights",
        data=SimpleNamespace(holdout_loader=None),
        ema=ema_weights,
        state=state,
        dist=SimpleNamespace(is_main=True),
        classes=CLASSES,
        run_log=SimpleNamespace(evaluation=lambda *args: None),
        best_thresholds=None,
        thresholds_split="validation",
        threshold_rule=ThresholdRule(),
    )


@pytest.fixture
def calibrated(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The scores of every threshold calibration, whichever module calls it."""
    calls: list[torch.Tensor] = []

    def counting(scores, labels, **kwargs):
        calls.append(scores)
        return calibrate_thresholds(scores, labels, **kwargs)

    for module in (trainer_module, evaluate_module):
        monkeypatch.setattr(module, "calibrate_thresholds", counting, raising=False)
    return calls


def best_of(evaluation: Evaluation) -> torch.Tensor:
    return calibrate_thresholds(evaluation.scores, evaluation.labels, no_positive=NEVER_PREDICTED)


@pytest.mark.parametrize("with_ema", [False, True])
def test_raw_weights_new_best_are_calibrated_once(calibrated, with_ema: bool) -> None:
    raw = evaluation(0)
    ema = None
    if with_ema:  # an EMA worse than the raw weights: nothing of it is calibrated
        ema = evaluation(1)
        ema.metrics["mAP_class"] = raw.metrics["mAP_class"] - 1
    trainer = fake_trainer(raw, ema, best=None)
    assert Trainer.select_best(trainer, 1)
    assert [scores is raw.scores for scores in calibrated] == [True]
    assert torch.equal(trainer.best_thresholds, best_of(raw))
    assert trainer.state.thresholds is trainer.best_thresholds
    assert trainer.state.best["weights"] == "raw"


def test_ema_new_best_calibrates_both_sets_of_weights(calibrated) -> None:
    raw, ema = evaluation(0), evaluation(1)
    ema.metrics["mAP_class"] = raw.metrics["mAP_class"] + 1
    trainer = fake_trainer(raw, ema, best=None)
    assert Trainer.select_best(trainer, 1)
    assert [scores is raw.scores for scores in calibrated] == [True, False]
    assert torch.equal(trainer.state.thresholds, best_of(raw))
    assert torch.equal(trainer.best_thresholds, best_of(ema))
    assert trainer.state.best["weights"] == "ema"


def test_no_new_best_calibrates_the_raw_weights_only(calibrated) -> None:
    raw = evaluation(0)
    trainer = fake_trainer(raw, None, best={"mAP_class": 101.0})
    assert not Trainer.select_best(trainer, 2)
    assert len(calibrated) == 1 and trainer.best_thresholds is None
    assert torch.equal(trainer.state.thresholds, best_of(raw))
