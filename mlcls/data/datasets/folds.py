"""One fold of a K-fold cut of a dataset's training split, as a dataset (``mlcls-data audit``).

The training split of the dataset config ``source`` is cut into ``folds`` folds by a seeded permutation of
its rows (:func:`fold_rows`: row ``i`` of the permutation goes to fold ``i mod folds``, so that fold sizes
differ by at most one). :class:`FoldSplit` serves split ``train`` (every fold but ``fold``: what a model is
trained on) or ``heldout`` (fold ``fold``: what it is scored on). A config naming it instantiates like any
dataset config (``build_dataset``), so that a training run trains on the K-1 folds and evaluates on the one
held out, each image scored by a model that never saw it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mlcls.data import build_dataset
from mlcls.data.datasets.base import DatasetConfigError, MultiLabelDataset, check_choice

SPLITS = ("train", "heldout")


def fold_rows(num_rows: int, folds: int, fold: int, seed: int) -> np.ndarray:
    """The rows (ascending) of fold ``fold`` of ``folds`` over ``num_rows`` rows: the positions ``p`` of the
    permutation of ``range(num_rows)`` drawn from ``seed`` with ``p mod folds == fold``."""
    order = np.random.default_rng(seed).permutation(num_rows)
    return np.sort(order[fold::folds])


def indexed_training_split(cfg: DictConfig) -> MultiLabelDataset:
    """The training split of the dataset config ``cfg``, read by index; packed shards, read in sequence,
    raise :class:`DatasetConfigError` naming the way out (the config they were packed from)."""
    dataset = build_dataset(cfg, train=True)
    if not isinstance(dataset, MultiLabelDataset):
        raise DatasetConfigError(
            f"the training split of {cfg.get('name', 'this dataset')} is read in sequence (packed shards), "
            "not by index; audit the dataset config the shards were packed from"
        )
    return dataset


class FoldSplit(MultiLabelDataset):
    """Fold ``fold`` of ``folds`` of the training split of ``source`` (``heldout``), or the other folds
    (``train``).

    Training targets are the source's, as its observed-label regime (``dataset.observed``) shows them;
    held-out targets are the full labels. ``classes``, ``labels`` and ``samples`` are the source rows';
    images are read by the source (:meth:`load_image`) with this dataset's ``transform``.

    Args:
        split: ``"train"`` or ``"heldout"``.
        transform: a callable (what ``build_dataset`` passes) or a transform name.
        source: the dataset config (mapping) whose training split is cut.
        folds: the number of folds, at least 2.
        fold: the fold held out, in ``[0, folds)``.
        seed: the seed of the cut (:func:`fold_rows`).
        **config_keys: ``name``, ``image_size``, ... (see :class:`MultiLabelDataset`).
    """

    def __init__(
        self,
        split: str = "train",
        transform: Callable | str | None = None,
        source: Mapping[str, Any] | None = None,
        folds: int = 5,
        fold: int = 0,
        seed: int = 0,
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, split=split, **config_keys)
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
        self.source = indexed_training_split(source_cfg)
        self.source.transform = self.transform  # the source reads; this split's transform applies
        if len(self.source) < folds:
            raise DatasetConfigError(
                f"the training split has {len(self.source)} samples, fewer than folds={folds}"
            )
        held = fold_rows(len(self.source), folds, fold, seed)
        if split == "heldout":
            self.rows = held
        else:
            self.rows = np.setdiff1d(np.arange(len(self.source)), held)
        self.classes = list(self.source.classes)
        self.labels = self.source.labels[torch.from_numpy(self.rows)]
        self.samples = [self.source.samples[int(row)] for row in self.rows]

    def load_image(self, index: int) -> Any:
        """The source's image of row ``rows[index]``."""
        return self.source.load_image(int(self.rows[index]))

    def target(self, index: int) -> torch.Tensor:
        """The source's training target of row ``rows[index]`` (split ``train``), or its full labels."""
        if self.split == "train":
            return self.source.target(int(self.rows[index]))
        return super().target(index)
