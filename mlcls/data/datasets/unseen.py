"""The zero-shot training policy (``dataset.unseen_classes``): the training split seen through its seen
classes only.

The classes ``dataset.unseen_classes`` names (a list, or a file of names one a line) are taken out of
the training split's class list and label columns (:class:`SeenClasses`): the model is built on the seen
classes, and no target it trains on holds an unseen column. The images stay as they are -- an image
showing an unseen class still shows it, unlabelled, as in the zero-shot protocol of LESA (Huynh & Elhamifar,
CVPR 2020) and ML-Decoder. Evaluation reads the validation split whole, every class
(:mod:`mlcls.engine.evaluate` scores the unseen classes from their text embeddings).
:func:`mlcls.data.apply_training_policies` applies the policy, before the observed-label regime, which then
draws over the seen columns only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from mlcls.data.datasets.base import DatasetConfigError, MultiLabelDataset
from mlcls.data.datasets.labels import LabelCounts, label_counts
from mlcls.errors import shown
from mlcls.io import read_text

# Unknown names quoted in a message (the rest counted).
SHOWN_NAMES = 5


def check_unseen_setting(value: Any) -> None:
    """One :class:`DatasetConfigError` line unless ``dataset.unseen_classes`` is null, a list of non-empty
    strings, or a non-empty string (the path of a file of names). Nothing is read."""
    if value is None or (isinstance(value, str) and value):
        return
    if isinstance(value, Sequence) and all(isinstance(name, str) and name for name in value):
        return
    raise DatasetConfigError(
        f"dataset.unseen_classes={shown(value)}; expected null, a list of class names, or the path of a "
        "file of class names (one a line)"
    )


def unseen_class_names(value: str | Sequence[str], classes: Sequence[str]) -> list[str]:
    """The class names of ``dataset.unseen_classes`` (``value``: a list of names, or the path of a UTF-8
    file of names, one a line, blank lines skipped, read through :func:`mlcls.io.read_text` under
    ``CAPS["class list"]``), distinct, in the order of ``classes`` (the dataset's).

    One :class:`DatasetConfigError` line naming the names ``classes`` lacks (the first
    :data:`SHOWN_NAMES`, control characters shown escaped, and their count), or when no class would be
    left to train on."""
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
        listed = ", ".join(shown(name) for name in unknown[:SHOWN_NAMES])
        more = f" and {len(unknown) - SHOWN_NAMES} more" if len(unknown) > SHOWN_NAMES else ""
        raise DatasetConfigError(
            f"dataset.unseen_classes names {len(unknown)} unknown class name(s): {listed}{more}; expected"
            f" names among its {len(classes)} classes (e.g. {shown(classes[0]) if classes else '-'})"
        )
    unseen = set(value)
    if len(unseen) == len(classes):
        raise DatasetConfigError(
            f"dataset.unseen_classes names all {len(classes)} classes of the dataset; expected some seen "
            "classes left to train on"
        )
    return [name for name in classes if name in unseen]


class SeenClasses(MultiLabelDataset):
    """The dataset ``source`` (a training split) restricted to the classes not in ``unseen``: ``classes``
    the seen names in ``source``'s order, ``labels`` and every target the seen columns alone. Sample ``i``
    is ``source``'s sample ``i`` (same image, read with this view's ``transform``); its target is
    ``source``'s full row, restricted, then shown by this view's observed-label regime ``observed``."""

    def __init__(self, source: MultiLabelDataset, unseen: Sequence[str]) -> None:
        # The source's settings, checked when it was built; nothing of the config is read again.
        self.source = source
        self.unseen_classes = list(unseen)
        dropped = set(unseen)
        columns = [c for c, name in enumerate(source.classes) if name not in dropped]
        self.columns = torch.tensor(columns, dtype=torch.long)
        self.name, self.image_size = source.name, source.image_size
        self.split = getattr(source, "split", source.train_split)
        self.train_split, self.val_split = source.train_split, source.val_split
        self.transform, self.on_bad_image = source.transform, source.on_bad_image
        self.observed, self.selection_split = source.observed, source.selection_split
        self.classes = [source.classes[c] for c in columns]
        self.samples = source.samples

    @property
    def labels(self) -> Tensor:  # type: ignore[override]
        """float32 (N, C_seen): the source's labels of the seen classes."""
        return self.source.labels[:, self.columns]

    def label_counts(self) -> LabelCounts:
        """The counts of the targets: the source's counts of the seen columns (sparse labels stay sparse);
        under a regime that hides labels, counted from the restricted labels as that regime shows them."""
        if self.observed.hides_labels:
            return label_counts(_DenseLabels(self.labels, self.observed))
        counts = label_counts(self.source)
        return LabelCounts(counts.num_samples, counts.positives[self.columns], counts.negatives[self.columns])

    def load_image(self, index: int) -> Image.Image:
        """Sample ``index``'s image: read as the base class reads a file, with this view's ``transform``
        (its ``decode`` where the fast pipeline has one), or by ``source`` when it draws its images itself
        (the synthetic dataset)."""
        if type(self.source).load_image is MultiLabelDataset.load_image:
            return MultiLabelDataset.load_image(self, index)
        return self.source.load_image(index)

    def target(self, index: int) -> Tensor:
        """float32 (C_seen,): sample ``index``'s labels of the seen classes as ``observed`` shows them."""
        return self.observed.row(self.source.target(index)[self.columns], index)


class _DenseLabels:
    """A dense label matrix with an observed-label regime, as :func:`label_counts` reads one."""

    def __init__(self, labels: Tensor, observed: Any) -> None:
        self.labels, self.observed = labels, observed


def seen_view(dataset: MultiLabelDataset, value: str | Sequence[str] | None) -> MultiLabelDataset:
    """``dataset`` as :class:`SeenClasses` without the classes ``value`` names (:func:`unseen_class_names`);
    ``dataset`` itself when ``value`` is null or empty. Applied before a regime is set: the source keeps
    every label, the view's regime draws over the seen columns."""
    if value is None or (not isinstance(value, str) and len(value) == 0):
        return dataset
    return SeenClasses(dataset, unseen_class_names(value, dataset.classes))


__all__ = ["SeenClasses", "check_unseen_setting", "seen_view", "unseen_class_names"]
