"""Packing a dataset into WebDataset tar shards with pre-resized JPEGs (``mlcls-data pack``).

Layout of the output folder (read back by :mod:`mlcls.data.shards.reader`):

* ``train-000000.tar``, ... and ``val-000000.tar``, ...: ustar tar files, two members a sample:
  ``<key>.jpg`` (:func:`packed_image`) and ``<key>.labels.sparse.npy``, int32 (K, 2), the ``(class,
  value)`` pairs that differ from the split's ``label_fill``, class ascending (~1 kB a sample where Open
  Images' dense int8 row takes ~10 kB). ``<key>``: the sample's index in the source split, 9 digits. Shard
  ``k`` holds the samples at positions ``k * shard_size ...`` of the packing order (seeded for training,
  dataset order for validation), minus the unreadable ones.
* ``classes.json``: the source's name and split names, ``max_side``, ``quality``, ``subsampling``, classes.
* ``manifest.json``: ``format`` (:data:`FORMAT`), the sha256 of ``classes.json``, the source's ``image_size``
  and ``transform`` (``dataset=shards``' defaults), and per split the pack settings, ``label_fill``, each
  shard's name, samples, size and sha256, the labels sidecar's record and the skipped images. Written last,
  atomically: a folder with a manifest is complete.
* ``train-labels.npz``, ``val-labels.npz``: the packed samples' labels in shard order, sparse
  (:meth:`~mlcls.data.datasets.labels.SparseLabels.to_bytes`): class statistics without a shard read.

Resumable: a shard is renamed into place when complete and recorded in ``.<split>-progress.jsonl``
(:func:`read_progress`); a restarted pack keeps the shards whose label rows still have the recorded sha256.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image, JpegImagePlugin
from tqdm import tqdm

from mlcls.data.datasets.base import BAD_IMAGE_ERRORS, DatasetConfigError, MultiLabelDataset
from mlcls.data.datasets.labels import SparseLabels, sparse_labels_of
from mlcls.data.images import crop_box, open_image
from mlcls.data.pipeline.fast import draft_reduction, image_header, load_reduced
from mlcls.formats import FORMAT
from mlcls.io import atomic_write_bytes, read_json, read_text

CLASSES_FILE, MANIFEST_FILE = "classes.json", "manifest.json"
KEY_DIGITS, SHARD_DIGITS = 9, 6
IMAGE_EXT, LABELS_EXT = "jpg", "labels.sparse.npy"
# JPEG chroma subsampling of re-encoded images: 444 keeps the colour at full resolution, 422 halves it
# horizontally, 420 (PIL's and most cameras' default) in both directions; auto keeps a JPEG source's own
# (4:2:0 photographs stay 4:2:0, at their decoding speed) and takes 444 for any other source (PNG, pixels a
# dataset generates), so that packing never halves the colour resolution an image had.
SUBSAMPLINGS = ("auto", "444", "422", "420")
# PIL's JpegImagePlugin.get_sampling codes; -1 (4:4:0, 4:1:1, ...) maps to 444, keeping every colour sample.
PIL_SAMPLING = {0: "444", 1: "422", 2: "420"}


def encode_jpeg(image: Image.Image, quality: int, subsampling: str = "444") -> bytes:
    """RGB JPEG bytes of ``image`` (libjpeg-turbo) at ``quality`` with chroma ``subsampling`` (444, 422 or
    420; PIL's ``save(..., quality=q, subsampling=0 | 1 | 2)``)."""
    pixels = np.ascontiguousarray(np.asarray(image.convert("RGB")))
    return simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling=subsampling)


def packed_image(
    dataset: MultiLabelDataset, index: int, max_side: int, quality: int, subsampling: str = "auto"
) -> bytes:
    """JPEG bytes of sample ``index`` (its crop box applied), long side at most ``max_side``: a JPEG file
    already within ``max_side`` (no crop) byte for byte (no second generation of JPEG loss); else decoded at
    the largest DCT reduction that keeps its output size (PIL's draft mode), resized (bilinear, antialiased)
    and encoded at ``quality`` and chroma ``subsampling`` (:data:`SUBSAMPLINGS`). A dataset that
    makes its pixels (``reads_files`` False) gives its ``picture``. Raises PIL's bad-image errors."""
    if dataset.reads_files:
        sample, data = dataset.samples[index], dataset.image_bytes(index)
        width, height, jpeg = image_header(data)
        if jpeg and sample.box is None and max(width, height) <= max_side:
            return data
        opened, box = open_image(data), sample.box
    else:
        opened, box = nullcontext(dataset.picture(index)), None
    with opened as img:
        if subsampling == "auto":  # a JPEG's own, read from its header; 444 for any other image
            jpeg = isinstance(img, JpegImagePlugin.JpegImageFile)
            subsampling = PIL_SAMPLING.get(JpegImagePlugin.get_sampling(img), "444") if jpeg else "444"
        left, top, right, bottom = crop_box(box, *img.size)
        scale = min(1.0, max_side / max(right - left, bottom - top))  # never enlarged
        target = (max(1, round((right - left) * scale)), max(1, round((bottom - top) * scale)))
        reduced, scale_x, scale_y = load_reduced(img, draft_reduction(right - left, bottom - top, *target))
    region = (left / scale_x, top / scale_y, right / scale_x, bottom / scale_y)
    return encode_jpeg(reduced.resize(target, Image.Resampling.BILINEAR, box=region), quality, subsampling)


def labels_file(role: str) -> str:
    return f"{role}-labels.npz"


def file_entry(name: str, data: bytes) -> dict[str, Any]:
    """The manifest's record of a sidecar file: ``name``, ``bytes``, ``sha256``."""
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@dataclass
class SplitReport:
    """What packing one split did: shards written now, shards kept from an earlier run, samples, skips; the
    settings it was packed with and its labels sidecar (:func:`file_entry`)."""

    role: str
    shards: list[dict[str, Any]] = field(default_factory=list)
    written: int = 0
    kept: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, Any] = field(default_factory=dict)
    label_fill: int = 0

    @property
    def samples(self) -> int:
        return sum(entry["samples"] for entry in self.shards)

    @property
    def skipped(self) -> list[dict[str, str]]:
        return [skip for entry in self.shards for skip in entry["skipped"]]


def pack_split(
    dataset: MultiLabelDataset,
    out: str | Path,
    role: str,
    shard_size: int,
    max_side: int,
    quality: int = 90,
    subsampling: str = "auto",
    shuffle: bool = False,
    seed: int = 0,
    progress: bool = True,
    workers: int = 1,
    overwrite: bool = False,
) -> SplitReport:
    """Write ``dataset`` as the shards ``<out>/<role>-NNNNNN.tar`` (the module docstring), resuming an
    interrupted run; ``workers`` > 1 writes that many shards at once in worker processes. Unreadable images
    are left out and listed in the report, whatever ``dataset.on_bad_image`` says: packing is where they are
    found."""
    if shard_size < 1 or max_side < 1 or not 1 <= quality <= 100 or subsampling not in SUBSAMPLINGS:
        raise DatasetConfigError(
            f"shard_size={shard_size}, max_side={max_side}, quality={quality}, subsampling={subsampling}; "
            f"expected shard_size >= 1, max_side >= 1, quality in 1..100 and subsampling one of "
            f"{', '.join(SUBSAMPLINGS)}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if shuffle:  # the training split: consecutive samples unrelated
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        order = list(range(len(dataset)))
    settings = {
        "format": FORMAT,
        "dataset": dataset.name,
        "classes": len(dataset.classes),
        "samples": len(dataset),
        "shard_size": shard_size,
        "max_side": max_side,
        "quality": quality,
        "subsampling": subsampling,
        "order_seed": seed if shuffle else None,
    }
    progress_file = progress_path(out, role)
    done = read_progress(out, role, settings, overwrite)
    # Rewritten whole: a torn last line would otherwise run into the next entry appended.
    atomic_write_bytes(
        progress_file,
        "".join(json.dumps(line) + "\n" for line in [{"settings": settings}, *done.values()]).encode(),
    )
    labels = sparse_labels_of(dataset)
    report = SplitReport(role, settings=settings, label_fill=labels.fill)
    chunks = {
        f"{role}-{k:0{SHARD_DIGITS}d}.tar": order[first : first + shard_size]  # train-000012.tar
        for k, first in enumerate(range(0, len(order), shard_size))
    }
    # A shard is kept only when its samples' label rows are still those it holds (labels corrected since
    # are packed again), not only its settings.
    entries = {
        name: done[name]
        for name in chunks
        if name in done and done[name].get("labels_sha256") == label_digest(labels, chunks[name])
    }
    report.kept = len(entries)
    bar = tqdm(total=len(order), desc=f"pack {role}", unit="img", disable=not progress)
    bar.update(sum(len(chunks[name]) for name in entries))
    pending = [name for name in chunks if name not in entries]
    with (
        ProcessPoolExecutor(workers, mp_context=get_context("fork")) if workers > 1 else nullcontext() as pool
    ):
        jobs = [(dataset, out / name, chunks[name], max_side, quality, subsampling) for name in pending]
        written = (
            pool.map(write_shard, *zip(*jobs, strict=True))
            if pool is not None and jobs
            else (write_shard(*job) for job in jobs)
        )
        for entry in written:
            with open(progress_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
            entries[entry["name"]] = entry
            report.written += 1
            bar.update(len(chunks[entry["name"]]))
    bar.close()
    report.shards = [entries[name] for name in chunks]
    kept_rows = [i for entry in report.shards for i in entry["indices"]]
    sidecar = labels.rows(kept_rows).to_bytes()
    atomic_write_bytes(out / labels_file(role), sidecar)
    report.labels = file_entry(labels_file(role), sidecar)
    return report


def label_digest(labels: SparseLabels, indices: Sequence[int]) -> str:
    """sha256 of the label rows ``indices`` of ``labels`` (their stored entries and fill): what a shard of
    those samples holds, recorded in its progress entry to tell a source whose labels changed."""
    rows = labels.rows(np.asarray(indices, dtype=np.int64))
    digest = hashlib.sha256(np.asarray([*rows.shape, rows.fill], dtype=np.int64).tobytes())
    for array in (rows.offsets, rows.columns, rows.values):
        digest.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    return digest.hexdigest()


def progress_path(out: Path, role: str) -> Path:
    return out / f".{role}-progress.jsonl"


def read_progress(
    out: Path, role: str, settings: dict[str, Any], overwrite: bool = False
) -> dict[str, dict[str, Any]]:
    """The completed ``role`` shards recorded in ``out``'s progress file (by name) whose file exists, if it
    was written with the same ``settings``; else nothing, the split's files (shards whole or partial,
    progress, labels) deleted first with ``overwrite``, or :class:`DatasetConfigError` without."""
    progress_file, entries = progress_path(out, role), []
    if progress_file.exists():
        for line in read_text(progress_file, "manifest", errors="replace").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    recorded = entries[0].get("settings") if entries and isinstance(entries[0], dict) else None
    if recorded == settings:
        return {
            entry["name"]: entry
            for entry in entries[1:]
            if isinstance(entry, dict) and entry.keys() >= SHARD_ENTRY_KEYS and (out / entry["name"]).exists()
        }
    pack_files = [*sorted(out.glob(f"{role}-*.tar")), *sorted(out.glob(f"{role}-*.tar.tmp"))]
    pack_files += [progress_file, out / labels_file(role)]
    existing = [path for path in pack_files if path.exists()]
    if existing and not overwrite:
        changed = (
            ", ".join(
                f"{key} {recorded.get(key)} -> {value}"
                for key, value in settings.items()
                if recorded.get(key) != value
            )
            if isinstance(recorded, dict)
            else "unknown settings"
        )
        raise DatasetConfigError(
            f"{out} holds {role} shards packed with other settings ({changed}); pack into a fresh folder, "
            f"the same settings to continue, or add overwrite=true to delete them first"
        )
    for path in existing:
        path.unlink()
    return {}


SHARD_ENTRY_KEYS = {"name", "samples", "sha256", "bytes", "indices", "skipped"}


def write_shard(
    dataset: MultiLabelDataset,
    path: Path,
    indices: Sequence[int],
    max_side: int,
    quality: int,
    subsampling: str,
) -> dict[str, Any]:
    """Write the samples ``indices`` of ``dataset`` to the shard ``path`` (through ``path.tmp``, renamed
    when complete); returns its progress entry (:data:`SHARD_ENTRY_KEYS` and the :func:`label_digest`)."""
    labels = sparse_labels_of(dataset)
    temporary = path.with_name(path.name + ".tmp")
    kept, skipped = [], []
    with tarfile.open(temporary, "w", format=tarfile.USTAR_FORMAT) as tar:
        for index in indices:
            try:
                image = packed_image(dataset, index, max_side, quality, subsampling)
            except BAD_IMAGE_ERRORS as exc:
                skipped.append({"path": dataset.samples[index].path, "error": f"{type(exc).__name__}: {exc}"})
                continue
            entries = io.BytesIO()
            np.save(entries, labels.stored_entries(index))
            for extension, data in ((IMAGE_EXT, image), (LABELS_EXT, entries.getvalue())):
                info = tarfile.TarInfo(f"{index:0{KEY_DIGITS}d}.{extension}")
                info.size, info.mode, info.mtime = len(data), 0o644, 0  # mtime 0: the same bytes each time
                tar.addfile(info, io.BytesIO(data))
            kept.append(index)
    os.replace(temporary, path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {
        "name": path.name,
        "samples": len(kept),
        "sha256": digest.hexdigest(),
        "bytes": path.stat().st_size,
        "indices": kept,
        "skipped": skipped,
        "labels_sha256": label_digest(labels, indices),
    }


def write_sidecars(
    out: str | Path,
    dataset: MultiLabelDataset,
    splits: dict[str, str],
    reports: Sequence[SplitReport],
    max_side: int,
    quality: int,
    subsampling: str = "auto",
    source: dict[str, Any] | None = None,
) -> None:
    """``classes.json`` and ``manifest.json`` (see the module docstring), merged with those of splits
    packed by an earlier command into the same folder; ``source``: the source's dataset settings
    (``image_size``, ``transform``) that ``dataset=shards`` takes as defaults."""
    out = Path(out)
    classes = {
        "dataset": dataset.name,
        "splits": splits,
        "max_side": max_side,
        "quality": quality,
        "subsampling": subsampling,
        "classes": list(dataset.classes),
    }
    classes_bytes = (json.dumps(classes, indent=1) + "\n").encode()
    atomic_write_bytes(out / CLASSES_FILE, classes_bytes)
    manifest_path = out / MANIFEST_FILE
    earlier = read_json(manifest_path, "manifest") if manifest_path.exists() else {}
    manifest = {
        "format": FORMAT,
        "classes": file_entry(CLASSES_FILE, classes_bytes),
        "source": source or {},
    }
    if earlier.get("format") == FORMAT:  # splits packed by an earlier command
        manifest.update({role: earlier[role] for role in ("train", "val") if role in earlier})
    for report in reports:
        manifest[report.role] = {
            "samples": report.samples,
            "settings": report.settings,
            "label_fill": report.label_fill,
            "labels": report.labels,
            "shards": [
                {k: entry[k] for k in ("name", "samples", "sha256", "bytes")} for entry in report.shards
            ],
            "skipped": report.skipped,
        }
    atomic_write_bytes(manifest_path, (json.dumps(manifest, indent=1) + "\n").encode())
