"""ZSL / GZSL figures (mlcls.metrics.zero_shot) against scikit-learn and a float64 loop written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from mlcls.errors import ConfigError
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


def test_the_evaluation_adds_zsl_and_gzsl_only_for_unseen_classes() -> None:
    from mlcls.engine.evaluate import measure_rank_parts

    scores, labels = draw(50, 6, seed=3)
    names = [f"c{i}" for i in range(6)]
    assert "zsl" not in measure_rank_parts(scores, labels, 50, names).metrics
    unseen = torch.tensor([False, True, False, False, False, True])
    metrics = measure_rank_parts(scores, labels, 50, names, unseen).metrics
    assert metrics["zsl"] == zero_shot_metrics(scores, labels, unseen)["zsl"]
    assert metrics["mAP_class"] == compute_metrics(scores, labels, names)["mAP_class"]
    assert metrics["gzsl"]["mAP_class"] == pytest.approx(metrics["mAP_class"])
    with pytest.raises(ValueError, match="unseen class"):
        zero_shot_metrics(scores, labels, torch.zeros(6, dtype=torch.bool))


# ---- The sources' conventions, each against a float64 reference written here from the source's code:
# LESA (hbdat/cvpr20_LESA, core/utils.py: compute_AP, evaluate_k, compute_F1), ML-Decoder
# (Alibaba-MIIL/ML_Decoder, src_files/helper_functions/helper_functions.py: average_precision, mAP,
# DatasetFromList.get_relevant_samples). Labels there: LESA 1 / -1 / 0 (unknown), mlcls 1 / 0 / -1.


def lesa_labels(labels: np.ndarray) -> np.ndarray:
    """mlcls's labels in LESA's encoding: positive 1, negative -1, unknown 0."""
    return np.select([labels == 1, labels == 0], [1, -1], 0).astype(np.float64)


def lesa_map(scores: np.ndarray, labels: np.ndarray) -> float:
    """LESA's compute_AP then np.mean, in percent: per class, scikit-learn's AP over the known labels
    (|label| = 1); a class without a positive keeps the 0 its array started with."""
    y = lesa_labels(labels)
    ap = np.zeros(scores.shape[1])
    for c in range(scores.shape[1]):
        known = np.abs(y[:, c]) == 1
        if np.sum(y[:, c] > 0) == 0:
            continue
        ap[c] = average_precision_score(np.clip(y[known, c], 0, 1), scores[known, c].astype(np.float64))
    return 100 * float(np.mean(ap))


def lesa_top_k(scores: np.ndarray, labels: np.ndarray, k: int) -> tuple[float, float, float]:
    """LESA's evaluate_k binarisation and compute_F1 (mode overall), in percent: the last k of an ascending
    argsort of each row, the order of equal scores kept (kind="stable"), are predicted."""
    y = lesa_labels(labels)
    order = np.argsort(scores.astype(np.float64), axis=1, kind="stable")
    predicted = np.zeros(scores.shape)
    for i in range(scores.shape[0]):
        predicted[i][order[i][-k:]] = 1
        predicted[i][order[i][:-k]] = 0
    mask = predicted == 1
    true_positives = np.sum(y[mask] == 1)
    precision, recall = true_positives / np.sum(mask), true_positives / np.sum(y == 1)
    return 100 * precision, 100 * recall, 100 * 2 * precision * recall / (precision + recall)


def mldecoder_map(scores: np.ndarray, labels: np.ndarray) -> float:
    """ML-Decoder's mAP: per class, the precision at each positive of a descending sort, summed and divided
    by (positives + 1e-8) -- 0 for a class without positive -- then 100 times the mean over the classes."""
    ap = np.zeros(scores.shape[1])
    for c in range(scores.shape[1]):
        target = labels[np.argsort(scores[:, c].astype(np.float64))[::-1], c]
        hits = target == 1
        positives_so_far = np.cumsum(hits)
        precision_at_hits = np.where(hits, positives_so_far / np.arange(1, len(target) + 1), 0.0)
        ap[c] = precision_at_hits.sum() / (positives_so_far[-1] + 1e-8)
    return 100 * float(ap.mean())


def relevant_rows(labels: np.ndarray, class_ids: list[int]) -> np.ndarray:
    """ML-Decoder's get_relevant_samples: an image is kept when any of its label indices is in class_ids."""
    indices = [np.flatnonzero(row == 1).tolist() for row in labels]
    return np.array([any(x in class_ids for x in row) for row in indices], dtype=bool)


UNSEEN = [1, 4, 6, 7]


def sparse_draw(rows: int, columns: int, seed: int, decimals: int | None = None):
    """Labels with rare unseen positives (many images and one class without any), untied or rounded scores."""
    rng = np.random.default_rng(seed)
    labels = (rng.random((rows, columns)) < 0.25).astype(np.int8)
    labels[:, UNSEEN] = rng.random((rows, len(UNSEEN))) < 0.06
    labels[:, UNSEEN[-1]] = 0  # an unseen class without a positive
    scores = rng.normal(size=(rows, columns)) + 1.0 * (labels == 1)
    if decimals is not None:
        scores = np.round(scores, decimals)
    return torch.from_numpy(scores.astype(np.float32)), torch.from_numpy(labels)


def unseen_mask(columns: int) -> torch.Tensor:
    mask = torch.zeros(columns, dtype=torch.bool)
    mask[UNSEEN] = True
    return mask


def test_zsl_images_unseen_positive_is_ml_decoders_relevant_samples_and_all_is_lesas() -> None:
    """Item 19: unseen_positive scores the rows get_relevant_samples keeps with the unseen class_ids, all
    every row; mAP then equals ML-Decoder's and LESA's own on those rows; GZSL scores every row in both."""
    scores, labels = sparse_draw(400, 10, seed=11)
    s, y = scores.numpy(), labels.numpy()
    kept = relevant_rows(y, UNSEEN)
    assert 0 < kept.sum() < len(y) - 100  # the choice matters on this draw
    chosen = zero_shot_metrics(scores, labels, unseen_mask(10), zsl_images="unseen_positive")
    every = zero_shot_metrics(scores, labels, unseen_mask(10), zsl_images="all")
    assert chosen["zsl"]["images"] == int(kept.sum()) and every["zsl"]["images"] == 400
    assert chosen["zsl"]["mAP_class"] == pytest.approx(
        mldecoder_map(s[kept][:, UNSEEN], y[kept][:, UNSEEN]), abs=1e-5
    )
    assert every["zsl"]["mAP_class"] == pytest.approx(lesa_map(s[:, UNSEEN], y[:, UNSEEN]), abs=1e-9)
    assert abs(chosen["zsl"]["mAP_class"] - every["zsl"]["mAP_class"]) > 1.0
    for k in (3, 5):
        precision, recall, f1 = lesa_top_k(s[kept][:, UNSEEN], y[kept][:, UNSEEN], k)
        assert chosen["zsl"][f"P_top{k}"] == pytest.approx(precision, abs=1e-9)
        assert chosen["zsl"][f"R_top{k}"] == pytest.approx(recall, abs=1e-9)
        assert chosen["zsl"][f"F1_top{k}"] == pytest.approx(f1, abs=1e-9)
    assert chosen["gzsl"] == every["gzsl"] and every["gzsl"]["images"] == 400


def test_a_class_without_positive_counts_ap_zero_as_lesa_and_ml_decoder() -> None:
    """Item 20: the unseen class without positive counts AP = 0 in the ZSL and GZSL mAP (old: left out,
    the mean of the other three), against LESA's compute_AP and ML-Decoder's mAP; unknown labels (-1) are
    left out of a class's ranked list as LESA's |label| = 1 mask does."""
    scores, labels = sparse_draw(300, 10, seed=5)
    labels[torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) < 0.05] = -1
    s, y = scores.numpy(), labels.numpy()
    figures = zero_shot_metrics(scores, labels, unseen_mask(10))
    assert figures["zsl"]["classes_without_positive"] == 1 and figures["zsl"]["classes"] == 4
    assert figures["zsl"]["mAP_class"] == pytest.approx(lesa_map(s[:, UNSEEN], y[:, UNSEEN]), abs=1e-9)
    assert figures["gzsl"]["mAP_class"] == pytest.approx(lesa_map(s, y), abs=1e-9)
    without_unknown = labels.clone()
    without_unknown[without_unknown == -1] = 0
    plain = zero_shot_metrics(scores, without_unknown, unseen_mask(10))["zsl"]["mAP_class"]
    assert plain == pytest.approx(mldecoder_map(s[:, UNSEEN], without_unknown.numpy()[:, UNSEEN]), abs=1e-5)
    counted = compute_metrics(scores, labels, [f"c{i}" for i in range(10)])  # the paper's mAP: left out
    assert counted["classes_counted"] == 9 and counted["mAP_class"] > figures["gzsl"]["mAP_class"]


@pytest.mark.parametrize("columns", [9, 81])
def test_ties_in_the_top_k_go_to_the_higher_index_as_lesas_argsort(columns: int) -> None:
    """Item 21: scores rounded to one decimal tie often at the k-th place; P, R and F1 at 3 and 5 equal
    LESA's binarisation (the last k of a stable ascending argsort: the higher index among ties). The old
    rule (the lower index) gives other figures on the same scores."""
    rng = np.random.default_rng(columns)
    labels = (rng.random((500, columns)) < 0.1).astype(np.int8)
    scores = np.round(rng.random((500, columns)) + 0.3 * labels, 1)
    unseen = torch.ones(columns, dtype=torch.bool)
    figures = zero_shot_metrics(torch.from_numpy(scores), torch.from_numpy(labels), unseen)["zsl"]
    for k in (3, 5):
        precision, recall, f1 = lesa_top_k(scores, labels, k)
        assert figures[f"P_top{k}"] == pytest.approx(precision, abs=1e-9)
        assert figures[f"R_top{k}"] == pytest.approx(recall, abs=1e-9)
        assert figures[f"F1_top{k}"] == pytest.approx(f1, abs=1e-9)
        lower_first = lesa_top_k(scores[:, ::-1], labels[:, ::-1], k)  # the lower index among ties
        assert abs(lower_first[1] - recall) > 0.1


def test_an_unknown_zsl_images_value_is_one_line() -> None:
    scores, labels = draw(20, 4, seed=2)
    with pytest.raises(
        ConfigError, match=r"^metrics.zsl_images='seen'; expected one of all, unseen_positive "
    ):
        zero_shot_metrics(scores, labels, torch.tensor([True, False, False, False]), zsl_images="seen")


def test_mlcls_train_checks_metrics_zsl_images_before_any_data_is_read() -> None:
    from conftest import compose_config

    from mlcls.engine.config_checks import check_config

    assert compose_config([]).metrics.zsl_images == "all"  # the behaviour before the option: every image
    with pytest.raises(
        ConfigError, match=r"^metrics.zsl_images='unseen'; expected one of all, unseen_positive"
    ):
        check_config(compose_config(["metrics.zsl_images=unseen"]), world_size=1)
