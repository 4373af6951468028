"""mlcls.metrics against scikit-learn and against values computed by hand."""

from __future__ import annotations

import ast
import importlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, precision_score, recall_score

from mlcls.collectives import communication_device, gather_rank_parts
from mlcls.metrics import ap as ap_module
from mlcls.metrics import (
    average_precision,
    compute_metrics,
    map_class,
    map_sample,
    precision_recall_f1,
    threshold_predictions,
    top_k_predictions,
    voc11_average_precision,
)

TOLERANCE = 1e-9
TIES = [None, "one_decimal", "bfloat16", "integer"]


def make_case(
    seed: int,
    n: int = 300,
    c: int = 12,
    ties: str | None = None,
    unknown: float = 0.0,
    empty: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random scores ranking positives somewhat higher; optional ties, -1 labels, and ``empty`` first
    classes and first samples without positive."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, c, generator=generator) < 0.25).long()
    labels[:, :empty] = 0
    labels[:empty] = 0
    scores = torch.randn(n, c, generator=generator, dtype=torch.float64) + labels
    if ties == "one_decimal":
        scores = scores.round(decimals=1)
    elif ties == "bfloat16":
        scores = scores.to(torch.bfloat16)
    elif ties == "integer":
        scores = (2 * scores).round().long()
    if unknown:
        labels[torch.rand(n, c, generator=generator) < unknown] = -1
    return scores, labels


def sklearn_ap_per_list(scores: torch.Tensor, labels: torch.Tensor, dim: int) -> np.ndarray:
    """scikit-learn's binary AP of every column (dim 0) or row (dim 1) over its entries not labelled -1."""
    s, y = scores.double().numpy(), labels.numpy()
    if dim == 1:
        s, y = s.T, y.T
    out = np.full(s.shape[1], np.nan)
    for j in range(s.shape[1]):
        known = y[:, j] >= 0
        if (y[known, j] == 1).any():
            out[j] = average_precision_score(y[known, j] == 1, s[known, j])
    return out


# --- agreement with scikit-learn ----------------------------------------------------------------------


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("shape", [(160, 12), (40, 60)])
def test_map_class_equals_sklearn_macro(ties: str | None, shape: tuple[int, int]) -> None:
    scores, labels = make_case(0, *shape, ties=ties)
    assert (labels == 1).any(0).all()  # scikit-learn's macro average would count 0 for an empty class
    expected = average_precision_score(labels.numpy(), scores.double().numpy(), average="macro")
    value, counted = map_class(scores, labels)
    assert counted == shape[1]
    assert abs(value / 100 - expected) < TOLERANCE


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("shape", [(160, 12), (40, 60)])
def test_map_sample_equals_sklearn_samples_over_rows_with_a_positive(
    ties: str | None, shape: tuple[int, int]
) -> None:
    scores, labels = make_case(1, *shape, ties=ties, empty=2)
    rows = (labels == 1).any(1)
    assert not rows[:2].any()  # rows without positive must be left out
    expected = average_precision_score(labels[rows].numpy(), scores[rows].double().numpy(), average="samples")
    value, counted = map_sample(scores, labels)
    assert counted == int(rows.sum())
    assert abs(value / 100 - expected) < TOLERANCE


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("dim", [0, 1])
def test_average_precision_with_unknown_labels_and_empty_classes(ties: str | None, dim: int) -> None:
    scores, labels = make_case(2, 100, 24, ties=ties, unknown=0.2, empty=3)
    expected = sklearn_ap_per_list(scores, labels, dim)
    ap = average_precision(scores, labels, dim=dim)
    assert ap.dtype == torch.float64
    np.testing.assert_array_equal(np.isnan(ap.numpy()), np.isnan(expected))
    np.testing.assert_allclose(ap.numpy(), expected, rtol=0, atol=TOLERANCE)
    assert np.isnan(expected[:3]).all()


@pytest.mark.parametrize("dim", [0, 1])
def test_average_precision_with_very_unequal_numbers_of_positives(dim: int) -> None:
    # class 0 is positive in 90% of the samples, the others in 3%: long and short lists of positives
    # (the binary searches then run in several blocks per long list)
    generator = torch.Generator().manual_seed(6)
    rates = torch.tensor([0.9] + [0.03] * 9)
    labels = (torch.rand(400, 10, generator=generator) < rates).long()
    scores = (torch.randn(400, 10, generator=generator, dtype=torch.float64) + labels).round(decimals=1)
    labels[torch.rand(400, 10, generator=generator) < 0.05] = -1
    expected = sklearn_ap_per_list(scores, labels, dim)
    np.testing.assert_allclose(average_precision(scores, labels, dim=dim).numpy(), expected, atol=TOLERANCE)


@pytest.mark.parametrize("ties", [None, "one_decimal"])
def test_map_means_skip_lists_without_positive(ties: str | None) -> None:
    scores, labels = make_case(3, 100, 16, ties=ties, unknown=0.1, empty=4)
    for fn, dim in ((map_class, 0), (map_sample, 1)):
        expected = sklearn_ap_per_list(scores, labels, dim)
        value, counted = fn(scores, labels)
        assert counted == int((~np.isnan(expected)).sum())
        assert abs(value / 100 - np.nanmean(expected)) < TOLERANCE
    # without -1 labels, mAP@class is scikit-learn's macro average over the classes with a positive
    labels = labels.clamp_min(0)
    with_positive = (labels == 1).any(0)
    expected = average_precision_score(
        labels[:, with_positive].numpy(), scores[:, with_positive].numpy(), average="macro"
    )
    assert abs(map_class(scores, labels)[0] / 100 - expected) < TOLERANCE


def test_precision_recall_f1_equals_sklearn() -> None:
    scores, labels = make_case(4, 300, 12, ties="one_decimal", empty=2)
    counted = (labels == 1).any(0)
    y = labels.numpy()
    for predicted in (threshold_predictions(scores, 0.6), top_k_predictions(scores, 3)):
        p = predicted.numpy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = {
                "CP": precision_score(y[:, counted], p[:, counted], average="macro", zero_division=0),
                "CR": recall_score(y[:, counted], p[:, counted], average="macro", zero_division=0),
                "OP": precision_score(y, p, average="micro", zero_division=0),
                "OR": recall_score(y, p, average="micro", zero_division=0),
            }
        figures = precision_recall_f1(predicted, labels)
        for name, value in expected.items():
            assert abs(figures[name] / 100 - value) < TOLERANCE, name


# --- hand-computed cases ----------------------------------------------------------------------------------


def column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)[:, None]


def test_ap_groups_tied_scores_like_sklearn() -> None:
    # groups {0.9}: 1 of 1 retrieved is positive; {0.8, 0.8}: 2 of 3 -> AP = (1 + 2/3) / 2
    ap = average_precision(column([0.9, 0.8, 0.8, 0.1]), column([1, 0, 1, 0]))
    assert ap.item() == pytest.approx(5 / 6, abs=1e-15)
    # a single group: every positive gets the precision of the whole list
    assert average_precision(column([0.3] * 4), column([1, 0, 0, 1])).item() == pytest.approx(0.5)


def test_ap_excludes_unknown_labels() -> None:
    # the -1 item on top is skipped: 1 of 2 known items retrieved with the positive
    assert average_precision(column([0.9, 0.8, 0.7]), column([-1, 0, 1])).item() == pytest.approx(0.5)
    # an unknown item tied with a positive at -inf is not counted either
    ap = average_precision(column([math.inf, -math.inf, -math.inf]), column([0, 1, -1]))
    assert ap.item() == pytest.approx(0.5)


def test_ap_is_nan_without_positive() -> None:
    ap = average_precision(torch.zeros(3, 2), torch.tensor([[0, 1], [-1, 0], [0, 0]]))
    assert math.isnan(ap[0].item()) and ap[1].item() == pytest.approx(1 / 3)  # 3 tied, 1 positive
    assert map_class(torch.zeros(2, 2), torch.zeros(2, 2)) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_map_class_and_map_sample_by_hand() -> None:
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.7], [0.2, 0.6]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # class 0: ranks 1 and 3 -> (1 + 2/3) / 2; class 1: ranks 1 and 2 -> 1
    assert map_class(scores, labels) == (pytest.approx(100 * (5 / 6 + 1) / 2), 2)
    # sample 0: 1; sample 1: positive second -> 1/2; sample 2: 1
    assert map_sample(scores, labels) == (pytest.approx(100 * 2.5 / 3), 3)


def test_voc11_by_hand() -> None:
    # points (R, P): (1/2, 1), (1, 2/3): levels 0..0.5 -> 1, 0.6..1 -> 2/3
    ap = voc11_average_precision(column([5, 4, 3, 2, 1]), column([1, 0, 1, 0, 0]))
    assert ap.item() == pytest.approx((6 + 5 * 2 / 3) / 11)
    # recall exactly 3/10 at precision 1 reaches the level 0.3 (0.1 * 3 > 0.3 in floating point)
    labels = column([1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    ap = voc11_average_precision(column(list(range(17, 0, -1))), labels)
    assert ap.item() == pytest.approx((4 + 7 * 10 / 17) / 11)
    # ties: one group of 4 with 2 positives -> precision 1/2 at every level
    assert voc11_average_precision(column([1.0] * 4), column([0, 1, 1, 0])).item() == pytest.approx(0.5)
    assert math.isnan(voc11_average_precision(column([1.0, 2.0]), column([0, -1])).item())


# 4 samples x 4 classes; class 2 has no positive and its only -1 label is predicted by both rules
LOGITS = torch.tensor(
    [[2.0, -1.0, 0.0, -1.0], [1.0, 3.0, 1.0, -2.0], [-1.0, 0.5, -3.0, -1.5], [-2.0, -0.5, -1.0, -0.5]]
)
LABELS = torch.tensor([[1, 0, 0, 1], [0, 1, -1, 0], [1, 1, 0, 0], [1, 0, 0, 1]])


def test_threshold_figures_by_hand() -> None:
    predicted = threshold_predictions(LOGITS)  # logit >= 0; the logit 0.0 is a positive prediction
    assert predicted.tolist() == [
        [True, False, True, False],
        [True, True, True, False],
        [False, True, False, False],
        [False, False, False, False],
    ]
    # per class (TP, NP, NG): c0 (1, 2, 3), c1 (2, 2, 2), c2 (0, 1, 0) not counted, c3 (0, 0, 2) -> P = 0
    figures = precision_recall_f1(predicted, LABELS)
    expected = {"CP": 1 / 2, "CR": 4 / 9, "CF1": 8 / 17, "OP": 3 / 5, "OR": 3 / 7, "OF1": 1 / 2}
    assert figures == pytest.approx({name: 100 * value for name, value in expected.items()})


def test_top_k_figures_by_hand() -> None:
    predicted = top_k_predictions(LOGITS, 3)
    # row 0: -1.0 tied for the third place between classes 1 and 3 -> class 1
    assert predicted.tolist() == [
        [True, True, True, False],
        [True, True, True, False],
        [True, True, False, True],
        [False, True, True, True],
    ]
    # per class (TP, NP, NG): c0 (2, 3, 3), c1 (2, 4, 2), c2 (0, 2, 0) not counted, c3 (1, 2, 2)
    figures = precision_recall_f1(predicted, LABELS)
    expected = {"CP": 5 / 9, "CR": 13 / 18, "CF1": 130 / 207, "OP": 5 / 11, "OR": 5 / 7, "OF1": 5 / 9}
    assert figures == pytest.approx({name: 100 * value for name, value in expected.items()})
    assert top_k_predictions(LOGITS, 10).all()


def test_figures_without_any_positive_or_prediction() -> None:
    figures = precision_recall_f1(torch.zeros(2, 3, dtype=torch.bool), torch.tensor([[0, 1, 0], [0, 0, -1]]))
    assert figures == {"CP": 0.0, "CR": 0.0, "CF1": 0.0, "OP": 0.0, "OR": 0.0, "OF1": 0.0}
    figures = precision_recall_f1(torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3))
    assert figures["OP"] == 0.0
    assert all(math.isnan(figures[name]) for name in ("CP", "CR", "CF1", "OR", "OF1"))


def test_compute_metrics_report() -> None:
    names = ["cat", "dog", "bird", "fish"]
    metrics = compute_metrics(LOGITS, LABELS.float(), names, top_k=2)
    figures = ("CP", "CR", "CF1", "OP", "OR", "OF1")
    assert set(metrics) == {
        "mAP_class", "mAP_sample", "classes_counted", "samples_counted", "per_class_ap",
        *figures, *(f"{name}_top2" for name in figures),
    }  # fmt: skip
    assert (metrics["classes_counted"], metrics["samples_counted"]) == (3, 4)
    assert metrics["OF1"] == pytest.approx(50.0)
    assert metrics["CF1"] == pytest.approx(100 * 8 / 17)
    assert list(metrics["per_class_ap"]) == names and metrics["per_class_ap"]["bird"] is None
    expected = sklearn_ap_per_list(LOGITS, LABELS, 0)
    for name, ap in zip(names, expected, strict=True):
        if not np.isnan(ap):
            assert metrics["per_class_ap"][name] == pytest.approx(100 * ap)
    assert metrics["mAP_class"] == pytest.approx(100 * np.nanmean(expected))
    assert metrics["mAP_sample"] == pytest.approx(100 * np.nanmean(sklearn_ap_per_list(LOGITS, LABELS, 1)))
    assert json.loads(json.dumps(metrics)) == metrics
    voc = compute_metrics(LOGITS, LABELS, names, voc11=True)["mAP_class_voc11"]
    assert voc == pytest.approx(100 * voc11_average_precision(LOGITS, LABELS).nanmean().item())


def test_scores_keep_their_precision_and_gradients_are_ignored() -> None:
    # 1 + 2**-40 and 1 differ only in float64: tied in float32, not in float64
    scores = column([1 + 2**-40, 1.0]).requires_grad_()
    assert average_precision(scores, column([1, 0])).item() == 1.0
    assert average_precision(scores.float(), column([1, 0])).item() == 0.5


@pytest.mark.parametrize("block_elements", [1, 7, 40])
def test_metrics_in_blocks_equal_sklearn_and_the_whole_set_at_once(block_elements, monkeypatch) -> None:
    """Blocks of 1 list (1 element: one line per block), of a few lists, and of the whole set give the
    same figures, with int8 labels used as they are."""
    scores, labels = make_case(11, n=37, c=9, ties="one_decimal", unknown=0.15, empty=2)
    names = [f"class{j}" for j in range(9)]
    whole = compute_metrics(scores, labels, names, top_k=2, voc11=True)
    monkeypatch.setattr(ap_module, "BLOCK_ELEMENTS", block_elements)
    blocked = compute_metrics(scores, labels.to(torch.int8), names, top_k=2, voc11=True)
    assert json.dumps(blocked, sort_keys=True) == json.dumps(whole, sort_keys=True)
    for dim in (0, 1):
        expected = sklearn_ap_per_list(scores, labels, dim)
        np.testing.assert_allclose(average_precision(scores, labels, dim).numpy(), expected, atol=TOLERANCE)
    assert blocked["mAP_class"] == pytest.approx(100 * np.nanmean(sklearn_ap_per_list(scores, labels, 0)))
    assert blocked["classes_counted"] == 7 and blocked["samples_counted"] < 37


# --- input validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scores", "labels", "message"),
    [
        (torch.zeros(3, 2), torch.zeros(3, 3), r"labels \(3, 3\) and scores \(3, 2\)"),
        (torch.zeros(3), torch.zeros(3), "2-D"),
        (torch.zeros(2, 2), torch.tensor([[0, 1], [2, 0]]), "labels must be 1, 0 or -1; found 2"),
        (torch.zeros(2, 2), torch.tensor([[0, 0.5], [1, 0]]), "found 0.5"),
        (torch.zeros(2, 2), torch.tensor([[0, 257], [1, 0]]), "found 257"),
        (torch.tensor([[0.0, math.nan]]), torch.zeros(1, 2), "NaN"),
    ],
)
def test_bad_input_is_refused(scores: torch.Tensor, labels: torch.Tensor, message: str) -> None:
    for fn in (average_precision, map_class, map_sample, voc11_average_precision):
        with pytest.raises(ValueError, match=message):
            fn(scores, labels)
    with pytest.raises(ValueError, match=message):
        compute_metrics(scores, labels, ["a", "b", "c"][: scores.shape[-1]])


def test_bad_arguments_are_refused() -> None:
    scores, labels = torch.zeros(2, 2), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="dim"):
        average_precision(scores, labels, dim=2)
    with pytest.raises(ValueError, match="1 class names for 2"):
        compute_metrics(scores, labels, ["a"])
    with pytest.raises(ValueError, match="distinct"):
        compute_metrics(scores, labels, ["a", "a"])
    with pytest.raises(ValueError, match="top_k"):
        top_k_predictions(scores, 0)
    with pytest.raises(ValueError, match="threshold"):
        threshold_predictions(scores, 1.5)
    with pytest.raises(ValueError, match="bool"):
        precision_recall_f1(torch.zeros(2, 2), labels)


def test_ap_and_f1_take_their_checks_from_one_module_and_not_from_each_other() -> None:
    """The evaluation walk runs one way: the package imports ap and f1, both import the shared checks."""
    imports = {}
    for name in ("ap", "f1"):
        tree = ast.parse(Path(importlib.import_module(f"mlcls.metrics.{name}").__file__).read_text())
        imports[name] = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "mlcls.metrics.checks" in imports["ap"] & imports["f1"]
    assert "mlcls.metrics.ap" not in imports["f1"] and "mlcls.metrics.f1" not in imports["ap"]


# --- collection in a single process (the 2-process case is in test_engine_evaluate_ddp.py) ------------------


def test_gather_rank_parts_single_process_converts_to_float32() -> None:
    logits = torch.randn(5, 3).to(torch.bfloat16)
    gathered = gather_rank_parts(logits, 5)
    assert gathered.dtype == torch.float32 and gathered.device.type == "cpu"
    assert torch.equal(gathered, logits.float())
    labels = torch.tensor([[1, 0, -1]] * 5)
    assert torch.equal(gather_rank_parts(labels, 5), labels)
    with pytest.raises(ValueError, match="6 rows but total=5"):
        gather_rank_parts(torch.zeros(6, 3), 5)


@pytest.mark.parametrize(
    ("backend", "device"),
    [("cpu:gloo,cuda:nccl", "cuda"), ("nccl", "cuda"), ("gloo", "cpu"), ("cpu:gloo,cuda:gloo", "cpu")],
)
def test_gather_communicates_on_cuda_where_the_group_has_nccl_for_it(backend, device, monkeypatch) -> None:
    """The trainer's CUDA group is "cpu:gloo,cuda:nccl": its scores must cross over NCCL, not gloo/TCP."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    expected = torch.device("cuda", 3) if device == "cuda" else torch.device("cpu")
    assert communication_device(backend) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_average_precision_on_cuda_equals_sklearn() -> None:
    scores, labels = make_case(5, 200, 20, ties="one_decimal", unknown=0.1, empty=2)
    for dim in (0, 1):
        ap = average_precision(scores.cuda(), labels.cuda(), dim=dim)
        assert ap.device.type == "cuda"
        expected = sklearn_ap_per_list(scores, labels, dim)
        np.testing.assert_allclose(ap.cpu().numpy(), expected, rtol=0, atol=TOLERANCE)
