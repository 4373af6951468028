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

**Checks.** Opening a split checks, cheaply, that the folder is of this layout's format, that
``classes.json`` and the split's labels sidecar are the files the manifest records (sha256, the sidecar
read whole anyway), that the sidecar has one row per packed sample and class, and, for local shards, that
each file has the manifest's size; the validation shards' label rows are compared with their sidecar's.
:func:`verify_pack` (``mlcls-data verify DIR``) reads everything: every shard's sha256, sample count and
label rows against the manifest and the sidecars.

``dataset=shards dataset.root=DIR`` reads every shard of ``DIR``'s manifest; ``dataset.image_size`` and
``dataset.transform`` default to the packed source's (:func:`source_setting`, the config's
``${shards_source:...}``).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
from PIL import Image
from torch import Tensor

from mlcls.data.base import (
    BAD_IMAGE_ERRORS,
    LABEL_VALUES,
    BadImageError,
    DatasetConfigError,
    DatasetError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
    check_choice,
)
from mlcls.data.labels import SparseLabelled, SparseLabels, dense_row
from mlcls.data.loader import seeded_call
from mlcls.data.pack import CLASSES_FILE, FORMAT, IMAGE_EXT, LABELS_EXT, MANIFEST_FILE, labels_file
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
    file (missing, or a link) or, given ``num_classes``, whose labels are not valid (class, value) pairs
    raises :class:`DatasetFormatError` naming the shard and the member."""
    with open_url(url) as stream:
        yield from stream_samples(stream, url, num_classes)


def stream_samples(
    stream: IO[bytes], url: str, num_classes: int | None = None
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` of each sample of the tar archive ``stream`` (of ``url``), in order,
    checked by :func:`check_sample`."""
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


def stored_label_entries(fields: dict[str, bytes], num_classes: int, where: str) -> np.ndarray:
    """int32 (K, 2): the ``(class, value)`` pairs of a shard sample's label member, checked (a class in
    [0, ``num_classes``), a value 1, 0 or -1); :class:`DatasetFormatError` naming ``where`` otherwise."""
    if LABELS_EXT not in fields:
        raise DatasetFormatError(f"{where} has no {LABELS_EXT} member; pack the dataset again")
    pairs = npy_array(fields[LABELS_EXT], where)
    if (
        pairs.ndim != 2
        or pairs.shape[1] != 2
        or pairs.dtype.kind not in "iu"
        or (len(pairs) and (pairs[:, 0].min() < 0 or pairs[:, 0].max() >= num_classes))
        or not np.isin(pairs[:, 1], LABEL_VALUES).all()
    ):
        raise DatasetFormatError(
            f"{where}: labels are not (class, value) pairs with classes in [0, {num_classes}) and values "
            "1, 0 or -1; pack the dataset again"
        )
    return pairs.astype(np.int32)  # a copy: the member's bytes are read-only


def check_sample(url: str, key: str, fields: dict[str, bytes], num_classes: int | None) -> dict[str, bytes]:
    """``fields`` of sample ``key`` of shard ``url``: its image and labels members present as regular files
    and, given ``num_classes``, its labels valid (:func:`stored_label_entries`);
    :class:`DatasetFormatError` naming the shard and the member otherwise."""
    for extension in (IMAGE_EXT, LABELS_EXT):
        if extension not in fields:
            raise DatasetFormatError(
                f"shard {url}: no regular file {key}.{extension} (missing, or a link); pack the shard again"
            )
    if num_classes is not None:
        stored_label_entries(fields, num_classes, f"shard {url}, member {key}.{LABELS_EXT}")
    return fields


class ShardIndex:
    """The sidecar files of a packed folder: ``classes.json`` (classes, source dataset) and ``manifest.json``
    (shard names, sample counts, sizes, hashes), read from ``meta`` (a folder or URL prefix) and checked:
    the manifest's format and the hash of ``classes.json``."""

    def __init__(self, meta: str) -> None:
        self.meta = meta.rstrip("/")
        self.manifest: dict[str, Any] = self.read_json(
            MANIFEST_FILE, read_url(f"{self.meta}/{MANIFEST_FILE}")
        )
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            found = self.manifest.get("format", 1) if isinstance(self.manifest, dict) else "unknown"
            raise DatasetFormatError(
                f"{self.meta}/{MANIFEST_FILE} is of pack format {found}, this mlcls reads format {FORMAT}; "
                "pack the dataset again into a fresh folder"
            )
        info = self.read_json(CLASSES_FILE, self.read_recorded(self.manifest.get("classes")))
        self.classes: list[str] = list(info["classes"])
        self.source: str = info.get("dataset") or "shards"

    def read_json(self, name: str, data: bytes) -> Any:
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetFormatError(f"cannot parse {self.meta}/{name}: {exc}") from exc

    def read_recorded(self, entry: Any) -> bytes:
        """The bytes of the sidecar file the manifest records as ``entry`` (name, bytes, sha256), checked
        against its sha256."""
        if not isinstance(entry, dict) or not {"name", "sha256"} <= entry.keys():
            raise DatasetFormatError(f"{self.meta}/{MANIFEST_FILE} is incomplete; pack the dataset again")
        url = f"{self.meta}/{entry['name']}"
        data = read_url(url)
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise DatasetFormatError(
                f"{url} is not the file {MANIFEST_FILE} records (its sha256 differs: replaced or damaged "
                "since packing); pack the dataset again"
            )
        return data

    def split(self, role: str) -> dict[str, Any]:
        """The manifest's entry of the split ``role``."""
        if role not in self.manifest:
            raise DatasetLayoutError(f"{self.meta}/{MANIFEST_FILE} lists no {role} shards; pack that split")
        return self.manifest[role]

    def labels(self, role: str) -> SparseLabels:
        """The labels of the packed samples of ``role``, in shard order (the sparse sidecar), checked: the
        file the manifest records, one row per packed sample, one column per class, its ``label_fill``."""
        split = self.split(role)
        data = self.read_recorded(split.get("labels"))
        url = f"{self.meta}/{labels_file(role)}"
        try:
            labels = SparseLabels.from_bytes(data).check(url)
        except (OSError, ValueError, KeyError) as exc:
            raise DatasetFormatError(f"cannot read the labels {url}: {exc}; pack the split again") from exc
        counted = sum(entry["samples"] for entry in split["shards"])
        expected = (split["samples"], len(self.classes))
        if labels.shape != expected or counted != split["samples"] or labels.fill != split["label_fill"]:
            raise DatasetFormatError(
                f"{url} holds {labels.shape[0]} x {labels.shape[1]} labels (fill {labels.fill}), "
                f"{MANIFEST_FILE} {split['samples']} samples ({counted} in its shards) x {len(self.classes)} "
                f"classes (fill {split['label_fill']}); pack the split again"
            )
        return labels

    def shard_sizes(self, role: str, urls: list[str]) -> list[int]:
        """Sample count of each shard of ``urls`` (matched by file name in the manifest); a local shard
        file must have the manifest's size."""
        entries = {entry["name"]: entry for entry in self.split(role)["shards"]}
        missing = [shard_name_of(url) for url in urls if shard_name_of(url) not in entries]
        if missing:
            raise DatasetConfigError(
                f"shard {missing[0]} is not a {role} shard of {self.meta}/{MANIFEST_FILE}; expected names "
                f"like {next(iter(entries), '?')}"
            )
        for url in urls:
            recorded = entries[shard_name_of(url)]["bytes"]
            if is_local(url) and os.path.getsize(existing_file(url)) != recorded:
                raise DatasetFormatError(
                    f"shard {url} has {os.path.getsize(url)} bytes, {MANIFEST_FILE} records {recorded}; "
                    "replaced or damaged since packing (mlcls-data verify checks every shard)"
                )
        return [entries[shard_name_of(url)]["samples"] for url in urls]

    def rows_of(self, role: str, urls: list[str]) -> np.ndarray:
        """int64: the rows of the ``role`` sidecar that the samples of the shards ``urls`` take, in order
        (all of the split's shards, or some of them)."""
        shards = self.split(role)["shards"]
        offsets = np.cumsum([0] + [entry["samples"] for entry in shards])
        position = {entry["name"]: k for k, entry in enumerate(shards)}
        starts = [offsets[position[shard_name_of(url)]] for url in urls]
        sizes = self.shard_sizes(role, urls)
        return np.concatenate(
            [np.arange(start, start + size) for start, size in zip(starts, sizes, strict=True)]
            or [np.zeros(0, dtype=np.int64)]
        )

    def role_urls(self, role: str, like: str) -> list[str]:
        """URLs of every ``role`` shard of the manifest, made from the URL ``like`` of another shard."""
        name = shard_name_of(like)
        return [like.replace(name, entry["name"]) for entry in self.manifest.get(role, {}).get("shards", [])]


def is_local(url: str) -> bool:
    """Whether ``url`` is a file path (no ``scheme:`` such as ``https:`` or ``pipe:`` before its first
    ``/``)."""
    return ":" not in url.split("/", 1)[0]


def existing_file(path: str) -> str:
    """``path``, or :class:`DatasetLayoutError` when no such file exists."""
    if not os.path.isfile(path):
        raise DatasetLayoutError(f"shard {path} does not exist")
    return path


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
    return default_meta(expand_urls(urls)[0])


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
    transform: Callable | str | None = None,
    **config_keys: Any,
) -> ShardTrainSet | ShardEvalSet:
    """The ``split`` (``train`` or ``val``) of packed shards: a :class:`ShardTrainSet` for training, a
    :class:`ShardEvalSet` for evaluation (``dataset=shards``; see ``configs/dataset/shards.yaml``).

    Args:
        urls: the training shards, a brace pattern or a list (any URL ``webdataset`` opens); None: every
            training shard of ``root``'s manifest.
        val_urls: the validation shards; None: every val shard of the manifest, at the place of ``urls``
            (or in ``root``).
        meta: folder or URL prefix of ``classes.json``, ``manifest.json``, ``*-labels.npz``; None: ``root``,
            or the folder of the first training shard (required with ``pipe:`` URLs).
        root: the folder ``mlcls-data pack`` wrote, read through its manifest.
        shuffle_buffer: training samples a worker shuffles together (see the module docstring).
        transform, **config_keys: as for :class:`MultiLabelDataset`.
    """
    check_choice("split", split, ROLES)
    index = ShardIndex(config_meta(root, urls, meta))
    place = f"{str(root).rstrip('/')}/" if root else ""
    train_urls = (
        expand_urls(urls) if urls else [place + entry["name"] for entry in index.split("train")["shards"]]
    )
    if split == "train":
        return ShardTrainSet(index, train_urls, shuffle_buffer, transform, **config_keys)
    if val_urls:
        split_urls = expand_urls(val_urls)
    elif urls:
        split_urls = index.role_urls("val", train_urls[0])
    else:
        split_urls = [place + entry["name"] for entry in index.manifest.get("val", {}).get("shards", [])]
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
        self.sparse_labels = index.labels("train").rows(index.rows_of("train", urls))

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
        pairs = stored_label_entries(fields, self.num_classes, f"sample {key} of the shards")
        return image, dense_row(pairs[:, 0], pairs[:, 1], self.num_classes, self.sparse_labels.fill)

    def _augment(self, data: bytes) -> Any:
        image = decode_image(data, self.transform)
        return image if self.transform is None else self.transform(image)


class ShardEvalSet(SparseLabelled, MultiLabelDataset):
    """The validation split of packed shards, read whole into memory (one byte buffer of the JPEGs and
    their offsets: shared by forked DataLoader workers without copies; the labels sparse, as the shards
    store them, checked against the sidecar's); a map-style dataset in shard order. ``samples`` name
    ``<shard URL>#<key>``."""

    def __init__(
        self, index: ShardIndex, urls: list[str], transform: Callable | str | None = None, **config_keys: Any
    ) -> None:
        super().__init__(transform, split="val", **config_keys)
        self.split = "val"
        if not urls:
            raise DatasetLayoutError(f"{index.meta}/{MANIFEST_FILE} lists no val shards; pack that split")
        self.classes = index.classes
        expected = index.labels("val").rows(index.rows_of("val", urls))
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

    def load_image(self, index: int) -> Any:
        data = self.buffer[self.offsets[index] : self.offsets[index + 1]].tobytes()
        return decode_image(data, self.transform)
