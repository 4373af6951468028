"""Trust in packed shards: the checks at open (sidecar hashes, sizes, counts, the format version),
``mlcls-data verify``, the pack's recovery (torn progress line, atomic sidecars, other settings) and
``dataset=shards dataset.root=DIR`` with the source's settings as defaults."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from test_data_shards import URLS, pack_synthetic, packed  # noqa: F401 (the module fixture)

from mlcls.cli.data import main as data_main
from mlcls.data import DatasetFormatError, build_dataset
from mlcls.data.datasets.labels import SparseLabels
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
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


def test_shards_of_an_older_pack_format_are_one_line(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["format"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DatasetFormatError, match="pack format 1, this mlcls reads format 2; pack the dataset"
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
    assert (len(train), len(val), train.image_size) == (90, 30, 64)
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
