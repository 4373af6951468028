"""Trust in packed shards: the checks at open (sidecar hashes, sizes, counts, the format version),
``mlcls-data verify``, the pack's recovery (torn progress line, atomic sidecars, other settings) and
``dataset=shards dataset.root=DIR`` with the source's settings as defaults."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from hostile import bounded
from test_data_shards import URLS, pack_synthetic, packed  # noqa: F401 (the module fixture)

from mlcls.cli.data import main as data_main
from mlcls.data import DatasetFormatError, build_dataset
from mlcls.data.datasets.labels import SparseLabels
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.pipeline.transforms import build_transform
from mlcls.data.shards import pack as pack_module
from mlcls.data.shards.datasets import ShardEvalSet, open_shards
from mlcls.data.shards.pack import pack_split, write_sidecars

pytest.importorskip("webdataset")


@pytest.fixture
def copy(packed: Path, tmp_path: Path) -> Path:  # noqa: F811
    """A copy of the packed synthetic folder, to damage."""
    return Path(shutil.copytree(packed, tmp_path / "copy"))


def one_class_labels(folder: Path, role: str) -> bytes:
    """The sidecar of ``role`` with every sample labelled with class 0 alone (same shape, other rows)."""
    rows = SparseLabels.from_bytes((folder / f"{role}-labels.npz").read_bytes())
    dense = torch.zeros(rows.shape)
    dense[:, 0] = 1
    return SparseLabels.from_dense(dense).to_bytes()


def record(folder: Path, role: str, data: bytes) -> None:
    """Replace ``role``'s labels sidecar by ``data`` and record it in the manifest, as a consistent but
    wrong pack would have."""
    (folder / f"{role}-labels.npz").write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest[role]["labels"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_labels_sidecar_not_the_packed_one_fails_at_open_in_one_line(
    packed: Path,  # noqa: F811
    copy: Path,
    capsys,
) -> None:
    (copy / "train-labels.npz").write_bytes(one_class_labels(copy, "train"))
    with pytest.raises(DatasetFormatError, match=r"train-labels.npz is not the file manifest.json records"):
        open_shards("train", root=str(copy))
    assert data_main(["stats", "dataset=shards", f"dataset.root={copy}", "--split", "train"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "train-labels.npz is not the file manifest.json records" in error
    # Another length, the manifest's record updated too: the shape is checked against the sample count.
    shorter = SparseLabels.from_bytes((packed / "train-labels.npz").read_bytes())
    record(copy, "train", shorter.rows(np.arange(89)).to_bytes())
    with pytest.raises(DatasetFormatError, match=r"train-labels.npz holds 89 x 12 labels .* 90 samples"):
        open_shards("train", root=str(copy))


def test_val_shards_whose_labels_differ_from_the_sidecar_fail_at_open(copy: Path) -> None:
    record(copy, "val", one_class_labels(copy, "val"))
    with pytest.raises(DatasetFormatError, match="labels in the val shards differ from .*val-labels.npz"):
        open_shards("val", root=str(copy))


def test_verify_reads_every_shard_against_the_manifest(copy: Path, capsys) -> None:
    assert data_main(["verify", str(copy)]) == 0
    assert "every shard and sidecar is as packed" in capsys.readouterr().out
    shard = copy / "train-000002.tar"
    data = bytearray(shard.read_bytes())
    data[3000] ^= 0x01  # one bit of a JPEG: the tar still reads, its size is the same
    shard.write_bytes(bytes(data))
    record(copy, "val", one_class_labels(copy, "val"))  # a sidecar recorded but wrong
    assert data_main(["verify", str(copy)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines  # the flipped shard; each of the two val shards' rows
    assert lines[0].startswith(f"{shard}: sha256 or size differs from the manifest's")
    assert all("label rows differ from those of val-labels.npz" in line for line in lines[1:])
    os.remove(copy / "train-000001.tar")
    assert data_main(["verify", str(copy)]) == 1
    assert "train-000001.tar" in capsys.readouterr().out
    assert data_main(["verify", str(copy), "x=1"]) == 2


def test_shards_without_a_pack_format_are_one_line(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["format"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DatasetFormatError, match=r"of pack format None; this mlcls reads format 2 \(pack the dataset again\)"
    ):
        open_shards("train", str(copy / URLS))


def test_a_torn_progress_line_is_packed_again(tmp_path: Path) -> None:
    dataset = SyntheticMultiLabel("val", val_size=30, canvas_size=64)
    first = pack_split(dataset, tmp_path, "val", 10, 48, progress=False)
    progress = tmp_path / ".val-progress.jsonl"
    lines = progress.read_text().splitlines()
    progress.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])  # the last entry cut mid-write
    again = pack_split(dataset, tmp_path, "val", 10, 48, progress=False)
    assert (again.kept, again.written) == (2, 1) and again.shards == first.shards
    assert [json.loads(line) for line in progress.read_text().splitlines()] == [
        json.loads(line) for line in lines
    ]


def crash_in_fsync(monkeypatch) -> None:
    def fsync(fd: int) -> None:
        raise KeyboardInterrupt  # the file written, not yet on disk

    monkeypatch.setattr(os, "fsync", fsync)


def test_sidecars_are_written_atomically(copy: Path, monkeypatch) -> None:
    before = {
        name: (copy / name).read_bytes() for name in ("manifest.json", "classes.json", "val-labels.npz")
    }
    dataset = SyntheticMultiLabel("val", val_size=30, canvas_size=64, name="synthetic")
    report = pack_split(dataset, copy, "val", 25, 48, progress=False)
    assert report.kept == 2  # the same settings as the fixture's pack
    crash_in_fsync(monkeypatch)
    with pytest.raises(KeyboardInterrupt):  # classes.json, then manifest.json
        write_sidecars(copy, dataset, {"val": "val"}, [report], 48, 90, "auto", {"image_size": 1})
    with pytest.raises(KeyboardInterrupt):
        pack_module.atomic_write_bytes(copy / "val-labels.npz", b"half")
    monkeypatch.undo()
    assert {name: (copy / name).read_bytes() for name in before} == before
    assert not list(copy.glob(".*.tmp"))


def test_shards_config_reads_the_folder_and_the_sources_settings(packed: Path, capsys) -> None:  # noqa: F811
    cfg = compose_config(["dataset=shards", f"dataset.root={packed}"])
    assert (cfg.dataset.image_size, cfg.dataset.transform) == (64, "light")  # the synthetic config's
    train, val = build_dataset(cfg.dataset, train=True), build_dataset(cfg.dataset, train=False)
    assert (len(train), len(val)) == (90, 30)
    assert repr(train.transform) == repr(build_transform("light", 64, train=True))  # at the source's size
    assert isinstance(val, ShardEvalSet) and val._dense_labels is None  # the labels kept sparse
    expected = SyntheticMultiLabel("val", val_size=30).labels
    torch.testing.assert_close(torch.stack([val.target(i) for i in range(30)]), expected)
    explicit = compose_config(["dataset=shards", f"dataset.root={packed}", "dataset.image_size=32"])
    assert explicit.dataset.image_size == 32
    assert compose_config(["dataset=shards", "dataset.root=/nowhere"]).dataset.image_size == 224


def test_pack_prints_a_train_command_with_the_sources_model(tmp_path: Path, capsys) -> None:
    assert pack_synthetic(tmp_path / "out") == 0
    printed = capsys.readouterr().out
    assert (
        f"train with: mlcls-train dataset=shards dataset.root={tmp_path / 'out'} model.name=resnet10t "
        "model.pretrained=false\n"
    ) in printed


BOMB_ZEROS = 256  # MiB of zeros behind the bomb's columns.npy header (~0.25 MB deflated)


@pytest.fixture(scope="module")
def labels_bomb(packed: Path) -> bytes:  # noqa: F811
    """The training labels sidecar with its ``columns`` array a deflate bomb: a valid ``.npy`` header of
    64 M int32 entries and their 256 MiB of zeros, deflated; the other arrays as packed."""
    buffer = io.BytesIO()
    with (
        zipfile.ZipFile(packed / "train-labels.npz") as source,
        zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bomb,
    ):
        for info in source.infolist():
            if info.filename != "columns.npy":
                bomb.writestr(info.filename, source.read(info))
        with bomb.open("columns.npy", "w") as member:
            header = {"descr": "<i4", "fortran_order": False, "shape": (BOMB_ZEROS << 18,)}
            np.lib.format.write_array_header_1_0(member, header)
            zeros = bytes(1 << 20)
            for _ in range(BOMB_ZEROS):
                member.write(zeros)
    return buffer.getvalue()


def declared_size(data: bytes, name: str, size: int) -> bytes:
    """The zip ``data`` with the central directory's uncompressed size of member ``name`` set to ``size``
    (a header that lies: the member's stream holds more)."""
    end_record = data.rindex(b"PK\x05\x06")
    entry = int.from_bytes(data[end_record + 16 : end_record + 20], "little")  # the central directory's start
    while True:
        name_length, extra, comment = (
            int.from_bytes(data[entry + k : entry + k + 2], "little") for k in (28, 30, 32)
        )
        if data[entry + 46 : entry + 46 + name_length] == name.encode():
            break
        entry += 46 + name_length + extra + comment
    return data[: entry + 24] + size.to_bytes(4, "little") + data[entry + 28 :]


def peak_of(call) -> tuple[object, int]:
    """``call()``'s result (or the exception it raised) and the peak of memory it allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 (returned, the caller asserts on it)
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("lying", [False, True], ids=["declared", "lying-header"])
def test_a_deflate_bomb_labels_sidecar_is_one_line_in_bounded_memory(
    copy: Path, labels_bomb: bytes, lying: bool, capsys
) -> None:
    assert len(labels_bomb) < 2 << 20  # a bomb: 256 MiB of array in under 2 MB
    bomb = declared_size(labels_bomb, "columns.npy", 1000) if lying else labels_bomb
    record(copy, "train", bomb)  # the manifest consistent with it (bytes, sha256)
    expected = "Bad CRC-32" if lying else r"columns.npy declares 268435584 bytes, more than 1080 integers"
    error, peak = peak_of(lambda: open_shards("train", root=str(copy)))
    assert peak < 64 << 20 and isinstance(error, DatasetFormatError), (peak, error)
    assert re.search(f"cannot read the labels {copy}/train-labels.npz: .*{expected}", str(error))
    assert "\n" not in str(error)
    status, peak = peak_of(lambda: data_main(["verify", str(copy)]))
    lines = capsys.readouterr().out.splitlines()
    assert status == 1 and peak < 64 << 20, (status, peak)
    assert len(lines) == 1 and re.search(f"{copy}/train-labels.npz: .*{expected}", lines[0]), lines


def set_field(manifest: dict, path: str, value: object) -> None:
    """``manifest`` with the field at ``path`` (``train.shards.0.bytes``) set to ``value``."""
    *parents, last = path.split(".")
    node = manifest
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("train.samples", "90", "train.samples"),  # TypeError: sum() vs str
        ("train.samples", -1, "train.samples"),
        ("train.shards.0.bytes", None, r"train.shards\[0\].bytes"),
        ("train.shards.1.samples", 2.5, r"train.shards\[1\].samples"),
        ("train.shards.2.name", 7, r"train.shards\[2\].name"),
        ("train.shards.3", "train-000003.tar", r"train.shards\[3\] is not an object"),
        ("train.shards", {"name": "train-000000.tar"}, "train.shards is not a list"),
        ("train.labels", "train-labels.npz", "train.labels is not an object"),
        ("val.labels.sha256", None, "val.labels.sha256"),
        ("val.label_fill", "0", "val.label_fill"),
        ("val", [], "val is not an object"),
        ("classes.name", ["classes.json"], "classes.name"),
        ("val.shards.1.name", "val-000000.tar", r"val.shards\[1\].name 'val-000000.tar' is listed twice"),
    ],
)
def test_manifest_fields_of_the_wrong_type_are_one_line_naming_the_field(
    copy: Path, path: str, value: object, field: str, capsys
) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    set_field(manifest, path, value)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert data_main(["verify", str(copy)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and re.match(f"{copy}/manifest.json: {field}", lines[0]), lines
    with pytest.raises(DatasetFormatError, match=f"manifest.json: {field}"):
        open_shards("val", root=str(copy))


def test_labels_sidecar_arrays_of_floats_are_one_line(packed: Path, copy: Path) -> None:  # noqa: F811
    labels = SparseLabels.from_bytes((packed / "train-labels.npz").read_bytes())
    labels.offsets = labels.offsets.astype(np.float64)  # the same row offsets, as floats
    record(copy, "train", labels.to_bytes())
    with pytest.raises(DatasetFormatError, match="train-labels.npz: row offsets, .* 1-D integer arrays"):
        open_shards("train", root=str(copy))


def test_classes_json_without_a_list_of_names_is_one_line(copy: Path) -> None:
    info = json.loads((copy / "classes.json").read_text())
    info["classes"] = "".join(info["classes"])  # a string: list() of it made one class per character
    data = json.dumps(info).encode()
    (copy / "classes.json").write_bytes(data)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["classes"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetFormatError, match="classes.json holds no list of class names"):
        open_shards("train", root=str(copy))


def test_shard_url_patterns_expand_as_written(monkeypatch) -> None:
    from mlcls.data import DatasetConfigError
    from mlcls.data.shards import reader
    from mlcls.data.shards.reader import expand_urls

    assert expand_urls("s/train-{000000..000003}.tar") == [f"s/train-{i:06d}.tar" for i in range(4)]
    assert expand_urls(["a-{0..8..4}.tar", "b-{1,2}.tar"]) == [
        "a-0.tar",
        "a-4.tar",
        "a-8.tar",
        "b-1.tar",
        "b-2.tar",
    ]
    assert len(expand_urls("x-{0..99}-{0..99}.tar")) == 10_000
    monkeypatch.setattr(reader, "MAX_SHARD_URLS", 1000)  # 200 values in its ranges, 10,000 URLs expanded
    with pytest.raises(DatasetConfigError, match=r"expand to over 1,000 shards; expected one pattern"):
        expand_urls("x-{0..99}-{0..99}.tar")


@pytest.mark.slow  # in a forked child: the old expansion did not end in 100 s
@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("x-{0..999999999999}.tar", "expand to over 1,000,000 shards"),
        ("x-{0..2000000}.tar", "expand to over 1,000,000 shards"),
        ("x-{0.." + "9" * 5000 + "}.tar", "expand to over 1,000,000 shards"),
        ("x-{0..3.tar", "have unbalanced braces; expected a pattern such as 'train-{000000..000123}.tar'"),
    ],
)
def test_a_shard_url_pattern_of_too_many_shards_is_one_line_at_once(pattern: str, message: str) -> None:
    from hostile import bounded

    from mlcls.data.shards.reader import expand_urls

    outcome = bounded(expand_urls, pattern, memory_mb=512, seconds=5)
    assert not outcome.escaped, outcome
    assert outcome.error == "DatasetConfigError" and "\n" not in outcome.message, outcome
    assert outcome.message.startswith("the shard URLs ") and message in outcome.message


@pytest.mark.parametrize("sidecar", ["manifest.json", "train-labels.npz"])
def test_a_sidecar_past_its_cap_is_one_line_before_it_is_read(copy: Path, sidecar: str) -> None:
    """The manifest is read within ``CAPS["manifest"]``, a labels sidecar within the size the manifest
    records (old: either was read whole, here 64 MiB or 256 MiB of a sparse file)."""
    from mlcls.io import CAPS

    path = copy / sidecar
    grown = CAPS["manifest"] + 1 if sidecar == "manifest.json" else path.stat().st_size + (64 << 20)
    with open(path, "r+b") as f:
        f.truncate(grown)
    error, peak = peak_of(lambda: open_shards("train", root=str(copy)))
    assert peak < 16 << 20, peak
    assert str(path) in str(error) and "\n" not in str(error), error


HUGE = 150_000_000


@pytest.mark.slow  # forks a bounded child
@pytest.mark.parametrize("where", ["folder", "pipe"])
def test_a_manifest_declaring_150_million_samples_is_one_line_before_any_row_index(
    copy: Path, where: str
) -> None:
    """The first train shard's record and the split's count raised by 150,000,000 samples (the sidecar's
    shape unchanged). From the folder: more samples than the shard's recorded bytes hold. Through ``pipe:``
    URLs (sizes not checked until streamed), the shard's bytes raised to match: the sidecar's shape. Old:
    a row index of the declared count was built before the sidecar was read (3.08 GB in mlcls-train): a
    MemoryError under a 256 MB cap."""
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["train"]["samples"] += HUGE
    shard = manifest["train"]["shards"][0]
    shard["samples"] += HUGE
    if where == "pipe":
        shard["bytes"] = shard["samples"] * 2048
    (copy / "manifest.json").write_text(json.dumps(manifest))
    if where == "folder":
        opened = lambda: open_shards("train", root=str(copy))  # noqa: E731
        expected = f"train.shards[0] records {shard['samples']} samples in {shard['bytes']} bytes; at most"
    else:
        urls = [f"pipe:cat {copy / entry['name']}" for entry in manifest["train"]["shards"]]
        opened = lambda: open_shards("train", urls, meta=str(copy))  # noqa: E731
        expected = "train-labels.npz holds 90 x "  # the sidecar's rows, then the manifest's 150,000,090
    outcome = bounded(opened, memory_mb=256, seconds=20)
    assert not outcome.escaped and outcome.error == "DatasetFormatError", outcome
    assert "\n" not in outcome.message and expected in outcome.message, outcome.message
