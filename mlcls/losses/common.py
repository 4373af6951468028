"""What the losses share: input checks, base classes, reductions, masked log-sum-exp, buckets.

Conventions of :mod:`mlcls.losses`:

* ``logits`` (B, C) of any float dtype are cast to float32 for the computation (float64 stays float64),
  with autocast disabled inside the loss;
* ``targets`` (B, C) hold 1 = positive, 0 = negative, -1 = unknown. An unknown entry is *excluded*: it
  is in neither the positive nor the negative set, so it enters no sum, no log-sum-exp and no count;
* a set that is empty contributes ``log-sum-exp = -inf`` (``sum_{empty} exp = 0``), never a finite
  stand-in such as adding -100 to a logit, which leaks once logit gaps exceed 100;
* a forward or backward pass reads no value back from the device (no ``.item()``, ``bool()`` or ``if``
  on a tensor), so a training step on a GPU never waits for it; the one exception is the batch-size
  check of the first DDP gather (:func:`gather_batch`).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar

import torch
from torch import Tensor, nn

from mlcls.collectives import gather_batch

REDUCTIONS = ("mean", "sum", "sum_per_sample")
# Inside a bucket tensor (K, M, C): a sample's logits lie along dim 2, a class's logits along dim 1.
WAY_DIMS: dict[str, tuple[int, ...]] = {"both": (2, 1), "sample": (2,), "class": (1,)}

LineDims = int | tuple[int, ...]


def autocast_disabled(device_type: str) -> AbstractContextManager:
    """A context with autocast disabled on ``device_type``; a no-op on a device without autocast (the meta
    device, on which shapes can be checked without data)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return nullcontext()


def check_positive(**values: float) -> None:
    """Raise ``ValueError`` unless every keyword value is > 0 (temperatures, eps, ...)."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def check_non_negative(**values: float) -> None:
    """Raise ``ValueError`` unless every keyword value is >= 0 (focusing exponents, weights, ...)."""
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """``value``, or ``ValueError`` naming the ``choices`` of option ``name``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_ways(ways: str) -> tuple[int, ...]:
    """The bucket dims of ``ways`` (a key of :data:`WAY_DIMS`), or ``ValueError``."""
    return WAY_DIMS[check_choice("ways", ways, tuple(WAY_DIMS))]


def check_expected_positives(loss: str, expected_positives: float | None) -> float:
    """``k``, the expected number of positives per image that ``epr`` and ``role`` need as outside
    knowledge (there is no default), as a float; ``ValueError`` when it is missing or not > 0."""
    if expected_positives is None:
        raise ValueError(
            f"{loss} needs loss.expected_positives, the expected number of positives per image "
            "(the authors': 1.5 VOC 2012, 2.9 MS-COCO, 1.9 NUS-WIDE, 31.4 CUB)"
        )
    check_positive(expected_positives=expected_positives)
    return float(expected_positives)


def expected_positives_penalty(probabilities: Tensor, expected_positives: float) -> Tensor:
    """EPR's regulariser (Cole et al., eq. 6) of probabilities (B, C): ``(mean_i sum_c p_ic - k)^2 / C^2``."""
    return (probabilities.sum(1).mean() - expected_positives).square() / probabilities.shape[1] ** 2


def prepare(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``logits``/``targets`` (B, C) checked and in the compute dtype; labels outside {1, 0, -1} are refused
    on the CPU only (on a GPU the check would stall every step; the datasets validate their labels once)."""
    if logits.ndim != 2 or logits.shape != targets.shape:
        raise ValueError(
            f"logits and targets must both be (B, C); got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    targets = targets.to(dtype)
    if targets.device.type == "cpu" and not ((targets == 1) | (targets == 0) | (targets == -1)).all():
        raise ValueError("targets must hold only 1 (positive), 0 (negative) and -1 (unknown)")
    return logits.to(dtype), targets


def line_max(masked: Tensor, dim: LineDims) -> Tensor:
    """The maximum of ``masked`` (-inf outside the set) along ``dim`` (kept as size 1), without gradient;
    0 on a line of -inf only: the shift of a stable log-sum-exp over the set."""
    shift = masked.detach().amax(dim, keepdim=True)
    return torch.where(shift == float("-inf"), 0.0, shift)


def log_total(total: Tensor, shift: Tensor) -> Tensor:
    """``log(total) + shift`` with -inf where ``total == 0``, and a zero (not NaN) gradient there."""
    tiny = torch.finfo(total.dtype).tiny
    return torch.where(total > 0, total.clamp_min(tiny).log() + shift, float("-inf"))


def masked_logsumexp(values: Tensor, mask: Tensor, dim: LineDims) -> Tensor:
    """``log sum_{mask} exp(values)`` along ``dim`` (kept as size 1); -inf on a line with no entry in mask.

    Entries outside ``mask`` are truly excluded: their value never reaches the result and their gradient
    is exactly 0, whatever their magnitude. The exponential is taken of 0 outside the set and then replaced
    by exactly 0: the CPU's ``exp`` is about ten times slower on -inf, and nearly every entry is outside.
    """
    shift = line_max(values.masked_fill(~mask, float("-inf")), dim)
    exp = torch.where(mask, torch.where(mask, values - shift, 0.0).exp(), 0.0)
    return log_total(exp.sum(dim, keepdim=True), shift)


def line_weights(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """Weights ``valid / (valid lines of the bucket * K)`` (the shape of ``valid``: (K, M, 1), (K, 1, C) or
    (K, 1, 1)) that turn a sum over lines into "mean over valid lines per bucket, then mean over buckets";
    a bucket without a valid line contributes 0 and still counts among the K buckets."""
    buckets = valid.shape[0]
    count = valid.flatten(1).sum(1).clamp(min=1).view(-1, 1, 1)
    return valid.to(dtype) / (count * buckets)


def split_buckets(tensor: Tensor, bucket_size: int | None) -> Tensor:
    """View (B, C) as (K, M, C): K consecutive buckets of M = ``bucket_size`` rows (None: one bucket)."""
    rows, classes = tensor.shape
    size = rows if bucket_size is None else bucket_size
    if rows % size != 0:
        raise ValueError(f"bucket_size={size} must divide the batch size {rows}")
    return tensor.view(rows // size, size, classes)


class MultiLabelLoss(nn.Module):
    """Base of every loss: ``forward`` calls :meth:`compute` on the :func:`prepare`-d inputs under
    :func:`autocast_disabled`; ``name`` is the loss's short name (``loss=<name>``)."""

    name: ClassVar[str]
    # True where the loss is a sum over the batch's samples (not a mean): under DDP the trainer multiplies
    # it by the number of processes (mlcls.engine.build.GlobalBatchSum), since DDP averages the gradients.
    sums_over_batch: ClassVar[bool] = False

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        """logits (B, C), targets (B, C) in {1, 0, -1} -> scalar."""
        with autocast_disabled(logits.device.type):
            return self.compute(*prepare(logits, targets))

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        """The constructor's arguments (as the config names them) and their values."""
        arguments = inspect.signature(type(self).__init__).parameters
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in arguments if hasattr(self, name))


class BucketedLoss(MultiLabelLoss):
    """Base of the losses computed per bucket of rows (Sec. 2.4, footnote 1 of the paper): the mean of
    :meth:`bucket_loss` over K consecutive buckets of the (with ``gather``, global) batch.

    Args:
        bucket_size: rows per bucket, M; must divide the batch size (of the gathered batch when
            ``gather``). ``None``: one bucket of the whole (local, or gathered) batch.
        gather: under DDP, compute the loss on the global batch of all ranks (see :func:`gather_batch`).
    """

    def __init__(self, bucket_size: int | None = None, gather: bool = False) -> None:
        super().__init__()
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive integer or None, got {bucket_size}")
        self.bucket_size = bucket_size
        self.gather = gather
        self.sizes_checked = False  # the ranks' batch sizes are compared on the first gather only

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        if self.gather:
            logits, targets = gather_batch(logits, targets, check_sizes=not self.sizes_checked)
            self.sizes_checked = True
        return self.bucket_loss(
            split_buckets(logits, self.bucket_size), split_buckets(targets, self.bucket_size)
        )

    def bucket_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """logits, targets (K, M, C), targets in {1, 0, -1} -> scalar mean over the K buckets."""
        raise NotImplementedError


class EntrywiseLoss(MultiLabelLoss):
    """Base of the losses defined per entry (i, c) of the logit matrix: :meth:`entry_loss` gives ``l_ic``
    (B, C), reduced over the counted entries by ``reduction``. The counted entries are the known ones
    (label 1 or 0), or every entry where the class sets ``counts_unknown``:

    * ``"mean"``: sum over the counted entries divided by their number (0 when none is counted);
    * ``"sum"``: sum over the counted entries of the batch;
    * ``"sum_per_sample"``: each sample's sum over its counted entries (classes), then the mean over the
      samples with at least one counted entry.

    Under DDP the batch is the per-process one (for ``"sum"`` see :attr:`sums_over_batch`). Entries not
    counted are dropped with ``where``, so their value and gradient never reach the result.
    """

    # True where entry_loss gives unknown labels (-1) a term: every entry of the batch is then counted.
    counts_unknown: ClassVar[bool] = False

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = check_choice("reduction", reduction, REDUCTIONS)

    @property
    def sums_over_batch(self) -> bool:  # type: ignore[override]
        """Whether the reduction is a sum over the batch (``"sum"``)."""
        return self.reduction == "sum"

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """logits, targets (B, C) -> ``l_ic`` (B, C); its values at unknown entries are discarded."""
        raise NotImplementedError

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.reduce(self.entry_loss(logits, targets), targets)

    def reduce(self, per_entry: Tensor, targets: Tensor) -> Tensor:
        """``per_entry`` (B, C) -> scalar: its counted entries reduced by ``reduction``."""
        counted = torch.ones_like(targets, dtype=torch.bool) if self.counts_unknown else targets >= 0
        total = torch.where(counted, per_entry, 0.0).sum()
        if self.reduction == "sum":
            return total
        if self.reduction == "sum_per_sample":
            return total / counted.any(1).sum().clamp(min=1)
        return total / counted.sum().clamp(min=1)
