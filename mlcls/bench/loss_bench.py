"""``mlcls-bench loss``: the two-way loss against a plain masked-logsumexp implementation of eq. 17.

Forward + backward of :class:`mlcls.losses.TwoWayLoss` (tp = 4, tn = 1, buckets of 128 rows) and of
:func:`masked_logsumexp_twoway` (the authors' approach) on (512, 80) and (512, 620) logits; ``ratio`` is
the larger two-way / masked-logsumexp ratio. ``--scale`` (:func:`run_scale`) times every loss at C = 80,
9,605 (Open Images) and 75,000 (a large tagger's vocabulary), batch 128, and mAP@class / mAP@sample on
20,000 x 9,605 scores.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlcls import losses
from mlcls.bench.harness import (
    median_seconds,
    mmap_allocations,
    peak_bytes,
    random_labels,
    timed,
    torch_threads,
)
from mlcls.data.datasets.labels import LabelCounts
from mlcls.losses import TwoWayLoss

# (name, classes, positive labels per sample) after Table 6 of the paper; batch 512, buckets of 128.
SIZES = (("512x80", 80, 2.9), ("512x620", 620, 1.8))
BATCH_SIZE = 512
BUCKET_SIZE = 128
TP, TN = 4.0, 1.0
MASK = -1e30  # added to the logits outside a set; large enough that no real logit gap reaches it


def masked_logsumexp_twoway(
    logits: Tensor, targets: Tensor, tp: float = TP, tn: float = TN, bucket_size: int = BUCKET_SIZE
) -> Tensor:
    """Eq. 17 per bucket with additive masks and ``torch.logsumexp`` (the reference approach).

    Same value as ``TwoWayLoss(tp, tn, bucket_size=bucket_size)`` on labels in {1, 0}.
    """
    classes = logits.shape[1]
    x = logits.float().view(-1, bucket_size, classes)
    y = targets.view(-1, bucket_size, classes)
    positive = y == 1
    neg_logits = x / tn + torch.where(y == 0, 0.0, MASK)
    pos_logits = -x / tp + torch.where(positive, 0.0, MASK)
    loss = x.new_zeros(())
    for dim in (2, 1):  # sample-wise (rows), class-wise (columns)
        per_line = F.softplus(tn * torch.logsumexp(neg_logits, dim) + tp * torch.logsumexp(pos_logits, dim))
        valid = positive.any(dim)
        loss = loss + ((per_line * valid).sum(1) / valid.sum(1).clamp(min=1)).mean()
    return loss


def _random_batch(
    classes: int, labels_per_sample: float, device: str, seed: int, batch_size: int = BATCH_SIZE
) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(batch_size, classes, generator=generator)
    targets = random_labels(batch_size, classes, labels_per_sample, generator)
    return logits.to(device), targets.to(device)


def _step(fn: Callable[[Tensor, Tensor], Tensor], logits: Tensor, targets: Tensor) -> Callable[[], None]:
    """One forward + backward of ``fn``, as a block to time."""
    return lambda: fn(logits.detach().requires_grad_(True), targets).backward()


def _median_ms(
    criteria: dict[str, Callable[[Tensor, Tensor], Tensor]],
    logits: Tensor,
    targets: Tensor,
    repeats: int,
    warmup: int,
    device: str = "cpu",
) -> dict[str, float]:
    """Median forward + backward milliseconds of each criterion, the criteria taking turns."""
    blocks = {name: _step(fn, logits, targets) for name, fn in criteria.items()}
    return {name: 1000.0 * s for name, s in median_seconds(blocks, repeats, warmup, device).items()}


def run(device: str = "cpu", repeats: int = 100, warmup: int = 10) -> dict[str, float]:
    """Median forward + backward milliseconds of both implementations at both sizes, and ``ratio``.
    Raises ``AssertionError`` if they disagree on the loss value or gradient."""
    twoway = TwoWayLoss(tp=TP, tn=TN, bucket_size=BUCKET_SIZE)
    criteria = {"twoway": twoway, "masked_lse": masked_logsumexp_twoway}
    result: dict[str, float] = {}
    ratios = []
    for index, (name, classes, labels_per_sample) in enumerate(SIZES):
        logits, targets = _random_batch(classes, labels_per_sample, device, seed=index)
        grads = []
        for fn in criteria.values():
            x = logits.detach().requires_grad_(True)
            value = fn(x, targets)
            value.backward()
            grads.append((value.detach(), x.grad))
        (v1, g1), (v2, g2) = grads
        assert torch.allclose(v1, v2, rtol=1e-4) and torch.allclose(g1, g2, rtol=1e-3, atol=1e-7), "mismatch"
        medians = _median_ms(criteria, logits, targets, repeats, warmup, device)
        result[f"twoway_{name}_ms"] = medians["twoway"]
        result[f"masked_lse_{name}_ms"] = medians["masked_lse"]
        ratios.append(medians["twoway"] / medians["masked_lse"])
    result["ratio"] = max(ratios)
    return result


# Large label spaces: classes (MS-COCO, Open Images V6 trainable, a tagger's vocabulary), batch per process,
# metric set size (the metrics are timed at Open Images' 9,605 classes).
SCALE_CLASSES = (80, 9605, 75_000)
METRIC_CLASSES = 9605
SCALE_BATCH = 128
SCALE_POSITIVES = 3.0
SCALE_METRIC_SAMPLES = 20_000


def _scale_batches(classes: Sequence[int]) -> dict[int, tuple[Tensor, Tensor]]:
    return {c: _random_batch(c, SCALE_POSITIVES, "cpu", seed=c, batch_size=SCALE_BATCH) for c in classes}


# The arguments a loss has no default for.
SCALE_ARGUMENTS: dict[str, dict[str, float]] = {
    "epr": {"expected_positives": SCALE_POSITIVES},
    "role": {"expected_positives": SCALE_POSITIVES},
}


# Variants of a loss measured beside it: its per-sample modes (LL-Cp at its second epoch, when it corrects;
# EM with APL's pseudo-label table), by the name the bench reports them under.
SCALE_VARIANTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "ll_cp": ("ll", {"mode": "cp"}, 1),
    "em_apl": ("em", {"apl": True, "epochs": 10, "warmup_epochs": 5}, 0),
}


def loss_classes() -> dict[str, type[nn.Module]]:
    """Every loss class of :mod:`mlcls.losses` by its name (``loss=<name>``)."""
    return {cls.name: cls for cls in (getattr(losses, name) for name in losses.__all__)}


def _criteria(classes: int = SCALE_CLASSES[0]) -> dict[str, Callable[[Tensor, Tensor], Tensor]]:
    """Every loss of :mod:`mlcls.losses` with its default arguments (and ``SCALE_ARGUMENTS``), and the
    ``SCALE_VARIANTS``, by name, as a function of (logits, targets) for batches of ``classes`` classes. A
    loss with a row per training sample is set up for a training set of one batch and called with its
    indices."""
    classes_by_name = loss_classes()
    settings = {name: (name, {}, 0) for name in classes_by_name} | SCALE_VARIANTS
    result: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
    for name, (loss_name, arguments, epoch) in settings.items():
        criterion = classes_by_name[loss_name](**SCALE_ARGUMENTS.get(loss_name, {}), **arguments)
        if epoch:
            criterion.set_epoch(epoch)
        if getattr(criterion, "needs_sample_index", False):
            criterion.setup(LabelCounts(SCALE_BATCH, torch.zeros(classes), torch.zeros(classes)))
            criterion = functools.partial(criterion, indices=torch.arange(SCALE_BATCH))
        result[name] = criterion
    return result


def peak_memory(classes: Sequence[int] = SCALE_CLASSES) -> dict[str, float]:
    """``<name>_c<C>_peak_mib``: the peak memory one forward + backward adds, every loss at every size of
    ``classes`` (Linux), in a fresh process whose allocations glibc serves by ``mmap``
    (:func:`~mlcls.bench.harness.peak_bytes`)."""
    mmap_allocations()  # before any tensor exists
    result = {}
    for size, (logits, targets) in _scale_batches(classes).items():
        for name, criterion in _criteria(size).items():
            step = _step(criterion, logits, targets)
            step()  # first call: lazy initialisations
            result[f"{name}_c{size}_peak_mib"] = peak_bytes(step) / 2**20
    return result


def run_scale(
    repeats: int = 20, warmup: int = 3, threads: int = 1, classes: Sequence[int] = SCALE_CLASSES
) -> dict[str, float]:
    """Every loss at every size of ``classes`` (batch 128): ``<name>_c<C>_ms`` (median forward + backward,
    the losses interleaved within each repeat), ``twoway_over_bce_c<C>`` at each size and
    ``twoway_over_bce`` at the largest, ``map_class_s`` / ``map_sample_s`` (one call each, N = 20,000,
    C = 9,605) and, on Linux, the :func:`peak_memory` figures measured in a child process. Torch runs
    ``threads`` intra-op threads (default 1: the ratio then does not depend on what else the machine
    runs)."""
    from mlcls.bench.metrics_bench import make_scores
    from mlcls.metrics import map_class, map_sample

    result: dict[str, float] = {}
    with torch_threads(threads):
        for size, (logits, targets) in _scale_batches(classes).items():
            for name, ms in _median_ms(_criteria(size), logits, targets, repeats, warmup).items():
                result[f"{name}_c{size}_ms"] = ms
            result[f"twoway_over_bce_c{size}"] = result[f"twoway_c{size}_ms"] / result[f"bce_c{size}_ms"]
        result["twoway_over_bce"] = result[f"twoway_over_bce_c{max(classes)}"]
        scores, labels = make_scores(SCALE_METRIC_SAMPLES, METRIC_CLASSES, seed=0)
        for key, metric in (("map_class_s", map_class), ("map_sample_s", map_sample)):
            result[key] = timed(functools.partial(metric, scores, labels))[1]
        if sys.platform == "linux":
            child = [sys.executable, "-m", "mlcls.bench.loss_bench", *map(str, classes)]
            output = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            result.update(json.loads(output.strip().splitlines()[-1]))
    return {**result, "torch_threads": threads}


def class_counts(text: str) -> tuple[int, ...]:
    """``--classes``: comma-separated class counts, each at least 2 (a two-way loss needs two classes)."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}; expected comma-separated class counts, each >= 2")
    return counts


# Timed calls per loss: at C = 80 (two losses), and under --scale (every loss, up to C = 75,000), where each
# call costs far more.
LOSS_REPEATS, SCALE_REPEATS = 100, 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mlcls-bench loss``."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--repeats", type=int, help=f"timed calls per loss ({LOSS_REPEATS}; --scale: {SCALE_REPEATS})"
    )
    scale = "every loss at the --classes sizes, batch 128 (CPU)"
    parser.add_argument("--scale", action="store_true", help=scale)
    parser.add_argument(
        "--classes",
        type=class_counts,
        default=",".join(map(str, SCALE_CLASSES)),
        help="class counts of --scale, comma-separated",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for --scale")


def run_from_args(args: argparse.Namespace) -> dict[str, float]:
    if args.scale:
        repeats = SCALE_REPEATS if args.repeats is None else args.repeats
        return run_scale(repeats, threads=args.threads, classes=args.classes)
    return run(args.device, LOSS_REPEATS if args.repeats is None else args.repeats)


if __name__ == "__main__":  # the child process of run_scale, with its class counts as arguments
    print(json.dumps(peak_memory(tuple(int(arg) for arg in sys.argv[1:]))))
