"""The held-out share of a training split (``dataset.val_fraction``, ``val_by``, ``val_seed``): the rows held
out together by iterative stratification (:func:`stratified_holdout`; a caption folder's, too many classes for
it, by each row's rarest class: :func:`rarest_label_holdout`), or each row on its own by a hash of its image
path (:func:`held_out`, the validation split cut from a training file or folder). The other cuts of a
training split are views of it: the held-out selection split (:func:`mlcls.data.views.split_holdout`) and
the audit's folds
(:class:`mlcls.reporting.audit.FoldSplit`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from mlcls.data.datasets.base import DatasetConfigError
from mlcls.data.datasets.labels import SparseLabels

# dataset.val_by: how dataset.val_fraction of a training split is held out
VAL_BY = ("stratified", "hashed")
# The share of a training file or folder held out as the validation split when dataset.val_fraction is null.
DEFAULT_VAL_FRACTION = 0.1


def stratified_holdout(labels: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """bool (N,): the rows of ``labels`` (N, C; unknown counted negative) held out, ``ceil(val_fraction *
    N)`` by iterative stratification (``MultilabelStratifiedShuffleSplit`` seeded by ``seed`` >= 0), each
    class's positives shared in about that ratio. Then, rarest first, a class of 2+ positives and none held
    out gets its first training row (seeded order) whose other classes keep a training positive. One row
    is held out whole."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DatasetConfigError(f"dataset.val_seed={seed!r}; expected an integer >= 0")
    positive = labels == 1
    if len(labels) < 2:
        return np.ones(len(labels), dtype=bool)
    state = np.random.RandomState(np.random.SeedSequence(seed).generate_state(4))
    # imported here: iterative-stratification pulls in scikit-learn and SciPy (2.3 s of every mlcls
    # process's start on a 2-vCPU machine), which only this split needs
    from iterstrat.ml_stratifiers import MultilabelStratifiedShuffleSplit

    splitter = MultilabelStratifiedShuffleSplit(n_splits=1, test_size=val_fraction, random_state=state)
    # with a column of ones: the splitter takes two columns at least (a file of one class)
    targets = np.column_stack([positive, np.ones(len(labels), dtype=bool)])
    in_val = np.isin(np.arange(len(labels)), next(splitter.split(np.zeros(len(labels)), targets))[1])
    order = state.permutation(len(labels))
    for c in np.argsort(positive.sum(axis=0), kind="stable"):
        if positive[:, c].sum() < 2 or positive[in_val, c].any():
            continue
        train_positives = positive[~in_val].sum(axis=0)
        for row in order:
            if positive[row, c] and not in_val[row] and (train_positives[positive[row]] >= 2).all():
                in_val[row] = True
                break
    return in_val


def image_hash(image: str, seed: int) -> int:
    """The first 8 bytes of SHA-1(``"<seed>:<image>"``): a uniform 64-bit integer per (seed, image path)."""
    return int.from_bytes(hashlib.sha1(f"{seed}:{image}".encode()).digest()[:8], "big")


def hashed_holdout(images: Sequence[str], val_fraction: float, seed: int) -> np.ndarray:
    """bool (N,): the ``images`` (paths as written) held out by :func:`held_out`, each on its own; when the
    hash holds out none (a few images), the one of smallest hash, so that a split is never empty."""
    in_val = np.array([held_out(image, val_fraction, seed) for image in images], dtype=bool)
    if len(images) and not in_val.any():
        in_val[int(np.argmin([image_hash(image, seed) for image in images]))] = True
    return in_val


def held_out(image: str, val_fraction: float, seed: int) -> bool:
    """Whether ``image`` (its path as written) is held out: ``image_hash(image, seed) < val_fraction *
    2**64``, with probability ``val_fraction``, independently of every other row."""
    return image_hash(image, seed) < val_fraction * 2**64


def rarest_label_holdout(labels: SparseLabels, val_fraction: float, seed: int) -> np.ndarray:
    """bool (N,): about ``val_fraction * N`` rows of the sparse ``labels`` (N, C) held out, stratified by
    each row's rarest positive class, for label sets too large for :func:`stratified_holdout` (its time and
    memory grow with N x C).

    A row's group is its positive class of fewest positives (ties: the lower index); rows without a positive
    form the last group. The groups, rarest first, each in an order drawn from ``seed`` (>= 0), are laid end
    to end, and the row at position p is held out when ``floor(val_fraction * (p + 1) + 1/2) >
    floor(val_fraction * p + 1/2)``: every group holds out its share to within one row, and a class seen once
    stays in training more often than not. At least one row is held out (of two or more). Time and memory:
    O(N + stored entries)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DatasetConfigError(f"dataset.val_seed={seed!r}; expected an integer >= 0")
    rows, classes = labels.shape
    if rows < 2:
        return np.ones(rows, dtype=bool)
    positive = labels.values == 1
    entry_rows = np.repeat(np.arange(rows, dtype=np.int32), np.diff(labels.offsets))[positive]
    columns = labels.columns[positive]
    counts = np.bincount(columns, minlength=classes)
    group = np.full(rows, (int(counts.max(initial=0)) + 1) * classes, dtype=np.int64)  # after every class
    np.minimum.at(group, entry_rows, counts[columns] * classes + columns)
    drawn = np.random.default_rng(seed).permutation(rows)
    position = np.empty(rows, dtype=np.int64)
    position[np.lexsort((drawn, group))] = np.arange(rows)
    in_val = np.floor(val_fraction * (position + 1) + 0.5) > np.floor(val_fraction * position + 0.5)
    if not in_val.any():
        in_val[position == rows - 1] = True
    return in_val
