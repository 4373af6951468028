"""Training and evaluation from packed shards (``dataset=shards``), as ``mlcls-data pack`` writes them
(layout: :mod:`mlcls.data.pack`).

Shards are read through ``webdataset``'s ``gopen``: local paths, ``http(s)://`` and ``pipe:`` commands
(``pipe:aws s3 cp s3://bucket/train-000001.tar -``), each as one sequential stream.

**Training** (:class:`ShardTrainSet`, loaded by :class:`mlcls.data.shard_loader.ShardTrainLoader`): every
epoch the shards are put in an order drawn from ``seed + epoch``; their concatenation, ``N`` samples, is cut
into contiguous ranges of ``per_rank = floor(N / (world_size * batch)) * batch`` samples, one per rank
(``DistributedSampler``'s ``drop_last`` count: every rank runs the same number of steps, no sample twice). A
rank's range is read in blocks, each shuffled in windows of ``shuffle_buffer``, and served by the DataLoader
workers in an order that does not depend on their number (:mod:`mlcls.data.shard_loader`); each sample's
augmentation runs under ``sample_seed(seed, epoch, key)`` (its index in the source split), whatever the
workers. ``set_start(k)`` (resuming mid-epoch) skips exactly the first ``k`` samples the rank served and
serves the rest in the order they would have come.

**Evaluation** (:class:`ShardEvalSet`): the validation shards are read once, whole, into one byte buffer
(the JPEGs at their packed size: ~25 kB an image at 320 px) and served as a map-style dataset, so that the
trainer's evaluation (``ShardSampler``: every sample scored exactly once over the ranks) applies unchanged.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mlcls.data.base import (
    BAD_IMAGE_ERRORS,
    BadImageError,
    DatasetConfigError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
    check_choice,
)
from mlcls.data.labels import SparseLabelled, SparseLabels
from mlcls.data.loader import seeded_call
from mlcls.data.pack import CLASSES_FILE, IMAGE_EXT, LABELS_EXT, MANIFEST_FILE, labels_file
from mlcls.data.tario import npy_array, tar_files
from mlcls.data.transforms import build_transform

ROLES = ("train", "val")
SHARD_NAME = re.compile(r"[^/\s]+\.tar")


def open_url(url: str) -> IO[bytes]:
    """A binary stream of ``url`` (a path, ``http(s)://``, ``pipe:`` command, ...) by ``webdataset``."""
    try:
        from webdataset.gopen import gopen
    except ImportError:
        raise DatasetConfigError(
            "dataset=shards reads shards with the webdataset library; pip install 'mlcls[shards]'"
        ) from None
    try:
        return gopen(url, "rb")
    except (OSError, ValueError) as exc:
        raise DatasetLayoutError(f"cannot open {url}: {exc}") from exc


def read_url(url: str) -> bytes:
    with open_url(url) as stream:
        return stream.read()


def expand_urls(urls: str | list[str]) -> list[str]:
    """Shard URLs of ``dataset.urls``: a brace pattern (``train-{000000..000123}.tar``) or a list of them."""
    from braceexpand import braceexpand

    patterns = [urls] if isinstance(urls, str) else list(urls)
    return [url for pattern in patterns for url in braceexpand(pattern)]


def shard_name_of(url: str) -> str:
    """The shard's file name in ``url`` (the last ``*.tar`` word: works for paths, URLs and commands)."""
    names = SHARD_NAME.findall(url)
    if not names:
        raise DatasetConfigError(f"no shard file name (*.tar) in the shard URL {url!r}")
    return names[-1]


def iter_shard(url: str, num_classes: int | None = None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` of each sample of the tar shard ``url``, in order, streamed (the
    stream read to its end: a ``pipe:`` command closed early fails). A sample without its image or labels
    file (missing, or a link) or, given ``num_classes``, whose labels are not a row of that many numbers
    raises :class:`DatasetFormatError` naming the shard and the member."""
    with open_url(url) as stream:
        key, fields = None, {}
        for name, data in tar_files(stream, url):
            member_key, _, extension = name.rsplit("/", 1)[-1].partition(".")
            if member_key != key:
                if key is not None:
                    yield key, check_sample(url, key, fields, num_classes)
                key, fields = member_key, {}
            fields[extension] = data
        if key is not None:
            yield key, check_sample(url, key, fields, num_classes)


def check_sample(url: str, key: str, fields: dict[str, bytes], num_classes: int | None) -> dict[str, bytes]:
    """``fields`` of sample ``key`` of shard ``url``, checked as :func:`iter_shard` says."""
    for extension in (IMAGE_EXT, LABELS_EXT):
        if extension not in fields:
            raise DatasetFormatError(
                f"shard {url}: no regular file {key}.{extension} (missing, or a link); pack the shard again"
            )
    if num_classes is not None:
        member = f"shard {url}, member {key}.{LABELS_EXT}"
        row = npy_array(fields[LABELS_EXT], member)
        if row.shape != (num_classes,) or row.dtype.kind not in "biuf":
            raise DatasetFormatError(
                f"{member} holds {row.shape} {row.dtype}; expected {num_classes} numbers"
            )
    return fields


class ShardIndex:
    """The sidecar files of a packed folder: ``classes.json`` (classes, source dataset) and ``manifest.json``
    (shard names and sample counts), read from ``meta`` (a folder or URL prefix)."""

    def __init__(self, meta: str) -> None:
        self.meta = meta.rstrip("/")
        info = self.read_json(CLASSES_FILE)
        self.classes: list[str] = list(info["classes"])
        self.source: str = info.get("dataset") or "shards"
        self.manifest: dict[str, Any] = self.read_json(MANIFEST_FILE)

    def read_json(self, name: str) -> Any:
        url = f"{self.meta}/{name}"
        try:
            return json.loads(read_url(url))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetFormatError(f"cannot parse {url}: {exc}") from exc

    def labels(self, role: str) -> SparseLabels:
        """The labels of the packed samples of ``role``, in shard order (the sparse sidecar)."""
        url = f"{self.meta}/{labels_file(role)}"
        try:
            return SparseLabels.from_bytes(read_url(url)).check(url)
        except (OSError, ValueError, KeyError) as exc:
            raise DatasetFormatError(f"cannot read the labels {url}: {exc}; pack the split again") from exc

    def shard_sizes(self, role: str, urls: list[str]) -> list[int]:
        """Sample count of each shard of ``urls`` (matched by file name in the manifest)."""
        if role not in self.manifest:
            raise DatasetLayoutError(f"{self.meta}/{MANIFEST_FILE} lists no {role} shards; pack that split")
        sizes = {entry["name"]: entry["samples"] for entry in self.manifest[role]["shards"]}
        missing = [shard_name_of(url) for url in urls if shard_name_of(url) not in sizes]
        if missing:
            raise DatasetConfigError(
                f"shard {missing[0]} is not a {role} shard of {self.meta}/{MANIFEST_FILE}; expected names "
                f"like {next(iter(sizes), '?')}"
            )
        return [sizes[shard_name_of(url)] for url in urls]

    def role_urls(self, role: str, like: str) -> list[str]:
        """URLs of every ``role`` shard of the manifest, made from the URL ``like`` of another shard."""
        name = shard_name_of(like)
        return [like.replace(name, entry["name"]) for entry in self.manifest.get(role, {}).get("shards", [])]


def default_meta(url: str) -> str:
    if url.startswith("pipe:"):
        raise DatasetConfigError(
            "dataset.meta is needed with pipe: shard URLs: the folder or URL of classes.json and "
            "manifest.json"
        )
    return url.rsplit("/", 1)[0] if "/" in url else "."


def decode_image(data: bytes, transform: Callable | None) -> Any:
    """The transform's input for the image bytes ``data``: its ``decode_bytes`` result (the fast pipeline)
    or the RGB PIL image."""
    decode = getattr(transform, "decode_bytes", None)
    if decode is not None:
        return decode(data)
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def open_shards(
    split: str = "train",
    urls: str | list[str] | None = None,
    val_urls: str | list[str] | None = None,
    meta: str | None = None,
    shuffle_buffer: int = 1000,
    transform: Callable | str | None = None,
    **config_keys: Any,
) -> ShardTrainSet | ShardEvalSet:
    """The ``split`` (``train`` or ``val``) of packed shards: a :class:`ShardTrainSet` for training, a
    :class:`ShardEvalSet` for evaluation (``dataset=shards``; see ``configs/dataset/shards.yaml``).

    Args:
        urls: the training shards, a brace pattern or a list (any URL ``webdataset`` opens).
        val_urls: the validation shards; None: every val shard of the manifest, at the place of ``urls``.
        meta: folder or URL prefix of ``classes.json``, ``manifest.json``, ``*-labels.npz``; None: the
            folder of the first training shard (required with ``pipe:`` URLs).
        shuffle_buffer: training samples a worker shuffles together (see the module docstring).
        transform, **config_keys: as for :class:`MultiLabelDataset`.
    """
    check_choice("split", split, ROLES)
    if not urls:
        raise DatasetConfigError("dataset=shards needs dataset.urls, e.g. DIR/train-{000000..000009}.tar")
    train_urls = expand_urls(urls)
    index = ShardIndex(meta or default_meta(train_urls[0]))
    if split == "train":
        return ShardTrainSet(index, train_urls, shuffle_buffer, transform, **config_keys)
    split_urls = expand_urls(val_urls) if val_urls else index.role_urls("val", train_urls[0])
    return ShardEvalSet(index, split_urls, transform, **config_keys)


class ShardTrainSet(SparseLabelled):
    """The training split of packed shards: classes, labels (the sidecar's, sparse: ``label_counts()``
    without a dense matrix) and the shard URLs; iterated by :class:`ShardTrainLoader`
    (``build_train_loader`` makes it). ``len()``: packed samples."""

    def __init__(
        self,
        index: ShardIndex,
        urls: list[str],
        shuffle_buffer: int,
        transform: Callable | str | None = None,
        *,
        name: str | None = None,
        image_size: int = 224,
        train_split: str = "train",
        val_split: str = "val",
    ) -> None:
        self.name, self.image_size, self.split = name, int(image_size), "train"
        self.train_split, self.val_split = train_split, val_split
        self.transform = (
            build_transform(transform, self.image_size, train=True)
            if isinstance(transform, str)
            else transform
        )
        self.urls, self.shuffle_buffer = urls, max(1, int(shuffle_buffer))
        self.classes = index.classes
        self.shard_sizes = index.shard_sizes("train", urls)
        labels = index.labels("train")
        if labels.shape != (index.manifest["train"]["samples"], len(self.classes)):
            raise DatasetFormatError(f"{index.meta}/{labels_file('train')} does not match the manifest")
        # Rows of the shards given (all of them, or a subset of the manifest's shards).
        offsets = np.cumsum([0] + [e["samples"] for e in index.manifest["train"]["shards"]])
        position = {e["name"]: k for k, e in enumerate(index.manifest["train"]["shards"])}
        starts = [offsets[position[shard_name_of(url)]] for url in urls]
        rows = np.concatenate(
            [np.arange(start, start + size) for start, size in zip(starts, self.shard_sizes, strict=True)]
        )
        self.sparse_labels = labels.rows(rows)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return sum(self.shard_sizes)

    def make_sample(self, key: str, fields: dict[str, bytes], seed: int) -> tuple[Any, Tensor]:
        """``(image, target)`` of one shard sample, its augmentation run under ``seed``."""
        try:
            torch_only = self.transform is None or getattr(self.transform, "torch_random_only", False)
            image = seeded_call(seed, self._augment, fields[IMAGE_EXT], torch_only=torch_only)
        except BAD_IMAGE_ERRORS as exc:
            raise BadImageError(f"cannot read the image of sample {key} of the shards: {exc}") from exc
        target = torch.from_numpy(npy_array(fields[LABELS_EXT]).astype(np.float32))
        return image, target

    def _augment(self, data: bytes) -> Any:
        image = decode_image(data, self.transform)
        return image if self.transform is None else self.transform(image)


class ShardEvalSet(MultiLabelDataset):
    """The validation split of packed shards, read whole into memory (one byte buffer of the JPEGs and
    their offsets: shared by forked DataLoader workers without copies); a map-style dataset in shard
    order. ``samples`` name ``<shard URL>#<key>``."""

    def __init__(
        self, index: ShardIndex, urls: list[str], transform: Callable | str | None = None, **config_keys: Any
    ) -> None:
        super().__init__(transform, split="val", **config_keys)
        self.split = "val"
        if not urls:
            raise DatasetLayoutError(f"{index.meta}/{MANIFEST_FILE} lists no val shards; pack that split")
        self.classes = index.classes
        images, offsets, labels, samples = [], [0], [], []
        for url in urls:
            for key, fields in iter_shard(url, len(self.classes)):
                images.append(fields[IMAGE_EXT])
                offsets.append(offsets[-1] + len(fields[IMAGE_EXT]))
                labels.append(npy_array(fields[LABELS_EXT]))
                samples.append(Sample(f"{url}#{key}"))
        self.buffer = np.frombuffer(b"".join(images), dtype=np.uint8)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.labels = torch.from_numpy(np.stack(labels).astype(np.float32))
        self.samples = samples

    def load_image(self, index: int) -> Any:
        data = self.buffer[self.offsets[index] : self.offsets[index + 1]].tobytes()
        return decode_image(data, self.transform)
