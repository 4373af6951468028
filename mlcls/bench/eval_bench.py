"""``mlcls-bench eval``: a single process's evaluation after the forward passes -- the outputs streamed
batch by batch into the store the trainer uses (:class:`~mlcls.metrics.store.Storage`: in memory, or on disk
above ``--in-memory-gb``), every metric (:func:`measure_store`), the threshold calibration
(:func:`calibrate_on_main`), their held-out F1 (:func:`held_out_on_main`) and results.json -- on generated
outputs: the seconds of each phase and the peak resident memory, and the figures checked against float64
references written from the definitions on sampled classes and samples.

The labels imitate Open Images' validation set: about :data:`POSITIVES_PER_ROW` positives per image from
long-tailed class frequencies, :data:`NEGATIVES_PER_ROW` verified negatives, every other label -1 (unknown);
logits are ``randn`` with positives shifted up by 2, so that AP is neither 0 nor 1. They are generated
:data:`BATCH_ROWS` rows at a time, as a model would give them: nothing of size N x C is ever in memory.
"""

from __future__ import annotations

import argparse
import math
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlcls.bench.harness import host, timed
from mlcls.engine.evaluate import calibrate_on_main, held_out_on_main, measure_store
from mlcls.errors import ConfigError
from mlcls.io import write_json
from mlcls.metrics import RowFigures
from mlcls.metrics.store import IN_MEMORY_GB, Storage
from mlcls.metrics.thresholds import check_model_scores

POSITIVES_PER_ROW = 5
NEGATIVES_PER_ROW = 5
BATCH_ROWS = 256
# Figures within this of their float64 reference are "exact": the sums of a few thousand float64 terms in
# another order differ by a few units in the last place.
EXACT = 1e-12


def peak_rss_gb() -> float:
    """The peak resident memory of this process so far, in GB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def output_batches(n: int, c: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Open Images-like float32 logits and int8 labels in {1, 0, -1}, :data:`BATCH_ROWS` rows (n in all)
    at a time, of ``c`` classes: a deterministic function of ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    frequency = torch.arange(1, c + 1, dtype=torch.float64) ** -0.8  # long-tailed positives
    for start in range(0, n, BATCH_ROWS):
        rows_here = min(BATCH_ROWS, n - start)
        labels = torch.full((rows_here, c), -1, dtype=torch.int8)
        rows = torch.arange(rows_here).repeat_interleave(min(NEGATIVES_PER_ROW, c))
        labels[rows, torch.randint(c, (len(rows),), generator=generator)] = 0
        rows = torch.arange(rows_here).repeat_interleave(min(POSITIVES_PER_ROW, c))
        positive_classes = torch.multinomial(frequency, len(rows), replacement=True, generator=generator)
        labels[rows, positive_classes] = 1
        logits = torch.randn(rows_here, c, generator=generator)
        logits[rows, positive_classes] += 2.0
        yield logits, labels


def make_outputs(n: int, c: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All of :func:`output_batches` at once (n, c), for a test's reference."""
    scores, labels = zip(*output_batches(n, c, seed), strict=True)
    return torch.cat(scores), torch.cat(labels)


def reference_ap(scores: np.ndarray, labels: np.ndarray) -> float:
    """AP of one ranked list from its definition, in float64: the mean over its positives ``i`` of
    ``TP(s_i) / K(s_i)`` (items labelled 0 or 1 scoring ``>= s_i``); NaN without a positive."""
    known = labels >= 0
    s, positive = scores[known].astype(np.float64), labels[known] == 1
    if not positive.any():
        return math.nan
    return float(np.mean([(positive & (s >= x)).sum() / (s >= x).sum() for x in s[positive]]))


def reference_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """The best-F1 logit threshold of one class from its definition, in float64: over the rules
    ``score >= v`` (v a distinct known score) the highest v of maximal ``2 TP / (K + P)``, placed halfway to
    the next lower known score (-inf when none); NaN without a positive."""
    known = labels >= 0
    s, positive = scores[known].astype(np.float64), labels[known] == 1
    if not positive.any():
        return math.nan
    values = np.unique(s)[::-1]
    f1 = [2 * (positive & (s >= v)).sum() / ((s >= v).sum() + positive.sum()) for v in values]
    best = int(np.argmax(f1))  # the first maximum in decreasing v: the highest
    return -math.inf if best == len(values) - 1 else (values[best] + values[best + 1]) / 2


def run(
    n: int = 41620,
    c: int = 9605,
    seed: int = 0,
    in_memory_gb: float = IN_MEMORY_GB,
    scratch_dir: str | None = None,
    check: int = 16,
    held_out: bool = True,
) -> dict[str, Any]:
    """Stream generated outputs into a store, evaluate them once in this process, check ``check`` sampled
    classes and samples against float64 references; return the figures."""
    if n < 1 or c < 1:
        raise ConfigError(f"--n and --c must be at least 1, got {n} and {c}")
    picker = torch.Generator().manual_seed(seed + 1)
    # half of the checked classes among the frequent ones (many labels), half anywhere
    sampled_classes = torch.cat(
        [
            torch.randperm(min(c, 100), generator=picker)[: check // 2],
            torch.randint(c, (check,), generator=picker),
        ]
    ).unique()[:check]
    sampled_rows = torch.randperm(n, generator=picker)[:check].sort().values
    columns: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows_kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    rows = RowFigures(n)
    store = Storage(in_memory_gb, scratch_dir).open(n, c, rows, check_model_scores)
    generate_s = store_s = 0.0
    batches = output_batches(n, c, seed)
    for start in range(0, n, BATCH_ROWS):
        (scores, labels), seconds = timed(lambda: next(batches))
        generate_s += seconds
        columns.append((scores[:, sampled_classes].clone(), labels[:, sampled_classes].clone()))
        for row in sampled_rows[(sampled_rows >= start) & (sampled_rows < start + len(scores))].tolist():
            rows_kept[row] = (scores[row - start].clone(), labels[row - start].clone())
        started = time.perf_counter()
        store.append(scores, labels)
        store_s += time.perf_counter() - started
    _, seconds = timed(store.finish)
    store_s += seconds
    classes = [f"class_{j}" for j in range(c)]
    evaluation, metrics_s = timed(lambda: measure_store(store, rows, classes))
    thresholds, thresholds_s = timed(lambda: calibrate_on_main(evaluation, classes))
    held_out_figures, held_out_s = timed(lambda: held_out_on_main(evaluation) if held_out else None)
    metrics = evaluation.metrics
    _, results_s = timed(lambda: _write_results(metrics))
    peak = peak_rss_gb()
    checked = _check(columns, rows_kept, sampled_classes, metrics, rows.sample_ap, thresholds)
    store.close()
    return {
        "n": n,
        "c": c,
        "store": type(store).__name__,
        "time_s": round(store_s + metrics_s + thresholds_s + held_out_s + results_s, 3),
        "peak_rss_gb": round(peak, 3),
        "inputs_gb": round(n * c * 5 / 1e9, 3),  # float32 logits and int8 labels
        "generate_s": round(generate_s, 3),
        "store_s": round(store_s, 3),
        "metrics_s": round(metrics_s, 3),
        "thresholds_s": round(thresholds_s, 3),
        "held_out_s": round(held_out_s, 3),
        "results_s": round(results_s, 3),
        "mAP_class": metrics["mAP_class"],
        "mAP_sample": metrics["mAP_sample"],
        "classes_counted": metrics["classes_counted"],
        "samples_counted": metrics["samples_counted"],
        "thresholds_finite": int(torch.isfinite(thresholds).sum()),
        **(
            {
                "held_out_F1_mean": held_out_figures["per_class"]["F1_mean"],
                "held_out_global_F1_mean": held_out_figures["global"]["F1_mean"],
            }
            if held_out_figures
            else {}
        ),
        **checked,
        **host(),
    }


def _check(
    columns: list[tuple[torch.Tensor, torch.Tensor]],
    rows_kept: dict[int, tuple[torch.Tensor, torch.Tensor]],
    sampled_classes: torch.Tensor,
    metrics: dict[str, Any],
    sample_ap: torch.Tensor,
    thresholds: torch.Tensor,
) -> dict[str, Any]:
    """The largest differences from the float64 references: the AP (fractions) and threshold of each
    sampled class (scikit-learn's ``average_precision_score``, :func:`reference_threshold`), the AP of each
    sampled sample (:func:`reference_ap`); ``exact`` when all are within :data:`EXACT` (thresholds equal)."""
    from sklearn.metrics import average_precision_score

    scores = torch.cat([s for s, _ in columns]).numpy()
    labels = torch.cat([lab for _, lab in columns]).numpy()
    ap_percent = list(metrics["per_class_ap"].values())
    class_diff = threshold_diff = 0.0
    for j, c in enumerate(sampled_classes.tolist()):
        known = labels[:, j] >= 0
        ours = ap_percent[c]
        if (labels[known, j] == 1).any():
            expected = average_precision_score(labels[known, j] == 1, scores[known, j].astype(np.float64))
            class_diff = max(class_diff, abs(ours / 100 - expected))
        elif ours is not None:
            class_diff = math.inf
        expected_t = reference_threshold(scores[:, j], labels[:, j])
        calibrated = thresholds[c].item()
        if not (calibrated == expected_t or (math.isnan(expected_t) and calibrated == math.inf)):
            threshold_diff = max(
                threshold_diff, abs(calibrated - expected_t) if math.isfinite(expected_t) else math.inf
            )
    sample_diff = 0.0
    for row, (row_scores, row_labels) in rows_kept.items():
        expected = reference_ap(row_scores.numpy(), row_labels.numpy())
        ours = sample_ap[row].item()
        same_nan = math.isnan(expected) and math.isnan(ours)
        sample_diff = max(sample_diff, 0.0 if same_nan else abs(ours - expected))
    return {
        "checked_classes": len(sampled_classes),
        "checked_samples": len(rows_kept),
        "max_class_ap_diff": class_diff,
        "max_sample_ap_diff": sample_diff,
        "max_threshold_diff": threshold_diff,
        "exact": class_diff <= EXACT and sample_diff <= EXACT and threshold_diff == 0.0,
    }


def _write_results(metrics: dict[str, Any]) -> None:
    """``metrics`` written as the trainer writes results.json (per-class AP apart), to a temporary file."""
    with tempfile.TemporaryDirectory() as folder:
        results = {k: v for k, v in metrics.items() if k != "per_class_ap"}
        write_json(
            {"metrics": results, "per_class_ap": metrics["per_class_ap"]}, Path(folder) / "results.json"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mlcls-bench eval``."""
    parser.add_argument("--n", type=int, default=41620, help="validation samples (rows)")
    parser.add_argument("--c", type=int, default=9605, help="classes (columns)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--in-memory-gb", type=float, default=IN_MEMORY_GB, help="above this, the outputs go to disk"
    )
    parser.add_argument("--scratch-dir", default=None, help="folder of the on-disk store (default: TMPDIR)")
    parser.add_argument("--check", type=int, default=16, help="classes and samples checked against float64")
    parser.add_argument(
        "--held-out",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the thresholds' held-out F1 (metrics.thresholds in results.json)",
    )
