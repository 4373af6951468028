"""``mlcls-bench metrics``: mAP@class + mAP@sample on COCO-val-sized scores, mlcls against scikit-learn.

The data imitate COCO val2014: 40,137 images, 80 classes with long-tailed frequencies (the most
frequent class in ~38% of the images), ~2.9 positives per image, float32 logits that separate positives
only partly. The scikit-learn pair is ``average_precision_score(average="macro")`` plus
``average="samples"`` over the rows with a positive; it takes tens of seconds, so this is a benchmark, not
a test. Both run on one CPU thread unless ``--threads`` says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

from mlcls.bench.harness import host, timed, torch_threads
from mlcls.metrics import compute_metrics, map_class, map_sample

POSITIVES_PER_ROW = 2.9
REPEATS = 5


def make_scores(n: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """COCO-like float32 logits (n, c) and {0, 1} labels (n, c), a deterministic function of ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    frequency = torch.arange(1, c + 1, dtype=torch.float64) ** -0.8
    frequency *= min(POSITIVES_PER_ROW, 0.5 * c) / frequency.sum()
    labels = (torch.rand(n, c, generator=generator, dtype=torch.float64) < frequency).float()
    logits = torch.randn(n, c, generator=generator) + 2.0 * labels - 3.0
    return logits, labels


def _mlcls_pair(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, float]:
    (class_percent, _), seconds = timed(lambda: map_class(logits, labels))
    (sample_percent, _), sample_s = timed(lambda: map_sample(logits, labels))
    return class_percent / 100, sample_percent / 100, seconds + sample_s


def run(n: int = 40137, c: int = 80, seed: int = 0, threads: int | None = 1) -> dict:
    """Both means timed with scikit-learn (once) and with mlcls (a cold call, then 5 before and 5 after
    scikit-learn's long run, so that a burst of load from other processes does not decide the result).

    ``ratio`` is scikit-learn's time over mlcls' median call, ``ratio_best`` over its best call; ``equal``
    compares the values to 1e-9. Torch runs ``threads`` CPU threads (default 1, as scikit-learn uses one
    core; steadier on a shared machine; 0 or ``None``: torch's setting).
    """
    with torch_threads(threads):
        logits, labels = make_scores(n, c, seed)
        ours_class, ours_sample, cold_s = _mlcls_pair(logits, labels)
        warm = [_mlcls_pair(logits, labels)[2] for _ in range(REPEATS)]
        _, all_figures_s = timed(lambda: compute_metrics(logits, labels, [f"class_{j}" for j in range(c)]))
        from sklearn.metrics import average_precision_score

        y_true, y_score = labels.numpy().astype(int), logits.double().numpy()
        macro, macro_s = timed(lambda: average_precision_score(y_true, y_score, average="macro"))
        with_positive = y_true.sum(1) > 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples, samples_s = timed(
                lambda: average_precision_score(
                    y_true[with_positive], y_score[with_positive], average="samples"
                )
            )
        warm += [_mlcls_pair(logits, labels)[2] for _ in range(REPEATS)]
        sklearn_s = macro_s + samples_s
        return {
            "n": n,
            "c": c,
            "positives_per_row": round(labels.sum().item() / n, 3),
            "sklearn_macro_s": round(macro_s, 4),
            "sklearn_samples_s": round(samples_s, 4),
            "sklearn_pair_s": round(sklearn_s, 4),
            "mlcls_pair_cold_s": round(cold_s, 4),
            "mlcls_pair_s": round(statistics.median(warm), 4),
            "mlcls_pair_best_s": round(min(warm), 4),
            "mlcls_compute_metrics_s": round(all_figures_s, 4),
            "ratio": round(sklearn_s / statistics.median(warm), 1),
            "ratio_best": round(sklearn_s / min(warm), 1),
            "equal": abs(ours_class - macro) <= 1e-9 and abs(ours_sample - samples) <= 1e-9,
            "map_class": 100 * ours_class,
            "map_sample": 100 * ours_sample,
            **host(),
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mlcls-bench metrics``."""
    parser.add_argument("--n", type=int, default=40137, help="samples (rows)")
    parser.add_argument("--c", type=int, default=80, help="classes (columns)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
