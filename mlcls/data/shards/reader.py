"""Reading packed shards (:mod:`mlcls.data.shards.pack`): shard URLs (paths, or ``http(s)://`` and ``pipe:``
through ``webdataset``'s ``gopen``) streamed and checked member by member, :class:`ShardIndex` (a pack's
sidecars, checked against the manifest) and :func:`verify_pack` (``mlcls-data verify``: every byte). Names
read from a manifest are data, never commands: plain file names (:data:`FILE_NAME`), never in a ``pipe:``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from mlcls.data.datasets.base import (
    LABEL_VALUES,
    DatasetConfigError,
    DatasetError,
    DatasetFormatError,
    DatasetLayoutError,
    reading,
)
from mlcls.data.datasets.labels import SparseLabels, npy_array
from mlcls.data.shards.pack import CLASSES_FILE, IMAGE_EXT, LABELS_EXT, MANIFEST_FILE, labels_file
from mlcls.data.shards.tario import tar_files
from mlcls.formats import check_format
from mlcls.io import CAPS, NotRegularFileError, open_regular, read_capped

ROLES = ("train", "val")
SHARD_NAME = re.compile(r"[^/\s]+\.tar")
# A file name a manifest may record: letters, digits, ``.``, ``_`` and ``-``, not starting with ``.`` or
# ``-`` (no path, no URL scheme, no shell syntax, no option); shards end in ``.tar``.
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
# Shard URLs one pattern may expand to (Open Images at 1,000 images a shard takes about 9,000).
MAX_SHARD_URLS = 1_000_000
INT_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?\}")  # braceexpand's numeric range
SAMPLE_KEY = re.compile(r"[0-9]{1,18}")  # a packed sample's index in its source split: an int64
FILE_RECORD = {"name": str, "bytes": int, "sha256": str}  # the manifest's record of a file (its types)
SHARD_RECORD = {**FILE_RECORD, "samples": int}
# The fewest bytes a packed sample takes in a tar shard: two members (image, labels), each a 512-byte header
# and at least one 512-byte block of data. A manifest's sample counts are bounded by its shards' bytes.
MIN_SAMPLE_BYTES = 2048


def open_url(url: str, max_bytes: int | None = None) -> IO[bytes]:
    """A binary stream of ``url``: a local path opened as a file (refused over ``max_bytes``), anything else
    (``http(s)://``, a ``pipe:`` command, ...) by ``webdataset``'s ``gopen``."""
    if is_local(url):
        try:
            return open_regular(url, max_bytes=max_bytes)
        except NotRegularFileError as exc:
            raise DatasetLayoutError(str(exc)) from exc
        except OSError as exc:
            raise DatasetLayoutError(f"cannot open {url}: {exc.strerror or exc}") from exc
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


def read_url(url: str, max_bytes: int = CAPS["manifest"]) -> bytes:
    """The bytes of the sidecar ``url`` (a manifest, class list or labels file), at most ``max_bytes``."""
    with reading(url), open_url(url, max_bytes) as stream:
        return read_capped(stream, max_bytes, url, "shard sidecar")


def expand_urls(urls: str | list[str]) -> list[str]:
    """Shard URLs of ``dataset.urls``: a brace pattern (``train-{000000..000123}.tar``) or a list of them."""
    from braceexpand import UnbalancedBracesError, braceexpand

    patterns = [urls] if isinstance(urls, str) else list(urls)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise DatasetConfigError(
                f"a shard URL is {type(pattern).__name__} {pattern!r}; expected a string"
            )
    within = sum(map(range_values, patterns)) <= MAX_SHARD_URLS  # braceexpand makes each range whole first
    try:
        chained = itertools.chain.from_iterable(map(braceexpand, patterns))
        expanded = list(itertools.islice(chained, MAX_SHARD_URLS + 1)) if within else []
    except UnbalancedBracesError as exc:
        raise DatasetConfigError(
            f"the shard URLs {patterns[0][:80]!r} have unbalanced braces; expected a pattern such as "
            "'train-{000000..000123}.tar'"
        ) from exc
    if not within or len(expanded) > MAX_SHARD_URLS:
        raise DatasetConfigError(
            f"the shard URLs {patterns[0][:80]!r}… expand to over {MAX_SHARD_URLS:,} shards; expected one "
            "pattern (or a list) per split"
        )
    return expanded


def range_values(pattern: str) -> int:
    """How many values the numeric ranges ``{a..b}`` / ``{a..b..step}`` of ``pattern`` hold together."""
    total = 0
    for start, end, step in INT_RANGE.findall(pattern):
        if max(len(start), len(end), len(step)) > 19:  # past int64, and int() refuses 4,300 digits
            return MAX_SHARD_URLS + 1
        total += abs(int(end) - int(start)) // max(int(step or 1), 1) + 1
    return total


def shard_name_of(url: str) -> str:
    """The shard's file name in ``url`` (the last ``*.tar`` word: works for paths, URLs and commands)."""
    names = SHARD_NAME.findall(url)
    if not names:
        raise DatasetConfigError(f"no shard file name (*.tar) in the shard URL {url!r}")
    return names[-1]


def iter_shard(url: str, num_classes: int | None = None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """:func:`stream_samples` of the tar shard ``url``, streamed and read to its end (a ``pipe:`` command
    closed early fails)."""
    with open_url(url) as stream:
        yield from stream_samples(stream, url, num_classes)


def stream_samples(
    stream: IO[bytes], url: str, num_classes: int | None = None
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` of each sample of the tar archive ``stream`` (of ``url``), in order,
    checked by :func:`check_sample`. Members must be named ``<key>.<extension>`` as packing names them (the
    key a sample number, in no folder), each sample's members together and each extension once, else
    :class:`DatasetFormatError` naming the shard and the member: such a member would be read as another
    sample, or overwrite one."""
    key, fields, seen = None, {}, set()
    for name, data in tar_files(stream, url):
        member_key, _, extension = name.partition(".")
        if member_key != key:
            if key is not None:
                yield key, check_sample(url, key, fields, num_classes)
            if "/" in name or not SAMPLE_KEY.fullmatch(member_key):
                raise DatasetFormatError(
                    f"shard {url}, member {name!r}: not named <sample number>.<extension> in no folder, as "
                    "packing names members; pack the shard again"
                )
            if member_key in seen:
                raise DatasetFormatError(
                    f"shard {url}, member {name!r}: sample {member_key} already came earlier in the shard "
                    "(each sample's members are together); pack the shard again"
                )
            key, fields = member_key, {}
            seen.add(key)
        if extension in fields:
            raise DatasetFormatError(
                f"shard {url}, member {name!r}: a second {extension} member of sample {key}; pack the shard "
                "again"
            )
        fields[extension] = data
    if key is not None:
        yield key, check_sample(url, key, fields, num_classes)


def stored_label_entries(fields: dict[str, bytes], num_classes: int, where: str) -> np.ndarray:
    """int32 (K, 2): the ``(class, value)`` pairs of the label member of a shard sample's ``fields`` (as
    :func:`check_sample` passed them), checked (a class in [0, ``num_classes``), a value 1, 0 or -1);
    :class:`DatasetFormatError` naming ``where`` otherwise."""
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
    """``fields`` of sample ``key`` of shard ``url``, with its image and labels members (regular files) and,
    given ``num_classes``, valid labels; else :class:`DatasetFormatError` naming the shard and the member."""
    for extension in (IMAGE_EXT, LABELS_EXT):
        if extension not in fields:
            raise DatasetFormatError(
                f"shard {url}: no regular file {key}.{extension} (missing, or a link); pack the shard again"
            )
    if num_classes is not None:
        stored_label_entries(fields, num_classes, f"shard {url}, member {key}.{LABELS_EXT}")
    return fields


class ShardIndex:
    """The ``manifest.json`` and ``classes.json`` of a packed folder (or URL prefix) ``meta``, checked: the
    manifest's format and fields, the hash of ``classes.json``."""

    def __init__(self, meta: str) -> None:
        self.meta = meta.rstrip("/")
        self.manifest: dict[str, Any] = self.read_json(
            MANIFEST_FILE, read_url(f"{self.meta}/{MANIFEST_FILE}")
        )
        if not isinstance(self.manifest, dict):
            raise DatasetFormatError(f"{self.meta}/{MANIFEST_FILE} holds no mapping; pack the dataset again")
        check_format(self.manifest, "pack", f"{self.meta}/{MANIFEST_FILE}", DatasetFormatError)
        check_manifest(self.manifest, f"{self.meta}/{MANIFEST_FILE}")
        info = self.read_json(CLASSES_FILE, self.read_recorded(self.manifest["classes"]))
        classes = info.get("classes") if isinstance(info, dict) else None
        if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
            raise DatasetFormatError(f"{self.meta}/{CLASSES_FILE} holds no list of class names; pack again")
        self.classes: list[str] = classes
        self.source: str = info.get("dataset") or "shards"

    def read_json(self, name: str, data: bytes) -> Any:
        with reading(f"{self.meta}/{name}"):
            return json.loads(data)

    def read_recorded(self, entry: dict[str, Any]) -> bytes:
        """The bytes of the sidecar file the manifest records as ``entry`` (name, bytes, sha256), checked
        against its sha256."""
        url = f"{self.meta}/{entry['name']}"
        data = read_url(url, min(entry["bytes"], CAPS["label file"]))  # the size the manifest records
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
        data = self.read_recorded(split["labels"])
        url = f"{self.meta}/{labels_file(role)}"
        counted = sum(entry["samples"] for entry in split["shards"])
        expected = (split["samples"], len(self.classes))
        try:  # read no more than the manifest's shape allows: a deflate bomb is refused unread
            labels = SparseLabels.from_bytes(data, expected).check(url)
        except (OSError, ValueError, KeyError) as exc:
            raise DatasetFormatError(f"cannot read the labels {url}: {exc}; pack the split again") from exc
        if labels.shape != expected or counted != split["samples"] or labels.fill != split["label_fill"]:
            raise DatasetFormatError(
                f"{url} holds {labels.shape[0]} x {labels.shape[1]} labels (fill {labels.fill}), "
                f"{MANIFEST_FILE} {split['samples']} samples ({counted} in its shards) x {len(self.classes)} "
                f"classes (fill {split['label_fill']}); pack the split again"
            )
        return labels

    def shard_labels(self, role: str, urls: list[str]) -> tuple[list[int], SparseLabels]:
        """The sample count of each shard of ``urls`` (matched by file name in the manifest; a local shard
        file must have the manifest's size) and their samples' rows of the ``role`` labels, in order."""
        shards, names = self.split(role)["shards"], [shard_name_of(url) for url in urls]
        entries = {entry["name"]: entry for entry in shards}
        missing = [name for name in names if name not in entries]
        if missing:
            raise DatasetConfigError(
                f"shard {missing[0]} is not a {role} shard of {self.meta}/{MANIFEST_FILE}; expected names "
                f"like {next(iter(entries), '?')}"
            )
        for url, name in zip(urls, names, strict=True):
            recorded = entries[name]["bytes"]
            if is_local(url) and not os.path.isfile(url):
                raise DatasetLayoutError(f"shard {url} does not exist")
            if is_local(url) and os.path.getsize(url) != recorded:
                raise DatasetFormatError(
                    f"shard {url} has {os.path.getsize(url)} bytes, {MANIFEST_FILE} records {recorded}; "
                    "replaced or damaged since packing (mlcls-data verify checks every shard)"
                )
        labels = self.labels(role)  # the counts checked against the sidecar before any row index is made
        ends = itertools.accumulate(entry["samples"] for entry in shards)
        spans = {
            entry["name"]: (end - entry["samples"], end) for entry, end in zip(shards, ends, strict=True)
        }
        rows = np.concatenate([np.zeros(0, dtype=np.int64), *(np.arange(*spans[name]) for name in names)])
        return [entries[name]["samples"] for name in names], labels.rows(rows)

    def shard_urls(self, role: str, like: str | None = None) -> list[str]:
        """URLs of every ``role`` shard of the manifest, in its own folder (``meta``) or in the folder (or URL
        prefix) of the shard ``like``, never in a ``pipe:`` command (:class:`DatasetConfigError`)."""
        folder = self.meta
        if like is not None:
            if like.startswith("pipe:"):
                raise DatasetConfigError(
                    "dataset.val_urls is needed with pipe: training shards (mlcls writes no name read from "
                    f"{MANIFEST_FILE} into a command), e.g. "
                    'dataset.val_urls="pipe:… val-{000000..000004}.tar …"'
                )
            folder = like[: -len(shard_name_of(like))].rstrip("/") or "."
        return [f"{folder}/{entry['name']}" for entry in self.split(role)["shards"]]


def check_manifest(manifest: dict[str, Any], where: str) -> None:
    """:class:`DatasetFormatError` naming the field unless each field of ``manifest`` (read from ``where``)
    that reading the pack uses has its type: the ``classes`` file record, and per split its ``samples``,
    ``label_fill`` (1, 0 or -1), ``labels`` file record and ``shards`` records (names unique). A record's
    ``name`` is a plain file name (:data:`FILE_NAME`; shards ``*.tar``), ``bytes`` and ``samples`` counts, a
    shard's ``samples`` at most its ``bytes`` / :data:`MIN_SAMPLE_BYTES`."""

    def check_record(record: Any, field: str, types: dict[str, type]) -> None:
        if not isinstance(record, dict):
            raise DatasetFormatError(f"{where}: {field} is not an object; pack the dataset again")
        for key, kind in types.items():
            value = record.get(key)
            # bool is an int to Python, not a count; a count is never negative
            if type(value) is not kind or (kind is int and value < 0):
                expected = "a count (an integer >= 0)" if kind is int else "a string"
                raise DatasetFormatError(
                    f"{where}: {field}.{key} is {value!r:.40}, not {expected}; pack the dataset again"
                )
        shard = types is SHARD_RECORD
        if "name" in types and (
            not FILE_NAME.fullmatch(record["name"]) or (shard and not record["name"].endswith(".tar"))
        ):
            raise DatasetFormatError(
                f"{where} records the {field} name {record['name']!r:.80}; expected a plain file name "
                f"([A-Za-z0-9._-]{'+.tar' if shard else '+'}, read from the manifest's folder); pack again"
            )

    check_record(manifest.get("classes"), "classes", FILE_RECORD)
    for role in (role for role in ROLES if role in manifest):
        split = manifest[role]
        check_record(split, role, {"samples": int})
        if type(split.get("label_fill")) is not int or split["label_fill"] not in LABEL_VALUES:
            raise DatasetFormatError(
                f"{where}: {role}.label_fill is {split.get('label_fill')!r:.40}, not 1, 0 or -1; pack the "
                "dataset again"
            )
        check_record(split.get("labels"), f"{role}.labels", FILE_RECORD)
        shards = split.get("shards")
        if not isinstance(shards, list):
            raise DatasetFormatError(f"{where}: {role}.shards is not a list; pack the dataset again")
        names = set()
        for position, entry in enumerate(shards):
            check_record(entry, f"{role}.shards[{position}]", SHARD_RECORD)
            if entry["samples"] > entry["bytes"] // MIN_SAMPLE_BYTES:
                raise DatasetFormatError(
                    f"{where}: {role}.shards[{position}] records {entry['samples']} samples in "
                    f"{entry['bytes']} bytes; at most {entry['bytes'] // MIN_SAMPLE_BYTES} fit (a sample "
                    f"takes {MIN_SAMPLE_BYTES} bytes of tar or more); pack the dataset again"
                )
            if entry["name"] in names:
                raise DatasetFormatError(
                    f"{where}: {role}.shards[{position}].name {entry['name']!r:.80} is listed twice; pack "
                    "the dataset again"
                )
            names.add(entry["name"])


def is_local(url: str) -> bool:
    """Whether ``url`` is a file path (no ``scheme:`` such as ``https:`` or ``pipe:`` before its first
    ``/``)."""
    return ":" not in url.split("/", 1)[0]


class HashingReader:
    """A binary stream that counts and hashes (sha256) what is read through it."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream, self.digest, self.size = stream, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.digest.update(data)
        self.size += len(data)
        return data


def verify_pack(meta: str) -> list[str]:
    """One line per problem of the packed folder (or URL prefix) ``meta``; empty when all is as packed."""
    try:
        index = ShardIndex(meta)
    except DatasetError as exc:
        return [str(exc)]
    problems = []
    for role in (role for role in ROLES if role in index.manifest):
        try:
            labels = index.labels(role)
        except DatasetError as exc:
            problems.append(str(exc))
            continue
        first = 0
        for entry in index.split(role)["shards"]:
            expected = labels.rows(range(first, min(first + entry["samples"], len(labels))))
            problems += verify_shard(f"{index.meta}/{entry['name']}", entry, expected, role)
            first += entry["samples"]
    return problems


def verify_shard(url: str, entry: dict[str, Any], expected: SparseLabels, role: str) -> list[str]:
    """The problems of the shard ``url`` against its manifest ``entry`` (bytes, sha256, samples) and its
    rows of the split's labels sidecar, ``expected``."""
    problems, rows = [], []
    try:
        with open_url(url) as stream:
            reader = HashingReader(stream)
            for key, fields in stream_samples(reader, url):
                rows.append(stored_label_entries(fields, expected.shape[1], f"{url}: sample {key}"))
    except DatasetError as exc:
        return [str(exc)]
    if (reader.size, reader.digest.hexdigest()) != (entry["bytes"], entry["sha256"]):
        problems.append(
            f"{url}: sha256 or size differs from the manifest's ({reader.size} bytes, {entry['bytes']} "
            "recorded); damaged or replaced since packing"
        )
    if len(rows) != entry["samples"]:
        problems.append(f"{url}: {len(rows)} samples, the manifest records {entry['samples']}")
    elif SparseLabels.from_stored_entries(rows, expected.shape[1], expected.fill) != expected:
        problems.append(f"{url}: label rows differ from those of {labels_file(role)}")
    return problems
