"""ZSL / GZSL figures (mlcls.metrics.zero_shot) against scikit-learn and a float64 loop written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from mlcls.metrics import compute_metrics, top_k_f1, zero_shot_metrics


def reference_top_k(scores: np.ndarray, labels: np.ndarray, k: int) -> tuple[float, float, float]:
    """LESA's overall P, R, F1 of the top k per image, in percent, by a plain float64 loop (no ties in the
    scores the tests draw)."""
    true_positives, predictions, positives = 0.0, 0.0, 0.0
    for row_scores, row_labels in zip(scores.astype(np.float64), labels, strict=True):
        order = sorted(range(len(row_scores)), key=lambda c: -row_scores[c])[:k]
        true_positives += sum(1.0 for c in order if row_labels[c] == 1)
        predictions += len(order)
        positives += sum(1.0 for value in row_labels if value == 1)
    precision, recall = 100 * true_positives / predictions, 100 * true_positives / positives
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def draw(rows: int, columns: int, seed: int, unknown: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    labels = (rng.random((rows, columns)) < 0.2).astype(np.int8)
    labels[rng.random((rows, columns)) < unknown] = -1
    scores = rng.normal(size=(rows, columns)) + 1.5 * (labels == 1)
    return torch.from_numpy(scores.astype(np.float32)), torch.from_numpy(labels)


@pytest.mark.parametrize("k", [1, 3, 5, 12])
@pytest.mark.parametrize("unknown", [0.0, 0.1])
def test_top_k_f1_equals_the_float64_loop(k: int, unknown: float) -> None:
    scores, labels = draw(200, 9, seed=k, unknown=unknown)
    figures = top_k_f1(scores, labels, k)
    precision, recall, f1 = reference_top_k(scores.numpy(), labels.numpy(), k)
    assert figures[f"P_top{k}"] == pytest.approx(precision, abs=1e-9)
    assert figures[f"R_top{k}"] == pytest.approx(recall, abs=1e-9)
    assert figures[f"F1_top{k}"] == pytest.approx(f1, abs=1e-9)


def test_precision_counts_images_without_a_positive() -> None:
    """An image without a positive predicts k classes all the same: P = TP / (k N), N all images."""
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    labels = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])
    figures = top_k_f1(scores, labels, 3)
    assert figures["P_top3"] == pytest.approx(100 / 6)  # 1 TP of 3 x 2 predictions
    assert figures["R_top3"] == pytest.approx(100.0)
    assert math.isnan(top_k_f1(scores, torch.zeros_like(labels), 3)["F1_top3"])


def test_zsl_and_gzsl_equal_scikit_learn_and_the_loop() -> None:
    scores, labels = draw(300, 12, seed=7)
    unseen = torch.zeros(12, dtype=torch.bool)
    unseen[[2, 5, 9]] = True
    figures = zero_shot_metrics(scores, labels, unseen)
    for name, columns in (("zsl", [2, 5, 9]), ("gzsl", list(range(12)))):
        s, y = scores[:, columns].numpy().astype(np.float64), labels[:, columns].numpy()
        assert figures[name]["mAP_class"] == pytest.approx(
            100 * average_precision_score(y, s, average="macro"), abs=1e-9
        )
        kept = y.sum(1) > 0
        assert figures[name]["mAP_sample"] == pytest.approx(
            100 * average_precision_score(y[kept], s[kept], average="samples"), abs=1e-9
        )
        assert figures[name]["samples_counted"] == int(kept.sum())
        for k in (3, 5):
            precision, recall, f1 = reference_top_k(s, y, k)
            assert figures[name][f"P_top{k}"] == pytest.approx(precision, abs=1e-9)
            assert figures[name][f"F1_top{k}"] == pytest.approx(f1, abs=1e-9)
            assert figures[name][f"R_top{k}"] == pytest.approx(recall, abs=1e-9)
    assert figures["zsl"]["classes"] == 3 and figures["gzsl"]["classes"] == 12


def test_compute_metrics_adds_zsl_and_gzsl_only_when_asked() -> None:
    scores, labels = draw(50, 6, seed=3)
    names = [f"c{i}" for i in range(6)]
    assert "zsl" not in compute_metrics(scores, labels, names)
    unseen = torch.tensor([False, True, False, False, False, True])
    metrics = compute_metrics(scores, labels, names, unseen=unseen)
    assert metrics["zsl"] == zero_shot_metrics(scores, labels, unseen)["zsl"]
    assert metrics["gzsl"]["mAP_class"] == pytest.approx(metrics["mAP_class"])
    with pytest.raises(ValueError, match="unseen class"):
        zero_shot_metrics(scores, labels, torch.zeros(6, dtype=torch.bool))
