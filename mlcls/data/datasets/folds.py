"""Cuts of a dataset's training split: one fold of a K-fold cut (``mlcls-data audit``), the held-out
selection split (``dataset.holdout_fraction``), and the CSV dataset's validation split of its training
file (``dataset.val_by``: :func:`stratified_holdout` or :func:`held_out`; see
:mod:`mlcls.data.datasets.csv_dataset`).

The K-fold cut: a config naming :class:`FoldSplit` instantiates like any dataset config (``build_dataset``),
so that a training run trains on the K-1 folds and evaluates on the one held out, each image scored by a
model that never saw it.

The held-out selection split is a share of the training split kept out of training to select the best
epoch, as the single-positive benchmark's released code holds out 20 % (:func:`split_holdout`). Both sides
read the training split's images and labels by its own sample index: the observed-label regime shows each
training sample the labels it shows it without the cut, and a loss with a row per training sample indexes
the training view's rows ``0 .. len - 1``. The held-out side's targets are the full labels (``clean``) or
the regime's observed labels (``observed``, unknown entries -1, which the metrics leave out).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mlcls.data import DatasetView, TrainingView, build_dataset
from mlcls.data.datasets.base import DatasetConfigError, MultiLabelDataset, check_choice
from mlcls.data.datasets.observed import ALL_LABELS, NO_HOLDOUT

SPLITS = ("train", "heldout")


def fold_rows(num_rows: int, folds: int, fold: int, seed: int) -> np.ndarray:
    """The rows (ascending) of fold ``fold`` of ``folds`` over ``num_rows`` rows: the positions ``p`` of the
    permutation of ``range(num_rows)`` drawn from ``seed`` with ``p mod folds == fold`` (so that fold sizes
    differ by at most one)."""
    order = np.random.default_rng(seed).permutation(num_rows)
    return np.sort(order[fold::folds])


def indexed_training_split(cfg: DictConfig) -> TrainingView:
    """The training split of the dataset config ``cfg`` (its training view), read by index; packed shards,
    read in sequence, raise :class:`DatasetConfigError` naming the way out (the config they were packed
    from)."""
    dataset = build_dataset(cfg, train=True)
    if not isinstance(dataset.source, MultiLabelDataset):
        raise DatasetConfigError(
            f"the training split of {cfg.get('name', 'this dataset')} is read in sequence (packed shards), "
            "not by index; audit the dataset config the shards were packed from"
        )
    return dataset


class FoldSplit(DatasetView):
    """Fold ``fold`` of ``folds`` of the training split of ``source`` (``heldout``), or the other folds
    (``train``), as a :class:`~mlcls.data.DatasetView` of its training view: training targets as the
    source's observed-label regime (``dataset.observed``) shows them, held-out targets the full labels.
    Images are read by the source with this dataset's ``transform``.

    Args:
        split: ``"train"`` or ``"heldout"``.
        source: the dataset config (mapping) whose training split is cut.
        folds: the number of folds, at least 2.
        fold: the fold held out, in ``[0, folds)``.
        seed: the seed of the cut (:func:`fold_rows`).
    """

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        source: Mapping[str, Any] | None = None,
        folds: int = 5,
        fold: int = 0,
        seed: int = 0,
        **config_keys: Any,
    ) -> None:
        MultiLabelDataset.__init__(self, transform, **config_keys)
        self.split = check_choice("fold split", split, SPLITS)
        if source is None:
            raise DatasetConfigError(
                "a fold split needs source, the dataset config whose training split it cuts"
            )
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
            raise DatasetConfigError(f"folds={folds!r}; expected an integer >= 2")
        if isinstance(fold, bool) or not isinstance(fold, int) or not 0 <= fold < folds:
            raise DatasetConfigError(f"fold={fold!r}; expected an integer from 0 to {folds - 1}")
        source_cfg = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(source), resolve=True))
        training = indexed_training_split(source_cfg)
        training.transform = self.transform  # the source reads; this split's transform applies
        if len(training) < folds:
            raise DatasetConfigError(
                f"the training split has {len(training)} samples, fewer than folds={folds}"
            )
        held = fold_rows(len(training), folds, fold, seed)
        if split == "heldout":
            self.select(TrainingView(training.source, ALL_LABELS, NO_HOLDOUT), held)
        else:
            self.select(training, np.setdiff1d(np.arange(len(training)), held))


def split_holdout(
    train_set: TrainingView, eval_transform: Callable | None
) -> tuple[DatasetView, DatasetView]:
    """``(training, held out)``: the samples of ``train_set`` its ``selection_split`` keeps for training and
    those it holds out (:meth:`HoldoutSplit.held_out`: a pure function of ``dataset.holdout_seed`` and the
    sample index, the same on every rank). The held-out view reads through a shallow copy of
    ``train_set``'s dataset (the parsed annotations shared, nothing read twice) with ``eval_transform`` (the
    validation split's) and, for ``holdout_labels=clean``, every label. A cut that leaves either side empty
    raises :class:`DatasetConfigError`."""
    selection = train_set.selection_split
    held = selection.held_out(np.arange(len(train_set)))
    if not 0 < held.sum() < len(held):
        raise DatasetConfigError(
            f"dataset.holdout_fraction={selection.fraction:g} holds out {int(held.sum())} of the "
            f"{len(held)} training samples; expected some on each side (set a fraction that leaves both "
            "non-empty, or 0 for no held-out split)"
        )
    reader = copy.copy(train_set.source)
    reader.transform = eval_transform
    observed = ALL_LABELS if selection.labels == "clean" else train_set.observed
    reader = TrainingView(reader, observed, NO_HOLDOUT)
    return DatasetView(train_set, np.flatnonzero(~held)), DatasetView(reader, np.flatnonzero(held))


def stratified_holdout(labels: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask (N,) of the rows of ``labels`` (N, C; 1 / 0 / -1, unknown counted as negative) held
    out for validation: ``ceil(val_fraction * N)`` rows chosen by iterative stratification
    (``MultilabelStratifiedShuffleSplit`` seeded by ``seed``, any integer >= 0), each class's positives
    shared between the sides in about the ratio ``val_fraction``. Then, rarest class first, a class with at
    least 2 positives and none held out gets one: the first of its training rows (in the seeded order)
    whose other classes keep a training positive. A file of one row is held out whole."""
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


def held_out(image: str, val_fraction: float, seed: int) -> bool:
    """Whether ``image`` (its path as written in the CSV file) is held out for validation:
    ``image_hash(image, seed) < val_fraction * 2**64``. Each image is held out with probability
    ``val_fraction``, independently of every other row of the file."""
    return image_hash(image, seed) < val_fraction * 2**64
