"""Cuts of a training split: a fold of a K-fold cut (:class:`FoldSplit`, ``mlcls-data audit``: each image
scored by a model that never saw it), the held-out selection split (``dataset.holdout_fraction``,
:func:`split_holdout`, as the single-positive benchmark's code holds out 20 %), and the CSV dataset's
validation share of its training file (:func:`stratified_holdout`, :func:`held_out`).

Both sides read the training split by its own sample index, so the observed-label regime shows each sample
the labels it shows it uncut. The held-out side's targets are the full labels (``clean``) or the regime's
(``observed``; unknown entries, -1, are left out of the metrics).
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
    """The rows (ascending) of fold ``fold`` of ``folds``: positions ``p`` of a permutation of
    ``range(num_rows)`` drawn from ``seed`` with ``p mod folds == fold`` (sizes differ by one at most)."""
    order = np.random.default_rng(seed).permutation(num_rows)
    return np.sort(order[fold::folds])


def indexed_training_split(cfg: DictConfig) -> TrainingView:
    """The training view of the dataset config ``cfg``; :class:`DatasetConfigError` for packed shards (read
    in sequence, not by index)."""
    dataset = build_dataset(cfg, train=True)
    if not isinstance(dataset.source, MultiLabelDataset):
        raise DatasetConfigError(
            f"the training split of {cfg.get('name', 'this dataset')} is read in sequence (packed shards), "
            "not by index; audit the dataset config the shards were packed from"
        )
    return dataset


class FoldSplit(DatasetView):
    """Fold ``fold`` of ``folds`` (>= 2) of the training split of the dataset config ``source``
    (``heldout``: full labels), or the other folds (``train``: as its regime shows them), read by the source
    with this dataset's ``transform``; ``seed``: the cut's (:func:`fold_rows`)."""

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
    """``(training, held out)`` views of ``train_set`` cut by its ``selection_split`` (the same on every
    rank). The held-out view reads a shallow copy of the source (annotations shared) with
    ``eval_transform`` and, for ``holdout_labels=clean``, every label. An empty side raises
    :class:`DatasetConfigError`."""
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


def held_out(image: str, val_fraction: float, seed: int) -> bool:
    """Whether ``image`` (its path as written) is held out: ``image_hash(image, seed) < val_fraction *
    2**64``, with probability ``val_fraction``, independently of every other row."""
    return image_hash(image, seed) < val_fraction * 2**64
