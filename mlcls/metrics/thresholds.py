"""Decision rules that turn logits into labels: per-class calibrated thresholds, a global threshold, top-k.

Per-class thresholds are *logit* thresholds ``t_c``: class ``c`` is predicted for a sample when
``logit_c >= t_c`` (compared in float64). :func:`calibrate_thresholds` chooses each ``t_c`` to maximise the
class's F1 on validation scores::

    F1_c(t) = 2 TP_c(t) / (2 TP_c(t) + FP_c(t) + FN_c(t)) = 2 TP_c(t) / (TP_c(t) + FP_c(t) + P_c)

where ``P_c`` is the number of positives of class ``c`` and samples labelled -1 are ignored (neither
positives nor negatives). The maximisation is exact over every *cut point* -- between two consecutive
distinct scores of the sorted column, or after the lowest one (F1 rises only where a positive is added,
so only the cuts ending a positive's tie group are evaluated). Rules:

* ties -- samples with equal scores are always on the same side of a threshold (a cut never splits them);
* several cut points reaching the maximal F1 -- the *highest* threshold is taken (fewest predictions);
* the returned threshold lies halfway between the scores either side of the chosen cut, so a score near
  the boundary on new data is decided by the nearer validation score; if the best cut keeps every sample
  of the column, the threshold is ``-inf`` (the class is always predicted);
* a class without any positive (F1 undefined) gets ``no_positive``: the trainer passes
  :data:`NEVER_PREDICTED` (``+inf``: with no positive to calibrate on, the class is not predicted by the
  calibrated rule; ``threshold=`` or ``top_k=`` still score it); the default 0.0 is the uncalibrated
  sigmoid-probability 0.5 rule. A log line names such classes, once per process for the same classes.

:func:`select_labels` applies ``mlcls-predict``'s precedence of these rules.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from mlcls.errors import InferenceError, plural
from mlcls.metrics import threshold_predictions, top_k_predictions
from mlcls.metrics.ap import per_list_in_blocks, ranked_positives
from mlcls.metrics.checks import check_scores_labels

log = logging.getLogger("mlcls")

# The threshold of a class without a positive validation label: never reached, the class is not predicted.
NEVER_PREDICTED = math.inf
# The classes already named by the "without a positive validation label" log line of this process.
_reported_without_positive: set[tuple[str, ...]] = set()


# How calibrate_thresholds and describe_rule name the split calibrated thresholds come from, and its labels.
SPLIT_NAMES = {
    "validation": ("validation set", "validation"),
    "holdout": ("held-out share of the training set", "held-out"),
}


def calibrate_thresholds(
    scores: torch.Tensor,
    labels: torch.Tensor,
    no_positive: float = 0.0,
    classes: Sequence[str] | None = None,
    split: str = "validation",
) -> torch.Tensor:
    """Per-class logit thresholds maximising each class's F1 on validation logits ``scores`` (N, C) with
    ``labels`` (N, C) in {1, 0, -1} (see the module docstring): float64 (C,) on ``scores.device``, ``-inf``
    for a class always predicted. ``classes`` and ``split`` name the classes without a positive in the log.
    """
    labels = check_scores_labels(scores, labels)
    if scores.shape[0] == 0:
        raise ValueError("cannot calibrate thresholds on zero samples")
    # columns in blocks (each class is calibrated alone): no whole-size sorted copy
    threshold = per_list_in_blocks(_best_f1_thresholds, scores, labels, dim=0)
    has_positive = ~threshold.isnan()
    if not has_positive.all():
        missing = torch.nonzero(~has_positive).flatten().tolist()
        names = tuple(str(classes[c]) if classes is not None else str(c) for c in missing)
        if names not in _reported_without_positive:
            _reported_without_positive.add(names)
            shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            if no_positive == NEVER_PREDICTED:
                rule = "never predicted"
            else:
                probability = torch.sigmoid(torch.tensor(float(no_positive), dtype=torch.float64)).item()
                rule = f"threshold {no_positive} (probability {probability:.3g})"
            log.info("thresholds: no positive %s label, %s: %s", SPLIT_NAMES[split][1], rule, shown)
    return torch.where(has_positive, threshold, float(no_positive))


def _best_f1_thresholds(scores: torch.Tensor, labels: torch.Tensor, dim: int) -> torch.Tensor:
    """The best-F1 logit threshold (float64, NaN without a positive) of every ranked list of ``scores``:
    ``F1 = 2 TP / (K + P)`` at every positive, ``K = TP + FP`` (:func:`ranked_positives`)."""
    ranked = ranked_positives(scores, labels, dim)
    n_lists, length = ranked.known_sorted.shape
    minus_inf = torch.tensor(-torch.inf, dtype=torch.float64, device=ranked.score.device)
    threshold = torch.full((n_lists,), torch.nan, dtype=torch.float64, device=ranked.score.device)
    if len(ranked.list_of) == 0:
        return threshold
    list_of = ranked.list_of
    f1 = 2 * ranked.tp.double() / (ranked.known_ge + ranked.n_positive[list_of]).double()
    best_f1 = torch.full_like(threshold, -1.0).scatter_reduce_(0, list_of, f1, "amax")
    # the positives of a list come in increasing score order: the last best one is the highest cut
    index = torch.arange(len(f1), device=f1.device)
    best = torch.full_like(ranked.n_positive, -1)
    best.scatter_reduce_(0, list_of, torch.where(f1 == best_f1[list_of], index, -1), "amax")
    has_positive = best >= 0
    best, lists = best[has_positive], has_positive.nonzero().squeeze(1)
    above = ranked.score[best].double()
    below_index = length - ranked.known_ge[best] - 1  # the highest known score under ``above``
    below = ranked.known_sorted[lists, below_index.clamp_min(0)].double()
    below = torch.where((below_index >= 0) & (above > -torch.inf), below, minus_inf)
    middle = torch.where(below > -torch.inf, above / 2 + below / 2, minus_inf)  # -inf: every sample kept
    # float64 rounding of the midpoint of two adjacent float64 scores: keep the cut on the right side
    threshold[lists] = torch.where((middle <= below) & (below > -torch.inf), above, middle)
    return threshold


def select_labels(
    scores: torch.Tensor,
    thresholds: torch.Tensor | None = None,
    threshold: float | None = None,
    top_k: int | None = None,
) -> torch.Tensor:
    """The predicted labels (bool (N, C)) of logits ``scores`` (N, C) under the first applicable rule:

    1. ``top_k`` given: the ``top_k`` highest-scoring classes of each sample (ties: lower class index
       first), restricted to those with ``sigmoid(score) >= threshold`` when ``threshold`` is also given;
    2. ``threshold`` given: ``sigmoid(score) >= threshold``, one probability for every class;
    3. ``thresholds`` (C,) given: ``score >= thresholds[c]``, the per-class logit thresholds of
       :func:`calibrate_thresholds`;
    4. otherwise ``sigmoid(score) >= 0.5``.

    NaN scores are refused by :func:`check_model_scores` under every rule.
    """
    check_model_scores(scores)
    if top_k is not None:
        chosen = top_k_predictions(scores, top_k)
        return chosen & threshold_predictions(scores, threshold) if threshold is not None else chosen
    if threshold is not None:
        return threshold_predictions(scores, threshold)
    if thresholds is not None:
        if thresholds.shape != scores.shape[1:]:
            raise ValueError(f"{tuple(thresholds.shape)} thresholds for {scores.shape[1]} score columns")
        return scores.detach().to(torch.float64) >= thresholds.to(scores.device, torch.float64)
    return threshold_predictions(scores, 0.5)


def check_model_scores(scores: torch.Tensor) -> torch.Tensor:
    """``scores``, the (N, C) logits of a model, unchanged; :class:`InferenceError` naming how many images
    have a NaN score when any has: the model's weights hold NaN or infinite values, and no rule can label
    them (a NaN compares false with every threshold)."""
    if scores.is_floating_point() and scores.numel() and torch.aminmax(scores).min.isnan():
        rows = int(scores.isnan().any(dim=1).sum())
        raise InferenceError(
            f"the model's scores are NaN for {rows} of {plural(len(scores), 'image')}: its weights hold NaN "
            "or infinite values (a diverged run or a damaged checkpoint)"
        )
    return scores


def describe_rule(
    thresholds: torch.Tensor | None,
    threshold: float | None,
    top_k: int | None,
    classes: Sequence[str] | None = None,
    split: str = "validation",
) -> str:
    """One line naming the rule :func:`select_labels` applies for these arguments; with calibrated
    ``thresholds``, also the split they were calibrated on (a key of :data:`SPLIT_NAMES`) and the
    ``classes`` without a calibrated threshold (:data:`NEVER_PREDICTED`)."""
    if top_k is not None:
        return f"top {top_k}" + (f" with probability >= {threshold}" if threshold is not None else "")
    if threshold is not None:
        return f"probability >= {threshold} for every class"
    if thresholds is None:
        return "probability >= 0.5 (the checkpoint has no calibrated thresholds)"
    where, label = SPLIT_NAMES[split]
    rule = f"per-class thresholds calibrated on the {where} (max F1)"
    never = torch.nonzero(thresholds == NEVER_PREDICTED).flatten().tolist()
    if never:
        names = ", ".join(str(classes[c]) if classes is not None else str(c) for c in never)
        rule += (
            f"; not calibrated, no positive {label} label, never predicted: {names} "
            "(threshold= or top_k= score them)"
        )
    return rule
