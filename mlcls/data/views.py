"""How training reads its split: the policies of a dataset config (:data:`POLICY_KEYS`, checked once by
:func:`training_policies`) wrap the training split in one place (:func:`apply_training_policies`): the
zero-shot restriction to the seen classes (:func:`seen_view`), then the observed-label regime and the
held-out selection split (:class:`TrainingView`), which :func:`split_holdout` cuts into two
:class:`DatasetView`. Every view reads its source by sample index, so the regime shows each sample the
labels it shows it uncut.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset, Subset

from mlcls.data.datasets.base import (
    DatasetConfigError,
    LazySamples,
    MultiLabelDataset,
    Sample,
    check_integer,
    check_setting,
)
from mlcls.data.datasets.folds import VAL_BY, rarest_label_holdout, stratified_holdout
from mlcls.data.datasets.labels import (
    LabelCounts,
    SparseLabelled,
    label_counts,
    observed_counts,
    sparse_labels_of,
)
from mlcls.data.datasets.observed import (
    ALL_LABELS,
    HOLDOUT_LABELS,
    NO_HOLDOUT,
    OBSERVED_REGIMES,
    HoldoutSplit,
    ObservedLabels,
)
from mlcls.errors import listed, shown
from mlcls.io import read_text

MAX_SEED = 2**63 - 1


def training_policies(
    observed: str = "all",
    observed_seed: int = 0,
    observed_fraction: float = 1.0,
    val_fraction: float | None = None,
    val_by: str = "hashed",
    val_seed: int = 0,
    val_labels: str = "clean",
    unseen_classes: Any = None,
    unseen_images: str = "keep",
) -> tuple[ObservedLabels, HoldoutSplit]:
    """The observed-label regime and the held-out selection split of the keys :data:`POLICY_KEYS`, each
    checked here, once (``unseen_classes``' names against the classes in :func:`apply_training_policies`).
    ``val_fraction`` None is none held out; a dataset that cuts its validation split from its training file
    takes the ``val_*`` keys itself (:func:`mlcls.data.build_dataset`), and they select nothing here."""
    check_unseen_setting(unseen_classes)
    check_setting("unseen_images", unseen_images, UNSEEN_IMAGES)
    check_setting("observed", observed, OBSERVED_REGIMES)
    fraction = observed_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise DatasetConfigError(
            f"dataset.observed_fraction={shown(fraction)}; expected a number in (0, 1], the share of the "
            "training labels kept by dataset.observed=partial"
        )
    seed = check_integer("observed_seed", observed_seed, 0, MAX_SEED)
    regime = ObservedLabels(observed, seed, float(fraction))
    fraction = 0.0 if val_fraction is None else val_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction < 1:
        raise DatasetConfigError(
            f"dataset.val_fraction={shown(fraction)}; expected a number in [0, 1), the share of the "
            "training split held out (0 or null: none)"
        )
    check_setting("val_by", val_by, VAL_BY)
    check_setting("val_labels", val_labels, HOLDOUT_LABELS)
    seed = check_integer("val_seed", val_seed, 0, MAX_SEED)
    return regime, HoldoutSplit(float(fraction), val_labels, seed, val_by)


# The keys of a dataset config that choose training policies (:func:`apply_training_policies`), not data.
POLICY_KEYS = tuple(inspect.signature(training_policies).parameters)
# The keys of the held-out share that a dataset cutting its validation split from its training file takes.
CUT_KEYS = ("val_fraction", "val_by", "val_seed")


def apply_training_policies(dataset: Any, **policy_keys: Any) -> TrainingView:
    """The training split ``dataset`` in a :class:`TrainingView` of the policies ``policy_keys``
    (:data:`POLICY_KEYS`), over :func:`seen_view` of it for ``unseen_classes`` (so that the regime draws
    over the seen columns only). One :class:`DatasetConfigError` line for a regime that hides labels of a
    split that is also ``dataset.val_split``, or a held-out split or unseen classes of packed shards."""
    regime, selection = training_policies(**policy_keys)
    unseen = policy_keys.get("unseen_classes")
    if regime.hides_labels and dataset.train_split == dataset.val_split:
        raise DatasetConfigError(
            f"dataset.observed={regime.regime} hides labels of the training split {dataset.train_split!r}, "
            "which is also dataset.val_split, and evaluation reads the full labels; evaluate on another "
            "split or set dataset.observed=all"
        )
    if selection.fraction and not isinstance(dataset, MultiLabelDataset):
        raise DatasetConfigError(
            f"dataset.val_fraction={selection.fraction:g}: packed shards are read in sequence, not by "
            "sample index, so no share of them can be held out; train on the dataset config the shards were "
            "packed from, or set dataset.val_fraction=0"
        )
    if unseen and not isinstance(dataset, MultiLabelDataset):
        raise DatasetConfigError(
            "dataset.unseen_classes: packed shards are read in sequence, not by sample index, so their label "
            "columns cannot be restricted; train on the dataset config the shards were packed from"
        )
    dataset = seen_view(dataset, unseen, policy_keys.get("unseen_images", "keep") == "drop")
    return TrainingView(dataset, regime, selection)


class TrainingView(Dataset):
    """The training split ``source`` as training reads it: targets as the regime ``observed`` shows them,
    their counts, and ``selection_split`` (cut by :func:`split_holdout`). Every
    other attribute, ``transform`` included, is ``source``'s."""

    def __init__(self, source: Any, observed: ObservedLabels, selection_split: HoldoutSplit) -> None:
        self.source, self.observed, self.selection_split = source, observed, selection_split

    def __getattr__(self, name: str) -> Any:
        # Called only for names the view lacks; never for its own (nor while unpickling, before it has them).
        if name.startswith("__") or name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)

    @property
    def transform(self) -> Any:
        return self.source.transform

    @transform.setter
    def transform(self, transform: Any) -> None:
        self.source.transform = transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[Any, Tensor]:
        image, served = self.source.read_sample(index, self.source.transformed_image)
        return image, self.target(served)

    def target(self, index: int) -> Tensor:
        """float32 (C,): sample ``index``'s label row as the regime ``observed`` shows it."""
        return self.observed.row(self.source.target(index), index)

    def make_sample(self, key: str, fields: dict[str, bytes], seed: int) -> tuple[Any, Tensor]:
        """Packed shards: ``source``'s ``(image, labels row)`` of sample ``key``, the row as the regime shows
        the sample of that index in the packed split."""
        image, labels = self.source.make_sample(key, fields, seed)
        return image, self.observed.row(labels, int(key))

    def label_counts(self) -> LabelCounts:
        """The counts of the targets: the regime's draws from ``source``'s labels, kept sparse."""
        if not self.observed.hides_labels:
            return label_counts(self.source)
        samples = self.source.sample_indices() if isinstance(self.source, SparseLabelled) else None
        return observed_counts(sparse_labels_of(self.source), self.observed, samples)


def split_holdout(
    train_set: TrainingView, eval_transform: Callable | None
) -> tuple[DatasetView, DatasetView]:
    """``(training, held out)`` views of ``train_set`` cut by its ``selection_split`` (the same on every
    rank). The held-out view reads a shallow copy of the source (annotations shared) with
    ``eval_transform`` and, for ``val_labels=clean``, every label. An empty side raises
    :class:`DatasetConfigError`."""
    selection = train_set.selection_split
    if selection.by == "stratified":
        sparse = sparse_labels_of(train_set.source)  # the source's own labels: only the positives count
        if isinstance(train_set.source, SparseLabelled):  # too many classes to stratify (caption folders)
            held = rarest_label_holdout(sparse, selection.fraction, selection.seed)
        else:
            positives = np.zeros(sparse.shape, dtype=np.int8)
            rows = np.repeat(np.arange(len(sparse)), np.diff(sparse.offsets))
            positives[rows, sparse.columns] = sparse.values
            held = stratified_holdout(positives, selection.fraction, selection.seed)
    else:
        held = selection.held_out(np.arange(len(train_set)))
    if not 0 < held.sum() < len(held):
        raise DatasetConfigError(
            f"dataset.val_fraction={selection.fraction:g} holds out {int(held.sum())} of the "
            f"{len(held)} training samples; expected some on each side (set a fraction that leaves both "
            "non-empty, or 0 for no held-out split)"
        )
    reader = copy.copy(train_set.source)
    reader.transform = eval_transform
    observed = ALL_LABELS if selection.labels == "clean" else train_set.observed
    reader = TrainingView(reader, observed, NO_HOLDOUT)
    return DatasetView(train_set, np.flatnonzero(~held)), DatasetView(reader, np.flatnonzero(held))


# ---- Zero-shot (dataset.unseen_classes): the training split without the unseen classes' columns; its images
# still show them, unlabelled, as in LESA's protocol (Huynh & Elhamifar, CVPR 2020) and ML-Decoder's.
# Evaluation reads every class (mlcls.engine.evaluate scores the unseen ones from their text embeddings).

# Unknown names quoted in a message (the rest counted).
SHOWN_NAMES = 5
# dataset.unseen_images: the training images showing an unseen class are kept (their unseen labels alone
# removed: LESA's NUS-WIDE protocol) or dropped (no training image shows an unseen class).
UNSEEN_IMAGES = ("keep", "drop")


def check_unseen_setting(value: Any) -> None:
    """One :class:`DatasetConfigError` line unless ``dataset.unseen_classes`` is null, a list of non-empty
    strings, or a non-empty string (a file of names, not read here)."""
    if value is None or (isinstance(value, str) and value):
        return
    if isinstance(value, Sequence) and all(isinstance(name, str) and name for name in value):
        return
    raise DatasetConfigError(
        f"dataset.unseen_classes={shown(value)}; expected null, a list of class names, or the path of a "
        "file of class names (one a line)"
    )


def unseen_class_names(value: str | Sequence[str], classes: Sequence[str]) -> list[str]:
    """The distinct names of ``dataset.unseen_classes`` (a list, or a UTF-8 file of names one a line under
    ``CAPS["class list"]``) in the order of ``classes``. One :class:`DatasetConfigError` line naming the
    names ``classes`` lacks (the first :data:`SHOWN_NAMES`, and their count), or when no class is left."""
    check_unseen_setting(value)
    if isinstance(value, str):
        try:
            text = read_text(Path(value).expanduser(), "class list")
        except (OSError, ValueError) as exc:  # missing, not a regular file, too large, not UTF-8
            raise DatasetConfigError(f"dataset.unseen_classes={shown(value)}: {exc}") from None
        value = [line.strip() for line in text.splitlines() if line.strip()]
    value = list(value)
    known = set(classes)
    unknown = list(dict.fromkeys(name for name in value if name not in known))
    if unknown:
        raise DatasetConfigError(
            f"dataset.unseen_classes names {len(unknown)} unknown class name(s): "
            f"{listed(unknown, SHOWN_NAMES)}; expected"
            f" names among its {len(classes)} classes (e.g. {shown(classes[0]) if classes else '-'})"
        )
    unseen = set(value)
    if len(unseen) == len(classes):
        raise DatasetConfigError(
            f"dataset.unseen_classes names all {len(classes)} classes of the dataset; expected some seen "
            "classes left to train on"
        )
    return [name for name in classes if name in unseen]


class RowSamples(LazySamples):
    """The :class:`Sample` of rows ``rows`` of ``samples``, made on access (no copy of the list)."""

    def __init__(self, samples: Sequence[Sample], rows: np.ndarray) -> None:
        self.source_samples, self.rows = samples, rows

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]
        return self.source_samples[int(self.rows[index])]

    def __len__(self) -> int:
        return len(self.rows)


class DatasetView(MultiLabelDataset):
    """The rows ``rows`` (int64 sample indices; None: all) and the classes ``columns`` (None: all) of the
    dataset or view ``source``, its targets ``source``'s (as a :class:`TrainingView`'s regime shows them).
    Unreadable images are skipped within the view (``on_bad_image=skip``)."""

    def __init__(
        self, source: Any, rows: np.ndarray | None = None, columns: Sequence[int] | None = None
    ) -> None:
        # The source's settings, checked when it was built; nothing of the config is read again.
        self.name, self.split = source.name, getattr(source, "split", source.train_split)
        self.train_split, self.val_split = source.train_split, source.val_split
        self.transform, self.on_bad_image = source.transform, source.on_bad_image
        self.select(source, rows, columns)

    def select(self, source: Any, rows: np.ndarray | None, columns: Sequence[int] | None = None) -> None:
        """View the ``rows`` and ``columns`` of ``source`` (the settings are set apart)."""
        self.source, self.rows = source, rows
        self.columns = None if columns is None else torch.as_tensor(columns, dtype=torch.long)
        self.classes = [source.classes[c] for c in columns] if columns is not None else list(source.classes)
        self.samples = source.samples if rows is None else RowSamples(source.samples, rows)

    def _source_index(self, index: int) -> int:
        return index if self.rows is None else int(self.rows[index])

    @property
    def labels(self) -> Tensor:  # type: ignore[override]
        """float32 (n, C): the source's full labels of the rows and columns."""
        labels = self.source.labels if self.rows is None else self.source.labels[torch.from_numpy(self.rows)]
        return labels if self.columns is None else labels[:, self.columns]

    def label_counts(self) -> LabelCounts:
        """The counts of the targets, of the rows (as the source's regime shows them) and columns."""
        counts = label_counts(self.source if self.rows is None else Subset(self.source, self.rows))
        if self.columns is None:
            return counts
        return LabelCounts(counts.num_samples, counts.positives[self.columns], counts.negatives[self.columns])

    @property
    def reads_files(self) -> bool:  # type: ignore[override]
        """The source's: the view reads its files, with its own ``transform``, unless drawn."""
        return self.source.reads_files

    def picture(self, index: int) -> Image.Image:
        return self.source.picture(self._source_index(index))

    def target(self, index: int) -> Tensor:
        """float32 (C_view,): ``source``'s target of sample ``rows[index]``, its ``columns``."""
        row = self.source.target(self._source_index(index))
        return row if self.columns is None else row[self.columns]


def seen_view(
    dataset: MultiLabelDataset, value: str | Sequence[str] | None, drop_images: bool = False
) -> MultiLabelDataset:
    """``dataset`` as a :class:`DatasetView` without the classes ``value`` names and, with ``drop_images``
    (``dataset.unseen_images=drop``), the samples where one is positive (one :class:`DatasetConfigError` line
    when none is left); ``dataset`` itself when ``value`` is null or empty."""
    if value is None or (not isinstance(value, str) and len(value) == 0):
        return dataset
    unseen = set(unseen_class_names(value, dataset.classes))
    seen = [c for c, name in enumerate(dataset.classes) if name not in unseen]
    if not drop_images:
        return DatasetView(dataset, None, seen)
    columns = [c for c, name in enumerate(dataset.classes) if name in unseen]
    rows = torch.nonzero(~(dataset.labels[:, columns] == 1).any(1)).flatten().numpy()
    if len(rows) == 0:
        raise DatasetConfigError(
            f"dataset.unseen_images=drop: each of the {len(dataset)} training samples shows an unseen class; "
            "expected some without (or dataset.unseen_images=keep)"
        )
    return DatasetView(dataset, rows, seen)
