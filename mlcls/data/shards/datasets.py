"""Training and evaluation from packed shards (``dataset=shards``), as ``mlcls-data pack`` writes them.

**Training** (:class:`ShardTrainSet`): every epoch the shards are put in an order drawn from ``seed +
epoch``; their concatenation, ``N`` samples, is cut into contiguous ranges of ``per_rank = floor(N /
(world_size * batch)) * batch`` samples, one per rank (``DistributedSampler``'s ``drop_last`` count), read in
shuffled blocks (:mod:`mlcls.data.shards.loader`). A sample's augmentation and observed labels are drawn for
``key``, its index in the source split: the shards train on what the source would.
**Evaluation** (:class:`ShardEvalSet`): the validation shards read once into one byte buffer, a map-style
dataset. Opening a split checks what is cheap (format, sidecar hashes, shapes, local shard sizes);
``mlcls-data verify`` reads everything.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from torch import Tensor

from mlcls.data.datasets.base import (
    BAD_IMAGE_ERRORS,
    BadImageError,
    DatasetConfigError,
    DatasetError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
    check_choice,
)
from mlcls.data.datasets.labels import SparseLabelled, SparseLabels, dense_row
from mlcls.data.images import rgb_picture
from mlcls.data.sampling import seeded_call
from mlcls.data.shards.pack import IMAGE_EXT, MANIFEST_FILE, labels_file
from mlcls.data.shards.reader import (
    ROLES,
    ShardIndex,
    expand_urls,
    iter_shard,
    read_url,
    stored_label_entries,
)


def config_meta(root: str | None, urls: str | list[str] | None, meta: str | None) -> str:
    """Where a ``dataset=shards`` config's sidecar files are: ``meta``, else ``root``, else the folder of
    the first training shard."""
    if meta or root:
        return str(meta or root)
    if not urls:
        raise DatasetConfigError(
            "dataset=shards needs dataset.root=DIR (the folder mlcls-data pack wrote) or dataset.urls, "
            "e.g. DIR/train-{000000..000009}.tar"
        )
    first = expand_urls(urls)[0]
    if first.startswith("pipe:"):
        raise DatasetConfigError(
            "dataset.meta is needed with pipe: shard URLs: the folder or URL of classes.json and "
            "manifest.json"
        )
    return first.rsplit("/", 1)[0] if "/" in first else "."


@functools.lru_cache(maxsize=8)
def source_settings(meta: str) -> dict[str, Any]:
    """The packed source's dataset settings recorded in ``<meta>/manifest.json`` (``image_size``,
    ``transform``); empty when the manifest cannot be read (opening the shards then says why)."""
    try:
        source = json.loads(read_url(f"{meta.rstrip('/')}/{MANIFEST_FILE}")).get("source")
    except (DatasetError, OSError, ValueError, AttributeError):
        return {}
    return source if isinstance(source, dict) else {}


def source_setting(key: str, fallback: Any, node: Any) -> Any:
    """The resolver ``${shards_source:KEY,FALLBACK}`` of ``configs/dataset/shards.yaml``: the packed
    source's dataset setting ``key`` (:func:`source_settings`), ``fallback`` when it has none; ``node``:
    the dataset config (its ``root``, ``urls``, ``meta``)."""
    try:
        meta = config_meta(node.get("root"), node.get("urls"), node.get("meta"))
    except DatasetError:
        return fallback
    return source_settings(meta).get(key, fallback)


def open_shards(
    split: str = "train",
    urls: str | list[str] | None = None,
    val_urls: str | list[str] | None = None,
    meta: str | None = None,
    root: str | None = None,
    shuffle_buffer: int = 1000,
    transform: Callable | None = None,
    **config_keys: Any,
) -> ShardTrainSet | ShardEvalSet:
    """The ``split`` (``train`` or ``val``) of packed shards (``dataset=shards``; its keys are explained in
    ``configs/dataset/shards.yaml``): a :class:`ShardTrainSet` or a :class:`ShardEvalSet`. Without
    ``val_urls``, every val shard of the manifest, in the folder of ``urls`` (required with ``pipe:`` URLs)
    or of the manifest."""
    check_choice("split", split, ROLES)
    index = ShardIndex(config_meta(root, urls, meta))
    if split == "train":
        train_urls = expand_urls(urls) if urls else index.shard_urls("train")
        return ShardTrainSet(index, train_urls, shuffle_buffer, transform, **config_keys)
    if val_urls:
        split_urls = expand_urls(val_urls)
    else:
        split_urls = index.shard_urls("val", expand_urls(urls)[0] if urls else None)
    return ShardEvalSet(index, split_urls, transform, **config_keys)


class ShardTrainSet(SparseLabelled):
    """The training split of packed shards: classes, labels (the sidecar's, sparse) and the shard URLs;
    iterated by ``ShardTrainLoader``. ``len()``: packed samples."""

    def __init__(
        self,
        index: ShardIndex,
        urls: list[str],
        shuffle_buffer: int,
        transform: Callable | None = None,
        *,
        name: str | None = None,
        train_split: str = "train",
        val_split: str = "val",
    ) -> None:
        self.name, self.split, self.transform = name, "train", transform
        self.train_split, self.val_split = train_split, val_split
        self.urls, self.shuffle_buffer = urls, max(1, int(shuffle_buffer))
        self.classes, self.num_classes = index.classes, len(index.classes)
        self.shard_sizes, self.sparse_labels = index.shard_labels("train", urls)

    def __len__(self) -> int:
        return sum(self.shard_sizes)

    @functools.cached_property
    def _keys(self) -> np.ndarray:
        return np.fromiter((int(key) for url in self.urls for key, _ in iter_shard(url)), dtype=np.int64)

    def sample_indices(self) -> np.ndarray:
        """int64 (N,): the source-split index (the key) of each packed sample, in shard order; read from the
        shards once, only for the label counts under a regime that hides labels."""
        if len(self._keys) != len(self):
            raise DatasetFormatError(
                f"the training shards hold {len(self._keys)} samples, {MANIFEST_FILE} records {len(self)}; "
                "pack the split again"
            )
        return self._keys

    def make_sample(self, key: str, fields: dict[str, bytes], seed: int) -> tuple[Any, Tensor]:
        """``(image, labels row)`` of the shard sample ``key`` (its index in the source split), its
        augmentation run under ``seed``."""
        try:
            torch_only = self.transform is None or getattr(self.transform, "torch_random_only", False)
            image = seeded_call(seed, self._augment, fields[IMAGE_EXT], torch_only=torch_only)
        except BAD_IMAGE_ERRORS as exc:
            raise BadImageError(f"cannot read the image of sample {key} of the shards: {exc}") from exc
        pairs = stored_label_entries(fields, self.num_classes, f"sample {key} of the shards")
        return image, dense_row(pairs[:, 0], pairs[:, 1], self.num_classes, self.sparse_labels.fill)

    def _augment(self, data: bytes) -> Any:
        decode = getattr(self.transform, "decode_bytes", None)
        image = rgb_picture(data, None) if decode is None else decode(data)
        return image if self.transform is None else self.transform(image)


class ShardEvalSet(SparseLabelled, MultiLabelDataset):
    """The validation split of packed shards, a map-style dataset in shard order read whole into one byte
    buffer of the JPEGs and their offsets (shared by forked DataLoader workers without copies), its sparse
    labels checked against the sidecar's. ``samples`` name ``<shard URL>#<key>``."""

    def __init__(
        self, index: ShardIndex, urls: list[str], transform: Callable | None = None, **config_keys: Any
    ) -> None:
        super().__init__(transform, **config_keys)
        self.split = "val"
        if not urls:
            raise DatasetLayoutError(f"{index.meta}/{MANIFEST_FILE} lists no val shards; pack that split")
        self.classes = index.classes
        _, expected = index.shard_labels("val", urls)
        images, offsets, rows, samples = [], [0], [], []
        for url in urls:
            for key, fields in iter_shard(url):
                images.append(fields[IMAGE_EXT])
                offsets.append(offsets[-1] + len(fields[IMAGE_EXT]))
                rows.append(stored_label_entries(fields, len(self.classes), f"sample {key} of {url}"))
                samples.append(Sample(f"{url}#{key}"))
        self.buffer = np.frombuffer(b"".join(images), dtype=np.uint8)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sparse_labels = SparseLabels.from_stored_entries(rows, len(self.classes), expected.fill)
        if self.sparse_labels != expected:
            raise DatasetFormatError(
                f"the labels in the val shards differ from {index.meta}/{labels_file('val')}; pack the "
                "split again"
            )
        self.samples = samples

    def image_bytes(self, index: int) -> bytes:
        return self.buffer[self.offsets[index] : self.offsets[index + 1]].tobytes()
