"""``mlcls-data verify DIR``: everything of a packed folder (:mod:`mlcls.data.shards.pack`) checked against
its
manifest, reading every byte: each shard's size, sha256, sample count and label rows (against the split's
labels sidecar), the sidecars' hashes and shapes. Opening the shards for training checks only what is cheap
(:mod:`mlcls.data.shards.datasets`, "Checks")."""

from __future__ import annotations

import hashlib
from typing import IO, Any

from mlcls.data.datasets.base import DatasetError
from mlcls.data.datasets.labels import SparseLabels
from mlcls.data.shards.pack import labels_file
from mlcls.data.shards.reader import ROLES, ShardIndex, open_url, stored_label_entries, stream_samples


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
