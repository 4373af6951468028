"""Benchmark of the two-way loss against a plain masked-logsumexp implementation of eq. 17.

Forward + backward of :class:`mlcls.losses.TwoWayLoss` (tp = 4, tn = 1, buckets of M = 128 rows) on
(512, 80) logits (MS-COCO's class count) and (512, 620) logits (VAW's), timed in the same run as
:func:`masked_logsumexp_twoway`, the approach of the authors' public code: logits masked by adding a large
negative number, ``torch.logsumexp`` per row and per column, autograd for the backward pass.

    python -m mlcls.bench.loss_bench [--device cpu] [--repeats 100]

prints one JSON line: the median milliseconds of both implementations at both sizes and ``ratio``, the
larger of the two ratios (two-way / masked logsumexp; below 1 means faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

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


def _random_batch(classes: int, labels_per_sample: float, device: str, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(BATCH_SIZE, classes, generator=generator)
    targets = (torch.rand(BATCH_SIZE, classes, generator=generator) < labels_per_sample / classes).float()
    return logits.to(device), targets.to(device)


def _time_ms(fn: Callable[[Tensor, Tensor], Tensor], logits: Tensor, targets: Tensor, device: str) -> float:
    """Milliseconds of one forward + backward of ``fn``."""
    x = logits.detach().requires_grad_(True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(x, targets).backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 1000.0 * (time.perf_counter() - start)


def run(device: str = "cpu", repeats: int = 100, warmup: int = 10) -> dict[str, float]:
    """Median forward + backward milliseconds of both implementations at both sizes, and ``ratio``.

    The two implementations alternate within each repeat so that they see the same machine state.
    Raises ``AssertionError`` if they disagree on the loss value or gradient.
    """
    twoway = TwoWayLoss(tp=TP, tn=TN, bucket_size=BUCKET_SIZE)
    result: dict[str, float] = {}
    ratios = []
    for index, (name, classes, labels_per_sample) in enumerate(SIZES):
        logits, targets = _random_batch(classes, labels_per_sample, device, seed=index)
        _check_agreement(twoway, logits, targets)
        times: dict[str, list[float]] = {"twoway": [], "masked_lse": []}
        for step in range(warmup + repeats):
            for key, fn in (("twoway", twoway), ("masked_lse", masked_logsumexp_twoway)):
                elapsed = _time_ms(fn, logits, targets, device)
                if step >= warmup:
                    times[key].append(elapsed)
        medians = {key: statistics.median(values) for key, values in times.items()}
        result[f"twoway_{name}_ms"] = medians["twoway"]
        result[f"masked_lse_{name}_ms"] = medians["masked_lse"]
        ratios.append(medians["twoway"] / medians["masked_lse"])
    result["ratio"] = max(ratios)
    return result


def _check_agreement(twoway: TwoWayLoss, logits: Tensor, targets: Tensor) -> None:
    grads = []
    for fn in (twoway, masked_logsumexp_twoway):
        x = logits.detach().requires_grad_(True)
        value = fn(x, targets)
        value.backward()
        grads.append((value.detach(), x.grad))
    (v1, g1), (v2, g2) = grads
    assert torch.allclose(v1, v2, rtol=1e-4) and torch.allclose(g1, g2, rtol=1e-3, atol=1e-7), "mismatch"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: print ``run``'s result as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    result = run(device=args.device, repeats=args.repeats)
    print(json.dumps({key: round(value, 4) for key, value in result.items()}))
    return result


if __name__ == "__main__":
    main()
