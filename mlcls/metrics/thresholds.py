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

Other rules (:class:`ThresholdRule`, the config group ``thresholds``): ``rule="precision"`` takes the lowest
cut reaching a precision, and ``min_positives`` gives a class with few positives the threshold the rule takes
on the counts pooled over similar classes. Every rule reads the outputs a block of classes at a time
(:class:`~mlcls.metrics.store.OutputStore`: in memory or on disk), and a pooled threshold needs only one
more pass that counts known scores between the pool's positive scores, so it is exact at any size.
:func:`held_out_f1` measures a rule on data it was not calibrated on, beside one global threshold.

:func:`select_labels` applies ``mlcls-predict``'s precedence of these rules.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from mlcls.errors import ConfigError, InferenceError, plural, shown
from mlcls.metrics import threshold_predictions, top_k_predictions
from mlcls.metrics.ap import RankedPositives, ranked_positives
from mlcls.metrics.f1 import figures_of_counts, prediction_counts
from mlcls.metrics.store import MemoryStore, OutputStore

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


@dataclass(frozen=True)
class ThresholdRule:
    """How :func:`calibrate_thresholds` places each class's threshold (the config group ``thresholds``):

    * ``rule="f1"`` -- the class's best F1 (module docstring);
    * ``rule="precision"`` -- the lowest threshold whose precision ``TP / (TP + FP)`` reaches ``precision``,
      i.e. the highest recall at that precision (among cuts of one recall, the highest); a class that never
      reaches it takes its best-F1 threshold;
    * ``min_positives`` -- a class with fewer positives (but one at least) takes a threshold *pooled*: the
      one the same rule gives on the counts summed over a pool of classes (``TP(t) = sum_c TP_c(t)``, ...),
      a single threshold for all of them. ``pool="bins"``: the classes whose number of positives ``P`` has
      the same ``floor(log2 P)`` (1 | 2-3 | 4-7 | 8-15 ...: tags of similar frequency, rare or not);
      ``pool="global"``: every class with a positive;
    * ``seed`` -- the permutation that halves the set for :func:`held_out_f1`.
    """

    rule: str = "f1"
    precision: float = 0.9
    min_positives: int = 0
    pool: str = "bins"
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.rule not in RULES:
            problems.append(f"rule={shown(self.rule)}; expected one of {', '.join(RULES)}")
        if isinstance(self.precision, bool) or not 0 < self.precision <= 1:
            problems.append(f"precision={shown(self.precision)}; expected a number in (0, 1]")
        if isinstance(self.min_positives, bool) or not isinstance(self.min_positives, int):
            problems.append(f"min_positives={shown(self.min_positives)}; expected an integer >= 0")
        elif self.min_positives < 0:
            problems.append(f"min_positives={self.min_positives}; expected an integer >= 0")
        if self.pool not in POOLS:
            problems.append(f"pool={shown(self.pool)}; expected one of {', '.join(POOLS)}")
        if problems:
            raise ConfigError("thresholds: " + "; ".join(problems))

    @classmethod
    def of(cls, cfg: Mapping[str, Any] | None) -> ThresholdRule:
        """The rule of a ``thresholds`` config (None: the defaults); unknown keys are refused."""
        values = dict(cfg or {})
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            known = ", ".join(f.name for f in fields(cls))
            raise ConfigError(f"thresholds: unknown key(s) {', '.join(unknown)}; expected {known}")
        return cls(**values)


RULES = ("f1", "precision")
POOLS = ("bins", "global")
DEFAULT_RULE = ThresholdRule()  # each class's own best F1, the calibration before thresholds.rule


def calibrate_thresholds(
    scores: torch.Tensor,
    labels: torch.Tensor,
    no_positive: float = 0.0,
    classes: Sequence[str] | None = None,
    split: str = "validation",
    rule: ThresholdRule = DEFAULT_RULE,
) -> torch.Tensor:
    """Per-class logit thresholds placed by ``rule`` (default: each class's best F1) on validation logits
    ``scores`` (N, C) with ``labels`` (N, C) in {1, 0, -1} (see the module docstring): float64 (C,) on the
    CPU, ``-inf`` for a class always predicted. ``classes`` and ``split`` name the classes without a
    positive in the log."""
    return calibrate_store(MemoryStore.of(scores, labels), no_positive, classes, split, rule)


def calibrate_store(
    store: OutputStore,
    no_positive: float = 0.0,
    classes: Sequence[str] | None = None,
    split: str = "validation",
    rule: ThresholdRule = DEFAULT_RULE,
) -> torch.Tensor:
    """:func:`calibrate_thresholds` of the outputs of ``store``, a block of classes at a time."""
    if store.n_rows == 0:
        raise ValueError("cannot calibrate thresholds on zero samples")
    threshold, _ = _calibrate(store, None, rule, with_global=False)
    has_positive = ~threshold.isnan()
    if not has_positive.all():
        missing = torch.nonzero(~has_positive).flatten().tolist()
        names = tuple(str(classes[c]) if classes is not None else str(c) for c in missing)
        if names not in _reported_without_positive:
            _reported_without_positive.add(names)
            shown_names = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            if no_positive == NEVER_PREDICTED:
                rule_text = "never predicted"
            else:
                probability = torch.sigmoid(torch.tensor(float(no_positive), dtype=torch.float64)).item()
                rule_text = f"threshold {no_positive} (probability {probability:.3g})"
            log.info(
                "thresholds: no positive %s label, %s: %s", SPLIT_NAMES[split][1], rule_text, shown_names
            )
    return torch.where(has_positive, threshold, float(no_positive))


def _calibrate(
    store: OutputStore, rows: torch.Tensor | None, rule: ThresholdRule, with_global: bool
) -> tuple[torch.Tensor, float]:
    """The thresholds of ``rule`` on ``rows`` of ``store`` (float64 (C,), NaN without a positive) and, with
    ``with_global``, the single threshold the rule gives pooled over every class (NaN when not asked).

    Pass 1 ranks each block of classes (:func:`ranked_positives`) and keeps the positives' scores; a pooled
    threshold can only be one of them, so pass 2 only counts, per pool, the known scores between them."""
    # filled in place, block by block (see mlcls.metrics.RowFigures); the positives only for a pool
    threshold = torch.empty(store.n_classes, dtype=torch.float64)
    positives = torch.empty(store.n_classes, dtype=torch.int64)
    pooling = with_global or rule.min_positives > 1
    positive_scores, positive_class = [], []
    for classes, scores, labels in store.column_blocks(rows):
        ranked = ranked_positives(scores, labels, 0)
        threshold[classes] = _thresholds_of_ranked(ranked, rule)
        positives[classes] = ranked.n_positive.cpu()
        if pooling:
            positive_scores.append(ranked.score.double().cpu())
            positive_class.append(ranked.list_of.cpu() + classes.start)
    rare = (positives > 0) & (positives < rule.min_positives)
    bin_of = torch.where(positives > 0, torch.log2(positives.clamp_min(1).double()).floor().long(), -1)
    pools = {}  # -1: every class with a positive; b >= 0: the classes of bin b
    if with_global or (rule.pool == "global" and rare.any()):
        pools[-1] = positives > 0
    if rule.pool == "bins":
        pools.update({b: bin_of == b for b in bin_of[rare].unique().tolist()})
    pools = {p: members for p, members in pools.items() if bool(members.any())}  # no positive: no threshold
    if not pools:
        return threshold, math.nan
    pooled = _pooled_thresholds(
        store, rows, pools, torch.cat(positive_scores), torch.cat(positive_class), rule
    )
    for pool, members in pools.items():
        if (pool >= 0) == (rule.pool == "bins"):
            threshold = torch.where(members & rare, pooled[pool], threshold)
    return threshold, pooled.get(-1, math.nan)


def _pooled_thresholds(
    store: OutputStore,
    rows: torch.Tensor | None,
    pools: dict[int, torch.Tensor],
    positive_scores: torch.Tensor,
    positive_class: torch.Tensor,
    rule: ThresholdRule,
) -> dict[int, float]:
    """The threshold of ``rule`` on the counts summed over each pool's classes (bool (C,) masks), given
    the scores of every positive and its class. For a pool's distinct positive scores ``T`` (ascending)
    every known score ``x`` is counted in the bucket ``#{T <= x}``: ``K(T_j)`` is the count of the buckets
    above ``j``, and the highest known score below ``T_j`` the largest of the buckets up to ``j``."""
    if not pools:
        return {}
    candidates = {p: positive_scores[members[positive_class]].unique() for p, members in pools.items()}
    known = {p: torch.zeros(len(t) + 1, dtype=torch.int64) for p, t in candidates.items()}
    highest = {p: torch.full((len(t) + 1,), -math.inf, dtype=torch.float64) for p, t in candidates.items()}
    for classes, scores, labels in store.column_blocks(rows):
        for p, members in pools.items():
            in_pool = members[classes]
            if not in_pool.any():
                continue
            block_labels = labels[:, in_pool]
            values = scores[:, in_pool][block_labels >= 0].double()
            bucket = torch.searchsorted(candidates[p], values, right=True)
            known[p] += torch.bincount(bucket, minlength=len(candidates[p]) + 1)
            highest[p].scatter_reduce_(0, bucket, values, "amax")
    pooled = {}
    for p, scores_t in candidates.items():
        # positives at or above each candidate (its score counted once per positive holding it)
        positives_at = torch.bucketize(positive_scores[pools[p][positive_class]], scores_t)
        per_candidate = torch.bincount(positives_at, minlength=len(scores_t))
        tp = per_candidate.flip(0).cumsum(0).flip(0)
        known_ge = known[p][1:].flip(0).cumsum(0).flip(0)
        one_list = torch.zeros(len(scores_t), dtype=torch.int64)
        chosen = int(_chosen_cut(one_list, tp, known_ge, tp[:1], rule)[0])
        below = highest[p][: chosen + 1].max()  # the buckets of the known scores under T_chosen
        pooled[p] = float(_between(scores_t[chosen : chosen + 1], below.reshape(1))[0])
    return pooled


def _chosen_cut(
    list_of: torch.Tensor,
    tp: torch.Tensor,
    known_ge: torch.Tensor,
    n_positive: torch.Tensor,
    rule: ThresholdRule,
) -> torch.Tensor:
    """The cut ``rule`` takes in each of R lists (int64 (R,) indices into the M candidates, -1 without
    one); candidate ``i`` of list ``list_of[i]`` keeps the ``known_ge[i]`` items scoring at least its
    score, ``tp[i]`` of them positives, a list's candidates in increasing score order."""
    index = torch.arange(len(tp))
    f1 = 2 * tp.double() / (known_ge + n_positive[list_of]).double()
    best_f1 = torch.full((len(n_positive),), -1.0, dtype=torch.float64).scatter_reduce_(
        0, list_of, f1, "amax"
    )
    # the last best one is the highest cut
    chosen = torch.full_like(n_positive, -1)
    chosen.scatter_reduce_(0, list_of, torch.where(f1 == best_f1[list_of], index, -1), "amax")
    if rule.rule == "precision":
        reaches = tp.double() >= rule.precision * known_ge.double()
        lowest = torch.full_like(n_positive, len(tp))
        lowest.scatter_reduce_(0, list_of, torch.where(reaches, index, len(tp)), "amin")
        chosen = torch.where(lowest < len(tp), lowest, chosen)
    return chosen


def _between(above: torch.Tensor, below: torch.Tensor) -> torch.Tensor:
    """The threshold of a cut between the lowest kept score ``above`` and the highest dropped one
    ``below`` (float64; -inf: nothing dropped): their midpoint, or ``above`` where float64 rounds the
    midpoint onto ``below``; -inf when nothing is dropped."""
    dropped = (below > -torch.inf) & (above > -torch.inf)
    middle = torch.where(dropped, above / 2 + below / 2, -torch.inf)
    return torch.where(dropped & (middle <= below), above, middle)


def _thresholds_of_ranked(ranked: RankedPositives, rule: ThresholdRule) -> torch.Tensor:
    """The threshold of ``rule`` (float64, NaN without a positive) of every ranked list of ``ranked``."""
    n_lists, length = ranked.known_sorted.shape
    threshold = torch.full((n_lists,), torch.nan, dtype=torch.float64)
    if len(ranked.list_of) == 0:
        return threshold
    chosen = _chosen_cut(
        ranked.list_of.cpu(), ranked.tp.cpu(), ranked.known_ge.cpu(), ranked.n_positive.cpu(), rule
    )
    has_positive = chosen >= 0
    chosen, lists = chosen[has_positive], has_positive.nonzero().squeeze(1)
    above = ranked.score.cpu()[chosen].double()
    below_index = length - ranked.known_ge.cpu()[chosen] - 1  # the highest known score under ``above``
    below = ranked.known_sorted.cpu()[lists, below_index.clamp_min(0)].double()
    threshold[lists] = _between(above, torch.where(below_index >= 0, below, -torch.inf))
    return threshold


def held_out_f1(store: OutputStore, rule: ThresholdRule = DEFAULT_RULE) -> dict[str, Any]:
    """How ``rule``'s per-class thresholds do on data they were not calibrated on, beside one threshold
    for every class: the rows are halved by a permutation seeded with ``rule.seed`` (the first
    ``N // 2`` of ``torch.randperm(N)`` calibrate, the rest measure); on the calibration half the
    per-class thresholds of ``rule`` and the single threshold ``rule`` gives pooled over every class
    (:class:`ThresholdRule`), then on the other half the F1 of each (percent, -1 labels ignored):
    ``F1_mean`` the mean over classes with a positive there of ``2 TP_c / (NP_c + NG_c)`` (an unpredicted
    class counts 0), and ``CF1`` / ``OF1`` of :func:`figures_of_counts`. A class without a positive on the
    calibration half is never predicted. Returns ``{"rule", "precision", "min_positives", "pool", "seed",
    "calibrated_rows", "measured_rows", "per_class": {...}, "global": {..., "threshold"}}``."""
    if store.n_rows < 2:
        raise ValueError(f"cannot halve {store.n_rows} sample(s) to measure thresholds on held-out data")
    order = torch.randperm(store.n_rows, generator=torch.Generator().manual_seed(rule.seed))
    calibration, measured = order[: store.n_rows // 2].sort().values, order[store.n_rows // 2 :].sort().values
    per_class, global_threshold = _calibrate(store, calibration, rule, with_global=True)
    per_class = torch.where(per_class.isnan(), NEVER_PREDICTED, per_class)
    one = torch.full_like(per_class, NEVER_PREDICTED if math.isnan(global_threshold) else global_threshold)
    counts = {name: torch.empty(3, store.n_classes, dtype=torch.int64) for name in ("per_class", "global")}
    for classes, scores, labels in store.column_blocks(measured):
        values = scores.double()
        for name, thresholds in (("per_class", per_class), ("global", one)):
            counts[name][:, classes] = prediction_counts(values >= thresholds[classes], labels).cpu()
    figures = {}
    for name, of_classes in counts.items():
        true_positives, predicted_known, positives = of_classes
        counted = positives > 0
        f1 = 2 * true_positives[counted].double() / (predicted_known + positives)[counted].double()
        all_figures = figures_of_counts(of_classes)
        f1_mean = 100 * f1.mean().item() if counted.any() else math.nan
        figures[name] = {"F1_mean": f1_mean, "CF1": all_figures["CF1"], "OF1": all_figures["OF1"]}
    figures["global"]["threshold"] = global_threshold
    return {
        **asdict(rule),
        "calibrated_rows": len(calibration),
        "measured_rows": len(measured),
        **figures,
    }


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


def check_model_scores(scores: torch.Tensor, images: int | None = None) -> torch.Tensor:
    """``scores``, the (N, C) logits of a model (or a part of the ``images`` scored), unchanged;
    :class:`InferenceError` naming how many images have a NaN score when any has: the model's weights hold
    NaN or infinite values, and no rule can label them (a NaN compares false with every threshold)."""
    if scores.is_floating_point() and scores.numel() and torch.aminmax(scores).min.isnan():
        rows = int(scores.isnan().any(dim=1).sum())
        of = len(scores) if images is None else images
        raise InferenceError(
            f"the model's scores are NaN for {rows} of {plural(of, 'image')}: its weights hold NaN "
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
