"""Per-class threshold calibration against a brute-force scikit-learn search, and the decision rules."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score

from mlcls.errors import ConfigError
from mlcls.inference.fields import InferenceError, stored_thresholds_split
from mlcls.metrics import ap as ap_module
from mlcls.metrics.store import MemoryStore
from mlcls.metrics.thresholds import (
    NEVER_PREDICTED,
    ThresholdRule,
    calibrate_thresholds,
    describe_rule,
    held_out_f1,
    select_labels,
)


def brute_force_best_cut(scores: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Max F1 of one class over every rule ``score >= s`` (s a distinct known score, or +inf: nothing),
    and the predicted set of the highest such ``s`` reaching it; float64, scikit-learn's f1_score."""
    known = labels >= 0
    s, y = scores[known].astype(np.float64), labels[known] == 1
    best_f1, best_set = -1.0, None
    for cut in [np.inf, *sorted(set(s.tolist()), reverse=True)]:
        predicted = s >= cut
        f1 = f1_score(y, predicted, zero_division=0.0)
        if f1 > best_f1 + 1e-12:
            best_f1, best_set = f1, predicted
    return best_f1, best_set


def random_problem(seed: int, n: int = 60, c: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits rounded to 0.25 (many ties), labels with positives, negatives and about 15% of -1."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, c, generator=g) < torch.linspace(0.05, 0.6, c)).float()
    scores = torch.randn(n, c, generator=g) + 1.2 * labels
    scores = (scores * 4).round() / 4
    labels[torch.rand(n, c, generator=g) < 0.15] = -1
    labels[0, :] = 1  # every class has a positive
    return scores, labels


@pytest.mark.parametrize("seed", range(4))
def test_thresholds_reach_the_brute_force_maximum_f1(seed):
    scores, labels = random_problem(seed)
    thresholds = calibrate_thresholds(scores, labels)
    assert thresholds.dtype == torch.float64 and thresholds.shape == (scores.shape[1],)
    for c in range(scores.shape[1]):
        known = labels[:, c] >= 0
        s, y = scores[known, c].double().numpy(), labels[known, c].numpy()
        best_f1, best_set = brute_force_best_cut(scores[:, c].numpy(), labels[:, c].numpy())
        predicted = s >= thresholds[c].item()
        assert f1_score(y == 1, predicted) == pytest.approx(best_f1, abs=1e-12), c
        np.testing.assert_array_equal(predicted, best_set, err_msg=f"class {c}: not the highest best cut")
        # halfway between the lowest kept score and the highest dropped one
        kept, dropped = s[predicted], s[~predicted]
        if len(dropped):
            assert thresholds[c].item() == pytest.approx((kept.min() + dropped.max()) / 2)
        else:
            assert thresholds[c].item() == -math.inf


@pytest.mark.parametrize("block_elements", [1, 130])
def test_thresholds_in_blocks_of_columns_equal_the_whole_set_at_once(block_elements, monkeypatch):
    """One column per block, and a few columns per block, with int8 labels: the thresholds of one block."""
    scores, labels = random_problem(5)
    labels[:, 2] = labels[:, 2].clamp_max(0)  # a class without positive
    whole = calibrate_thresholds(scores, labels, no_positive=NEVER_PREDICTED)
    assert whole[2].item() == NEVER_PREDICTED and torch.isfinite(whole[3:]).all()
    monkeypatch.setattr(ap_module, "BLOCK_ELEMENTS", block_elements)
    blocked = calibrate_thresholds(scores, labels.to(torch.int8), no_positive=NEVER_PREDICTED)
    assert torch.equal(blocked, whole)


def test_ignored_labels_do_not_move_thresholds():
    scores, labels = random_problem(7)
    moved = scores.clone()
    moved[labels == -1] = torch.randn(int((labels == -1).sum())) * 10
    torch.testing.assert_close(calibrate_thresholds(moved, labels), calibrate_thresholds(scores, labels))


def test_edge_cases_ties_no_positive_and_always_predicted():
    scores = torch.tensor(
        [
            [2.0, 1.0, 0.3, 5.0],
            [1.0, 1.0, 0.2, 4.0],
            [1.0, 0.5, -0.1, 3.0],
            [0.0, -1.0, 0.0, 2.0],
        ]
    )
    labels = torch.tensor(
        [
            [1.0, 0.0, 1.0, -1.0],
            [1.0, 1.0, 1.0, -1.0],
            [0.0, 0.0, 1.0, 0.0],
            [0.0, 0.0, -1.0, 0.0],
        ]
    )
    thresholds = calibrate_thresholds(scores, labels)
    # column 0: the tie at 1.0 holds a positive and a negative; keeping it gives F1 0.8, dropping it 2/3
    assert thresholds[0].item() == 0.5
    # column 1: the only positive is tied with a negative at 1.0: F1 = 2/3 at the cut 0.75
    assert thresholds[1].item() == 0.75
    # column 2: every known sample is positive: the class is always predicted
    assert thresholds[2].item() == -math.inf
    # column 3: no positive: the uncalibrated default (logit 0), or the one asked for
    assert thresholds[3].item() == 0.0
    assert calibrate_thresholds(scores, labels, no_positive=math.inf)[3].item() == math.inf


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="shape"):
        calibrate_thresholds(torch.zeros(3, 2), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="1, 0 or -1"):
        calibrate_thresholds(torch.zeros(2, 2), torch.full((2, 2), 2.0))
    with pytest.raises(ValueError, match="zero samples"):
        calibrate_thresholds(torch.zeros(0, 2), torch.zeros(0, 2))


def test_select_labels_precedence_matches_a_hand_computed_reference():
    logits = torch.tensor([[2.0, -0.5, 0.3, -3.0], [-1.0, 0.8, 0.8, 1.5]])
    probabilities = 1 / (1 + np.exp(-logits.double().numpy()))
    per_class = torch.tensor([1.0, -1.0, 0.5, 1.5], dtype=torch.float64)

    default = select_labels(logits)
    np.testing.assert_array_equal(default.numpy(), probabilities >= 0.5)
    calibrated = select_labels(logits, per_class)
    np.testing.assert_array_equal(calibrated.numpy(), [[True, True, False, False], [False, True, True, True]])
    # a global threshold and top_k override the per-class thresholds
    globally = select_labels(logits, per_class, threshold=0.7).numpy()
    np.testing.assert_array_equal(globally, probabilities >= 0.7)
    # row 2 ties at the second place (0.8, 0.8): the lower class index is taken
    top2 = select_labels(logits, per_class, top_k=2).numpy()
    np.testing.assert_array_equal(top2, [[True, False, True, False], [False, True, False, True]])
    both = select_labels(logits, per_class, threshold=0.6, top_k=2).numpy()
    np.testing.assert_array_equal(both, [[True, False, False, False], [False, True, False, True]])
    with pytest.raises(ValueError, match="thresholds"):
        select_labels(logits, per_class[:3])


def test_class_without_a_validation_positive_is_never_predicted_and_named_once(caplog):
    scores = torch.tensor([[3.0, 9.0, 0.5], [-1.0, 8.0, 0.1], [2.0, 7.0, -0.3]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, -1.0, 0.0]])
    classes = ["tabby", "only_negatives", "also_negatives"]
    with caplog.at_level(logging.INFO, logger="mlcls"):
        for _ in range(3):  # one call per epoch
            thresholds = calibrate_thresholds(scores, labels, no_positive=NEVER_PREDICTED, classes=classes)
    assert thresholds.tolist() == [0.5, math.inf, math.inf]
    # however high its logit, such a class is not predicted by the calibrated thresholds
    assert select_labels(torch.tensor([[3.0, 1e30, 50.0]]), thresholds).tolist() == [[True, False, False]]
    named = [r.getMessage() for r in caplog.records if "no positive validation label" in r.getMessage()]
    assert named == [
        "thresholds: no positive validation label, never predicted: only_negatives, also_negatives"
    ]


def test_describe_rule_names_the_classes_without_a_calibrated_threshold():
    thresholds = torch.tensor([0.5, math.inf, -1.0], dtype=torch.float64)
    rule = describe_rule(thresholds, None, None, ["cat", "dog", "bird"])
    assert rule == (
        "per-class thresholds calibrated on the validation set (max F1); not calibrated, no positive "
        "validation label, never predicted: dog (threshold= or top_k= score them)"
    )
    assert describe_rule(thresholds[[0, 2]], None, None, ["cat", "bird"]).endswith("(max F1)")
    assert describe_rule(thresholds, None, 2, ["cat", "dog", "bird"]) == "top 2"


def test_describe_rule_names_the_held_out_split():
    thresholds = torch.tensor([0.5, math.inf], dtype=torch.float64)
    assert describe_rule(thresholds, None, None, ["cat", "dog"], "holdout") == (
        "per-class thresholds calibrated on the held-out share of the training set (max F1); not calibrated, "
        "no positive held-out label, never predicted: dog (threshold= or top_k= score them)"
    )


@pytest.mark.parametrize("value", ["test", 1, None, ["holdout"]])
def test_a_bad_thresholds_split_in_a_checkpoint_is_one_line(value):
    with pytest.raises(InferenceError) as caught:
        stored_thresholds_split({"thresholds_split": value}, "x.pt")
    assert str(caught.value) == (
        f"x.pt: 'thresholds_split' is {value!r}; expected one of validation, holdout "
        "(the split the stored thresholds were calibrated on)"
    )


def test_thresholds_stored_without_their_split_are_one_line():
    # before: a checkpoint lacking the key was read as calibrated on the validation set
    with pytest.raises(InferenceError) as caught:
        stored_thresholds_split({"thresholds": [0.0, 1.0]}, "x.pt")
    assert str(caught.value) == (
        "x.pt: 'thresholds_split' is None; expected one of validation, holdout "
        "(the split the stored thresholds were calibrated on)"
    )
    assert stored_thresholds_split({}, "x.pt") == "validation"  # no thresholds: the split names nothing


def test_a_best_cut_keeping_every_sample_is_minus_inf_even_above_infinite_scores():
    """A column whose only known sample is a positive scoring +inf: every sample kept, -inf (not NaN)."""
    scores = torch.tensor([[math.inf, 1.0], [0.5, -2.0]], dtype=torch.float64)
    labels = torch.tensor([[1, 1], [-1, 0]], dtype=torch.int8)
    thresholds = calibrate_thresholds(scores, labels, no_positive=NEVER_PREDICTED)
    assert thresholds.tolist() == [-math.inf, -0.5]


# --- rules, pooled thresholds of rare classes, held-out F1 ------------------------------------------------


def cut_counts(scores: np.ndarray, labels: np.ndarray, cut: float) -> tuple[int, int, int]:
    """TP, known items kept (TP + FP) and positives of the rule ``score >= cut``, -1 labels left out."""
    known = labels >= 0
    s, positive = scores[known].astype(np.float64), labels[known] == 1
    return int((positive & (s >= cut)).sum()), int((s >= cut).sum()), int(positive.sum())


def brute_force_rule(
    columns: list[tuple[np.ndarray, np.ndarray]], rule: str, precision: float = 0.9
) -> float:
    """The cut ``v`` (a distinct known score of the columns; ``score >= v`` kept in all of them) of ``rule``
    on the counts summed over the columns, in float64: ``f1`` -- the highest v of maximal
    ``2 TP / (K + P)``; ``precision`` -- among the v with ``TP >= precision K`` the one of most TP, the
    highest of those; none reaching it: the ``f1`` cut."""
    values = sorted({x for s, y in columns for x in s[y >= 0].astype(np.float64).tolist()}, reverse=True)
    counts = [np.sum([cut_counts(s, y, v) for s, y in columns], axis=0) for v in values]
    f1 = [2 * tp / (k + p) for tp, k, p in counts]
    best_f1 = values[int(np.argmax(f1))]
    if rule == "f1":
        return best_f1
    reaching = [(tp, -i) for i, (tp, k, _) in enumerate(counts) if k and tp >= precision * k]
    return values[-max(reaching)[1]] if reaching else best_f1


def same_decisions(scores: np.ndarray, labels: np.ndarray, threshold: float, cut: float) -> bool:
    known = labels >= 0
    s = scores[known].astype(np.float64)
    return bool(np.array_equal(s >= threshold, s >= cut))


def tail_problem(seed: int, n: int = 80, c: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Long-tailed positives (1 to ~30 per class), scores with ties, about 10% of labels -1."""
    g = torch.Generator().manual_seed(seed)
    rate = 0.45 / torch.arange(1, c + 1, dtype=torch.float64) ** 1.1
    labels = (torch.rand(n, c, generator=g, dtype=torch.float64) < rate).to(torch.int8)
    labels[torch.randint(n, (c,), generator=g), torch.arange(c)] = 1  # a positive at least
    scores = ((torch.randn(n, c, generator=g) + 1.3 * labels) * 4).round() / 4
    labels[torch.rand(n, c, generator=g) < 0.1] = -1
    return scores, labels


@pytest.mark.parametrize("precision", [0.6, 0.9, 1.0])
def test_precision_rule_keeps_most_positives_at_that_precision_else_best_f1(precision):
    scores, labels = tail_problem(1)
    rule = ThresholdRule(rule="precision", precision=precision)
    thresholds = calibrate_thresholds(scores, labels, rule=rule)
    fallbacks = 0
    for c in range(scores.shape[1]):
        s, y = scores[:, c].numpy(), labels[:, c].numpy()
        cut = brute_force_rule([(s, y)], "precision", precision)
        assert same_decisions(s, y, thresholds[c].item(), cut), c
        tp, kept, _ = cut_counts(s, y, cut)
        fallbacks += tp < precision * kept
    if precision == 1.0:  # some classes reach it, others fall back on their best F1
        assert 0 < fallbacks < scores.shape[1]


@pytest.mark.parametrize(("pool", "rule"), [("bins", "f1"), ("global", "f1"), ("bins", "precision")])
def test_rare_classes_take_the_threshold_pooled_over_their_frequency_bin_or_every_class(pool, rule):
    scores, labels = tail_problem(2)
    s, y = scores.numpy(), labels.numpy()
    own = calibrate_thresholds(scores, labels, rule=ThresholdRule(rule=rule))
    thresholds = calibrate_thresholds(
        scores, labels, rule=ThresholdRule(rule=rule, min_positives=6, pool=pool)
    )
    positives = (y == 1).sum(0)
    bins = np.floor(np.log2(np.maximum(positives, 1)))  # 1 | 2-3 | 4-7 | ...
    rare = (positives > 0) & (positives < 6)
    assert 0 < rare.sum() < len(rare) and (positives == 0).any()
    for c in range(scores.shape[1]):
        if not rare[c]:  # calibrated alone, or without a positive
            assert thresholds[c] == own[c]
            continue
        members = [j for j in range(len(rare)) if positives[j] and (pool == "global" or bins[j] == bins[c])]
        cut = brute_force_rule([(s[:, j], y[:, j]) for j in members], rule)
        for j in members:  # one threshold deciding every member's scores as the pooled cut does
            assert same_decisions(s[:, j], y[:, j], thresholds[c].item(), cut), (c, j)


def test_held_out_f1_calibrates_on_one_seeded_half_and_measures_on_the_other():
    scores, labels = tail_problem(3, n=120)
    rule = ThresholdRule(min_positives=3, seed=7)
    result = held_out_f1(MemoryStore.of(scores, labels), rule)
    order = torch.randperm(120, generator=torch.Generator().manual_seed(7))
    half, other = order[:60].numpy(), order[60:].numpy()
    s, y = scores.numpy(), labels.numpy()
    per_class = calibrate_thresholds(scores[half], labels[half], NEVER_PREDICTED, rule=rule).numpy()
    columns = [(s[half, j], y[half, j]) for j in range(s.shape[1]) if (y[half, j] == 1).any()]
    one_cut = brute_force_rule(columns, "f1")
    f1 = {"per_class": [], "global": []}
    for c in range(s.shape[1]):
        known = y[other, c] >= 0
        truth, values = y[other, c][known] == 1, s[other, c][known].astype(np.float64)
        if truth.any():
            f1["per_class"].append(f1_score(truth, values >= per_class[c], zero_division=0.0))
            f1["global"].append(f1_score(truth, values >= one_cut, zero_division=0.0))
    assert (result["calibrated_rows"], result["measured_rows"], result["seed"]) == (60, 60, 7)
    assert result["per_class"]["F1_mean"] == pytest.approx(100 * np.mean(f1["per_class"]), abs=1e-10)
    assert result["global"]["F1_mean"] == pytest.approx(100 * np.mean(f1["global"]), abs=1e-10)
    assert result["global"]["F1_mean"] != result["per_class"]["F1_mean"]


def test_a_calibration_half_without_a_positive_predicts_nothing_on_either_rule():
    """Every positive in the measured half (a tiny validation split): no threshold can be placed, every
    class is never predicted by either rule, and the measured F1 is 0 for both."""
    labels = torch.zeros(4, 3, dtype=torch.int8)
    rule = ThresholdRule(seed=0)
    measured = torch.randperm(4, generator=torch.Generator().manual_seed(0))[2:]
    labels[measured, 1] = 1
    result = held_out_f1(MemoryStore.of(torch.randn(4, 3), labels), rule)
    assert math.isnan(result["global"]["threshold"])
    assert result["per_class"]["OF1"] == result["global"]["OF1"] == 0.0


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"rule": "recall"}, "thresholds: rule='recall'; expected one of f1, precision"),
        ({"precision": 1.5}, "thresholds: precision=1.5; expected a number in (0, 1]"),
        ({"min_positives": -1}, "thresholds: min_positives=-1; expected an integer >= 0"),
        ({"pool": "tags"}, "thresholds: pool='tags'; expected one of bins, global"),
        (
            {"minimum": 3},
            "thresholds: unknown key(s) minimum; expected rule, precision, min_positives",
        ),
    ],
)
def test_a_bad_threshold_rule_is_one_line(keys, message):
    with pytest.raises(ConfigError) as raised:
        ThresholdRule.of(keys)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
