"""``mlcls-bench thresholds``: do per-tag thresholds hold on rare tags? The held-out F1
(:func:`~mlcls.metrics.thresholds.held_out_f1`: calibrated on one half of a validation set, measured on the
other) of per-tag thresholds with each ``min_positives``, beside one global threshold's, on a generated
long-tailed tagging set.

The set imitates a tagger's validation split: ``c`` tags whose frequencies follow Zipf's law (tag ``r``, by
rank, on ``f_r = top / r**zipf`` of the images), every label known (a caption lists an image's tags). Each
tag's logits come from its own model, ``logit = log f_c + bias_c + z + margin_c y`` with ``z ~ N(0, 1)``: a
model whose scores follow each tag's frequency (as a BCE-trained one's do) up to a miscalibration
``bias_c ~ N(0, spread)``, and ranks each tag well or badly (``margin_c ~ U(2.5, 5)``). Tags of similar
frequency then want similar thresholds, up to their own ``bias_c``: what a tag with a few positives cannot
estimate alone.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from mlcls.bench.harness import host, timed
from mlcls.errors import ConfigError
from mlcls.metrics.store import MemoryStore
from mlcls.metrics.thresholds import ThresholdRule, held_out_f1


def make_tagging_set(
    n: int, c: int, zipf: float = 1.0, spread: float = 0.5, top: float = 0.3, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits (n, c) and int8 {0, 1} labels (n, c) of the module docstring's model."""
    g = torch.Generator().manual_seed(seed)
    frequency = top / torch.arange(1, c + 1, dtype=torch.float64) ** zipf
    labels = (torch.rand(n, c, generator=g, dtype=torch.float64) < frequency).to(torch.int8)
    bias = frequency.log().float() + spread * torch.randn(c, generator=g)
    margin = 2.5 + 2.5 * torch.rand(c, generator=g)
    scores = bias + torch.randn(n, c, generator=g) + margin * labels
    return scores, labels


def run(
    n: int = 20000,
    c: int = 2000,
    zipf: float = 1.0,
    spread: float = 0.5,
    seed: int = 0,
    halves: int = 3,
    min_positives: str = "0,3,10,30",
) -> dict[str, Any]:
    """The held-out F1 of each rule over ``halves`` seeded halvings (mean and range), and the set's shape."""
    if n < 2 or c < 1 or halves < 1:
        raise ConfigError(f"--n must be at least 2, --c and --halves at least 1; got {n}, {c}, {halves}")
    (scores, labels), generate_s = timed(lambda: make_tagging_set(n, c, zipf, spread, seed=seed))
    store = MemoryStore.of(scores, labels)
    positives = (labels == 1).sum(0)
    rules = [ThresholdRule(min_positives=int(m)) for m in min_positives.split(",")]
    rules += [ThresholdRule(min_positives=int(m), pool="global") for m in min_positives.split(",")[1:]]
    rules += [ThresholdRule(rule="precision", precision=0.9, min_positives=m) for m in (0, 10)]
    rows, start = [], time.perf_counter()
    for rule in rules:
        runs = [held_out_f1(store, ThresholdRule(**{**vars(rule), "seed": s})) for s in range(halves)]
        row = {
            "rule": rule.rule if rule.rule == "f1" else f"precision>={rule.precision}",
            "min_positives": rule.min_positives,
            "pool": rule.pool,
        }
        for name in ("per_class", "global"):
            for figure in ("F1_mean", "OF1"):
                values = [r[name][figure] for r in runs]
                row[f"{name}_{figure}"] = round(sum(values) / len(values), 2)
                row[f"{name}_{figure}_range"] = round(max(values) - min(values), 2)
        rows.append(row)
    rules_s = time.perf_counter() - start
    return {
        "n": n,
        "c": c,
        "zipf": zipf,
        "spread": spread,
        "halves": halves,
        "generate_s": round(generate_s, 6),
        "rules_s": round(rules_s, 6),  # every rule's calibrations and measures over the halvings
        "tags_with_under_10_positives": int(((positives > 0) & (positives < 10)).sum()),
        "tags_without_positive": int((positives == 0).sum()),
        "median_positives": int(positives.median()),
        "rules": rows,
        **host(),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mlcls-bench thresholds``."""
    parser.add_argument("--n", type=int, default=20000, help="validation images (rows)")
    parser.add_argument("--c", type=int, default=2000, help="tags (columns)")
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent of the tags' frequencies")
    parser.add_argument("--spread", type=float, default=0.5, help="std of the tags' miscalibration (logits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--halves", type=int, default=3, help="seeded halvings averaged")
    parser.add_argument("--min-positives", default="0,3,10,30", help="comma-separated values compared")
