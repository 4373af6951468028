"""``mlcls-bench eval``: the trainer's evaluation after the forward passes (:func:`measure_rank_parts`,
:func:`calibrate_on_main`, results.json) on generated Open Images-sized outputs: the seconds of each phase
and the peak resident memory after generating the inputs and at the end.

The labels imitate Open Images' validation set: about :data:`POSITIVES_PER_ROW` positives per image from
long-tailed class frequencies, :data:`NEGATIVES_PER_ROW` verified negatives, every other label -1 (unknown);
logits are ``randn`` with positives shifted up by 2, so that AP is neither 0 nor 1.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mlcls.bench.harness import host, timed
from mlcls.engine.evaluate import calibrate_on_main, measure_rank_parts
from mlcls.errors import ConfigError
from mlcls.io import write_json

POSITIVES_PER_ROW = 5
NEGATIVES_PER_ROW = 5


def peak_rss_gb() -> float:
    """The peak resident memory of this process so far, in GB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def make_outputs(n: int, c: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Open Images-like float32 logits (n, c) and int8 labels (n, c) in {1, 0, -1}, a deterministic function
    of ``seed``; nothing but the two results is allocated at their size."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.full((n, c), -1, dtype=torch.int8)
    frequency = torch.arange(1, c + 1, dtype=torch.float64) ** -0.8  # long-tailed positives
    rows = torch.arange(n).repeat_interleave(min(NEGATIVES_PER_ROW, c))
    labels[rows, torch.randint(c, (len(rows),), generator=generator)] = 0
    rows = torch.arange(n).repeat_interleave(min(POSITIVES_PER_ROW, c))
    positive_classes = torch.multinomial(frequency, len(rows), replacement=True, generator=generator)
    labels[rows, positive_classes] = 1
    logits = torch.randn(n, c, generator=generator)
    logits[rows, positive_classes] += 2.0
    return logits, labels


def run(n: int = 41620, c: int = 9605, seed: int = 0) -> dict[str, Any]:
    """Generate the outputs, run the evaluation once in this process (one rank), return the figures."""
    if n < 1 or c < 1:
        raise ConfigError(f"--n and --c must be at least 1, got {n} and {c}")
    (scores, labels), generate_s = timed(lambda: make_outputs(n, c, seed))
    inputs_peak_gb = peak_rss_gb()
    classes = [f"class_{j}" for j in range(c)]
    evaluation, metrics_s = timed(partial(measure_rank_parts, scores, labels, n, classes))
    del scores, labels  # the evaluation holds them now, as the trainer's evaluation does
    thresholds, thresholds_s = timed(lambda: calibrate_on_main(evaluation, classes))
    metrics = evaluation.metrics
    _, results_s = timed(lambda: _write_results(metrics))
    return {
        "n": n,
        "c": c,
        "time_s": round(metrics_s + thresholds_s + results_s, 3),
        "peak_rss_gb": round(peak_rss_gb(), 3),
        "inputs_peak_rss_gb": round(inputs_peak_gb, 3),
        "inputs_gb": round(n * c * 5 / 1e9, 3),  # float32 logits and int8 labels
        "generate_s": round(generate_s, 3),
        "gather_and_metrics_s": round(metrics_s, 3),
        "thresholds_s": round(thresholds_s, 3),
        "results_s": round(results_s, 3),
        "mAP_class": metrics["mAP_class"],
        "mAP_sample": metrics["mAP_sample"],
        "classes_counted": metrics["classes_counted"],
        "samples_counted": metrics["samples_counted"],
        "thresholds_finite": int(torch.isfinite(thresholds).sum()),
        **host(),
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
