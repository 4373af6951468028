"""Caption folders, as taggers are trained: a folder (searched recursively) of images, each with a caption
file beside it, ``0001.jpg`` + ``0001.txt`` holding ``1girl, long_hair, smile`` (docs/datasets.md,
"Caption folders").

A caption's tags are separated by ``tag_separator`` (or a line break) and stripped; a tag written twice
counts once. ``underscores=spaces`` writes ``long_hair`` as ``long hair`` (in the tag list too), ``keep``
leaves the tags as written. The vocabulary is ``classes`` (the model's, set by mlcls-eval), else the tag
list ``vocabulary`` (one tag a line, in its order; a listed tag no image has is kept), else the training
split's tags seen at least ``min_tag_count`` times, the ``max_tags`` most frequent of them (most frequent
first, ties by name). Tags outside it are counted and dropped, in one log line.

Validation: the second folder ``val_root``, else ``val_fraction`` of ``root`` held out ``val_by``
``stratified`` (:func:`~mlcls.data.datasets.folds.rarest_label_holdout`, on every tag of the folder) or
``hashed`` (:func:`~mlcls.data.datasets.folds.held_out`, by each image's path relative to ``root``).

Memory: the index opens no image and every caption file once, through :func:`mlcls.io.read_regular_bytes`
(at most ``CAPS["caption"]`` bytes); the labels stay sparse (:class:`SparseLabels`, 5 bytes a tag of an
image), the paths one byte string (:class:`FolderSamples`): nothing of size images x tags is allocated.
"""

from __future__ import annotations

import logging
import os
import re
import unicodedata
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlcls.data.datasets.base import (
    DatasetConfigError,
    DatasetFormatError,
    DatasetLayoutError,
    LazySamples,
    MultiLabelDataset,
    Sample,
    check_choice,
    check_setting,
    reading,
    resolve_path,
)
from mlcls.data.datasets.folds import DEFAULT_VAL_FRACTION, VAL_BY, hashed_holdout, rarest_label_holdout
from mlcls.data.datasets.labels import SparseLabelled, SparseLabels
from mlcls.data.images import IMAGE_EXTENSIONS
from mlcls.errors import is_integer, is_number, plural, printable, shown
from mlcls.io import CAPS, read_regular_bytes, read_text

log = logging.getLogger("mlcls")

SPLITS = ("train", "val")
UNDERSCORES = ("keep", "spaces")  # dataset.underscores: long_hair as written, or as "long hair"
UNCAPTIONED = ("skip", "error")  # dataset.uncaptioned: an image without a caption file
# Characters refused in a caption or a tag list: controls other than tab and line breaks (C0, DEL, C1).
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class FolderSamples(LazySamples):
    """The samples ``root/<relative path>`` of ``paths``, held as one byte string and its ends (int64):
    a path's bytes plus 8 instead of ~150 as a :class:`Sample` (a million images: ~80 MB instead of ~250)."""

    def __init__(self, root: str, paths: Sequence[str]) -> None:
        encoded = [os.fsencode(path) for path in paths]
        self.root, self.data = root, b"".join(encoded)
        self.ends = np.cumsum([len(path) for path in encoded], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ends)

    def relative(self, index: int) -> str:
        """The path of sample ``index`` relative to ``root``, as found."""
        start = int(self.ends[index - 1]) if index else 0
        return os.fsdecode(self.data[start : int(self.ends[index])])

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return Sample(os.path.join(self.root, self.relative(index % len(self))))

    def take(self, indices: np.ndarray) -> FolderSamples:
        """The samples ``indices``, in that order."""
        return FolderSamples(self.root, [self.relative(int(i)) for i in indices])


@dataclass
class CaptionIndex:
    """A caption folder as read: the captioned images (``samples``), and ``labels`` (N, T) over ``tags``,
    every distinct tag of its captions in order of first appearance (not yet a vocabulary)."""

    samples: FolderSamples
    labels: SparseLabels
    tags: list[str]


def normalise_tag(tag: str, underscores: str) -> str:
    """``tag`` stripped, with ``underscores=spaces`` its underscores as spaces."""
    tag = tag.strip()
    return tag.replace("_", " ").strip() if underscores == "spaces" else tag


def check_text(text: str, path: str | Path, expected: str) -> None:
    """One :class:`DatasetFormatError` line naming the first control character of ``text`` (read from
    ``path``): a tag holding one would reach logs, reports and caption files written back."""
    found = CONTROL.search(text)
    if found:
        line = text.count("\n", 0, found.start()) + 1
        name = unicodedata.name(found.group(), f"U+{ord(found.group()):04X}")
        raise DatasetFormatError(
            f"{path}, line {line}: control character {found.group()!r} ({name}); expected {expected}"
        )


def caption_tags(path: str, separator: str, underscores: str) -> list[str]:
    """The distinct tags of the caption file ``path``, in their order: UTF-8 text of at most
    ``CAPS["caption"]`` bytes read through the guarded door, split at ``separator`` and line breaks."""
    with reading(path):
        text = read_regular_bytes(path, CAPS["caption"], "caption file").decode("utf-8-sig")
    check_text(text, path, f"tags separated by {separator!r}")
    tags = (normalise_tag(tag, underscores) for line in text.splitlines() for tag in line.split(separator))
    return list(dict.fromkeys(tag for tag in tags if tag))


def index_folder(
    root: Path, caption_ext: str, separator: str, underscores: str, uncaptioned: str
) -> CaptionIndex:
    """Every image under ``root`` (:data:`IMAGE_EXTENSIONS`, recursively: a folder's files by name, then its
    subfolders by name; symbolic links to folders not followed) with a caption file ``<stem><caption_ext>``
    beside it, and its tags. An image without one is skipped (one log line) or, with
    ``uncaptioned=error``, one :class:`DatasetFormatError` line."""
    if not root.is_dir():
        raise DatasetLayoutError(f"missing {root}; expected a folder of images, each with its caption file")
    paths: list[str] = []
    missing, first_missing = 0, ""
    tag_ids: dict[str, int] = {}
    columns, offsets = array("i"), array("q", [0])
    for folder, subfolders, files in os.walk(root, onerror=_raise):
        subfolders.sort()
        present, prefix = set(files), os.path.relpath(folder, root)
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext.lower() not in IMAGE_EXTENSIONS:
                continue
            relative = name if prefix == "." else os.path.join(prefix, name)
            caption = stem + caption_ext
            if caption not in present:
                if uncaptioned == "error":
                    raise DatasetFormatError(
                        f"{os.path.join(folder, name)} has no caption file {caption}; expected one beside "
                        "each image (or dataset.uncaptioned=skip)"
                    )
                missing, first_missing = missing + 1, first_missing or relative
                continue
            tags = caption_tags(os.path.join(folder, caption), separator, underscores)
            row = sorted({tag_ids.setdefault(tag, len(tag_ids)) for tag in tags})
            columns.extend(row)
            offsets.append(len(columns))
            paths.append(relative)
    if missing:
        log.info(
            "%s: %s without a caption file skipped (e.g. %s)",
            root,
            plural(missing, "image"),
            printable(first_missing),
        )
    if not paths:
        raise DatasetFormatError(
            f"{root} holds no image with a caption file ({plural(missing, 'image')} without); expected "
            f"images ({', '.join(sorted(IMAGE_EXTENSIONS))}) each with <stem>{caption_ext} beside it"
        )
    offsets_array = np.frombuffer(offsets, dtype=np.int64).copy()
    columns_array = np.frombuffer(columns, dtype=np.int32).copy()
    labels = SparseLabels(
        offsets_array, columns_array, np.ones(len(columns_array), np.int8), len(tag_ids), fill=0
    )
    return CaptionIndex(FolderSamples(str(root), paths), labels, list(tag_ids))


def _raise(error: OSError) -> None:
    raise DatasetLayoutError(f"cannot list {error.filename}: {error.strerror}")


def read_vocabulary(path: Path, underscores: str) -> list[str]:
    """The tags of the tag list ``path``, one a line (blank lines skipped), in their order; one
    :class:`DatasetFormatError` line for a tag listed twice (as normalised), a control character or no tag."""
    with reading(path, "a tag list, one tag a line"):
        text = read_text(path, "class list")
    check_text(text.removeprefix("\ufeff"), path, "one tag a line")
    tags = [normalise_tag(line, underscores) for line in text.removeprefix("\ufeff").splitlines()]
    first: dict[str, int] = {}
    for number, tag in enumerate(tags, start=1):
        if tag and tag in first:
            raise DatasetFormatError(
                f"{path}, line {number}: tag {printable(tag)!r} is listed twice (first on line "
                f"{first[tag]}); expected each tag once"
            )
        first.setdefault(tag, number)
    first.pop("", None)
    if not first:
        raise DatasetFormatError(f"{path} lists no tag; expected one tag a line")
    return list(first)


def frequent_tags(counts: np.ndarray, tags: Sequence[str], min_count: int, max_tags: int | None) -> list[str]:
    """The ``tags`` whose ``counts`` are at least ``min_count``, the ``max_tags`` most frequent of them
    (None: all), most frequent first, ties by name."""
    kept = sorted((-int(counts[t]), tags[t]) for t in np.flatnonzero(counts >= min_count))
    return [name for _, name in kept[:max_tags]]


class CaptionFolder(SparseLabelled, MultiLabelDataset):
    """Images under ``root``, each with its caption file; the keys are ``configs/dataset/captions.yaml``'s
    (module docstring). Attributes: ``sparse_labels`` (N, C; 1 for a caption's tags, 0 elsewhere) and
    ``dropped`` (``{"tags": distinct, "uses": entries}`` of this split's tags outside the vocabulary)."""

    @classmethod
    def cuts_validation(cls, keys: Any) -> bool:
        """Without ``val_root`` the validation split is ``val_fraction`` of ``root``."""
        return not keys.get("val_root")

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        root: str = "data/captions",
        caption_ext: str = ".txt",
        tag_separator: str = ",",
        underscores: str = "keep",
        min_tag_count: int = 1,
        max_tags: int | None = None,
        vocabulary: str | None = None,
        classes: Sequence[str] | None = None,
        uncaptioned: str = "skip",
        val_root: str | None = None,
        val_fraction: float | None = None,
        val_by: str = "stratified",
        val_seed: int = 0,
        dense_labels_gb: float = 8.0,
        **config_keys: Any,
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = check_choice("captions split", split, SPLITS)
        check_setting("underscores", underscores, UNDERSCORES)
        check_setting("uncaptioned", uncaptioned, UNCAPTIONED)
        check_setting("val_by", val_by, VAL_BY)
        if not isinstance(caption_ext, str) or not caption_ext.startswith(".") or len(caption_ext) < 2:
            raise DatasetConfigError(f"dataset.caption_ext={shown(caption_ext)}; expected a suffix like .txt")
        if not isinstance(tag_separator, str) or not tag_separator or tag_separator.isspace():
            raise DatasetConfigError(
                f"dataset.tag_separator={shown(tag_separator)}; expected a character that is not a space, "
                "like ,"
            )
        if not is_integer(min_tag_count) or min_tag_count < 1:
            raise DatasetConfigError(
                f"dataset.min_tag_count={shown(min_tag_count)}; expected an integer >= 1"
            )
        if max_tags is not None and (not is_integer(max_tags) or max_tags < 1):
            raise DatasetConfigError(f"dataset.max_tags={shown(max_tags)}; expected an integer >= 1 or null")
        if vocabulary is not None and (min_tag_count != 1 or max_tags is not None):
            raise DatasetConfigError(
                "dataset.vocabulary gives the tags: dataset.min_tag_count and dataset.max_tags choose them "
                "from the captions; set one or the other"
            )
        val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
        if val_root is None and (not is_number(val_fraction) or not 0.0 <= val_fraction < 1.0):
            raise DatasetConfigError(
                f"dataset.val_fraction={shown(val_fraction)}; expected a number in [0, 1)"
            )
        if val_root is None and val_fraction == 0 and split == "val":
            raise DatasetConfigError(
                "the captions dataset has no validation data: set dataset.val_root or "
                "dataset.val_fraction > 0"
            )
        self.dense_labels_gb = float(dense_labels_gb)
        read = (caption_ext, tag_separator, underscores, uncaptioned)

        given = None
        if classes is not None:
            given = [normalise_tag(str(tag), underscores) for tag in classes]
        elif vocabulary is not None:
            given = read_vocabulary(resolve_path(root, vocabulary), underscores)
        folder = Path(val_root if split == "val" and val_root is not None else root).expanduser()
        index = index_folder(folder, *read)
        rows = np.arange(len(index.samples))
        if val_root is None and val_fraction > 0:
            in_val = _held_out(index, val_fraction, val_by, val_seed)
            rows = np.flatnonzero(in_val if split == "val" else ~in_val)
            if given is None:  # the vocabulary of the training rows
                counts = index.labels.rows(np.flatnonzero(~in_val)).count_per_class(1).numpy()
                given = frequent_tags(counts, index.tags, min_tag_count, max_tags)
        elif given is None:
            training = index if split == "train" else index_folder(Path(root).expanduser(), *read)
            counts = training.labels.count_per_class(1).numpy()
            given = frequent_tags(counts, training.tags, min_tag_count, max_tags)
        if not given:
            raise DatasetFormatError(
                f"{root}: the vocabulary has 0 tags (none of the training split's tags is seen "
                f"{min_tag_count}+ times); expected captions with tags, a lower dataset.min_tag_count or a "
                "tag list in dataset.vocabulary"
            )
        if len(rows) == 0:
            raise DatasetFormatError(f"{folder}: the {split} split is empty")
        self.classes = given
        self.sparse_labels, self.dropped = _in_vocabulary(index, rows, self.classes, self.described())
        self.samples = index.samples.take(rows) if len(rows) < len(index.samples) else index.samples


def _held_out(index: CaptionIndex, val_fraction: float, val_by: str, val_seed: int) -> np.ndarray:
    """bool (N,): the images of ``index`` held out for validation, as ``val_by`` says."""
    if val_by == "stratified":
        return rarest_label_holdout(index.labels, val_fraction, val_seed)
    samples = index.samples
    return hashed_holdout([samples.relative(i) for i in range(len(samples))], val_fraction, val_seed)


def _in_vocabulary(
    index: CaptionIndex, rows: np.ndarray, classes: list[str], described: str
) -> tuple[SparseLabels, dict[str, int]]:
    """The ``rows`` of ``index.labels`` over ``classes`` (int32 columns ascending within a row), and the
    count of the tags dropped; those logged in one line."""
    column_of = {tag: c for c, tag in enumerate(classes)}
    mapping = np.array([column_of.get(tag, -1) for tag in index.tags], dtype=np.int32)
    labels = index.labels.rows(rows) if len(rows) < len(index.labels) else index.labels
    columns = mapping[labels.columns] if len(labels.columns) else labels.columns
    kept = columns >= 0
    entry_rows = np.repeat(np.arange(len(labels), dtype=np.int32), np.diff(labels.offsets))[kept]
    order = np.lexsort((columns[kept], entry_rows))
    offsets = np.zeros(len(labels) + 1, dtype=np.int64)
    np.cumsum(np.bincount(entry_rows, minlength=len(labels)), out=offsets[1:])
    columns = columns[kept][order]
    outside = np.unique(labels.columns[~kept])
    dropped = {"tags": len(outside), "uses": int((~kept).sum())}
    if dropped["uses"]:
        examples = ", ".join(shown(index.tags[t]) for t in outside[:3])
        log.info(
            "%s: %s of %s outside the vocabulary of %s dropped (e.g. %s)",
            described,
            plural(dropped["uses"], "use"),
            plural(dropped["tags"], "tag"),
            plural(len(classes), "tag"),
            examples,
        )
    return SparseLabels(offsets, columns, np.ones(len(columns), np.int8), len(classes), fill=0), dropped
