"""Observed-label regimes: which labels of the training split the model is shown (``dataset.observed``).

* ``all`` (default): every label; ``partial``: each known label kept with probability ``fraction``;
* ``single_positive`` (Cole et al., CVPR 2021): one positive per image drawn uniformly, every other label
  -1 (an image without a positive keeps none, as the authors' observation step leaves it).

Unknown labels stay unknown. The draw is a pure function of ``(seed, sample index, class)`` (a hash,
:func:`mix64`), never of a random state: the same on every rank, worker and resume. The held-out selection
split (:class:`HoldoutSplit`) is drawn the same way, from a hash stream of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

OBSERVED_REGIMES = ("all", "single_positive", "partial")
# dataset.val_labels: a selecting held-out share's full labels, or its labels as the regime shows them
HOLDOUT_LABELS = ("clean", "observed")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_STREAMS = {"single_positive": 1, "partial": 2, "holdout": 3}  # one hash stream per draw
_UNIT_BITS = 53  # a hash's top 53 bits give a uniform float in [0, 1) exactly


def mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of the uint64 ``values`` (wrapping): a bijection whose outputs of
    consecutive inputs look independent and uniform."""
    with np.errstate(over="ignore"):
        z = np.asarray(values, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX[0]
        z = (z ^ (z >> np.uint64(27))) * _MIX[1]
        return z ^ (z >> np.uint64(31))


def sample_hashes(seed: int, stream: str, samples: np.ndarray) -> np.ndarray:
    """uint64: one hash per sample index of ``samples``, from ``seed`` and the draw's own ``stream``."""
    key = mix64(np.uint64(seed) ^ np.uint64(_STREAMS[stream]))
    return mix64(key ^ np.asarray(samples, dtype=np.int64).astype(np.uint64))


@dataclass(frozen=True)
class ObservedLabels:
    """An observed-label regime (``dataset.observed``, ``observed_seed``, ``observed_fraction`` in (0, 1]),
    checked by :func:`mlcls.data.training_policies`."""

    regime: str = "all"
    seed: int = 0
    fraction: float = 1.0

    @property
    def hides_labels(self) -> bool:
        """Whether some labels become unknown (every regime but ``all``)."""
        return self.regime != "all"

    def observe(self, samples: np.ndarray, columns: np.ndarray, values: np.ndarray) -> np.ndarray:
        """int8 (K,): the observed values of the entries ``(samples[k], columns[k]) = values[k]`` (1 / 0 /
        -1; entries not given are unknown). ``single_positive`` needs every positive of a sample given (of
        several samples, in any order)."""
        values = np.asarray(values, dtype=np.int8)
        if not self.hides_labels:
            return values
        samples, columns = np.asarray(samples, dtype=np.int64), np.asarray(columns, dtype=np.int64)
        if self.regime == "partial":
            hashes = mix64(sample_hashes(self.seed, self.regime, samples) ^ columns.astype(np.uint64))
            kept = (hashes >> np.uint64(64 - _UNIT_BITS)).astype(np.float64) < self.fraction * 2.0**_UNIT_BITS
            return np.where(kept, values, -1).astype(np.int8)
        observed = np.full(len(values), -1, dtype=np.int8)
        positives = np.flatnonzero(values == 1)
        if len(positives) == 0:
            return observed
        # The positives sample by sample, classes ascending: the k-th positive of a sample is well defined.
        positives = positives[np.lexsort((columns[positives], samples[positives]))]
        owners = samples[positives]
        starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        counts = np.diff(np.r_[starts, len(positives)]).astype(np.uint64)
        chosen = starts + (sample_hashes(self.seed, self.regime, owners[starts]) % counts).astype(np.int64)
        observed[positives[chosen]] = 1
        return observed

    def row(self, labels: Tensor, index: int) -> Tensor:
        """float32 (C,): the observed labels of sample ``index`` whose full labels are ``labels`` (C,);
        ``labels`` itself under ``all``."""
        if not self.hides_labels:
            return labels
        observed = labels.numpy().copy()
        columns = np.flatnonzero(observed != -1)
        observed[columns] = self.observe(np.full(len(columns), index), columns, observed[columns])
        return torch.from_numpy(observed)


ALL_LABELS = ObservedLabels()


@dataclass(frozen=True)
class HoldoutSplit:
    """The share of the training split held out to select the best epoch (``dataset.val_fraction`` in
    [0, 1) of a dataset with a validation split of its own, ``val_by``, ``val_labels``: ``clean`` or as the
    regime shows them, ``val_seed``), checked by :func:`mlcls.data.views.training_policies`. ``hashed``:
    sample ``i`` is held out when the top 53 bits of a hash of ``(seed, i)`` fall below ``fraction``:
    independently, the same on every rank and resume; ``stratified``: by the labels
    (:func:`mlcls.data.views.split_holdout`)."""

    fraction: float = 0.0
    labels: str = "clean"
    seed: int = 0
    by: str = "hashed"

    def held_out(self, samples: np.ndarray) -> np.ndarray:
        """bool (K,): whether each sample index of ``samples`` is held out."""
        hashes = sample_hashes(self.seed, "holdout", samples)
        return (hashes >> np.uint64(64 - _UNIT_BITS)).astype(np.float64) < self.fraction * 2.0**_UNIT_BITS


NO_HOLDOUT = HoldoutSplit()
