"""The one layout number of checkpoints and packs (mlcls/formats.py): what a reader accepts and refuses,
each refusal in one line. No mlcls was released before format 2, so no other format is read."""

from __future__ import annotations

import re

import pytest
import torch

from mlcls.data.datasets.base import DatasetFormatError
from mlcls.engine.checkpoint import load_checkpoint, save_checkpoint
from mlcls.engine.state import CheckpointError
from mlcls.formats import FORMAT, check_format


def written(tmp_path, **state):
    """A checkpoint file holding ``state`` as torch.save writes it, without save_checkpoint's format."""
    path = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.zeros(2)}, **state}, path)
    return path


def test_a_checkpoint_written_now_holds_the_current_format_and_reads_back(tmp_path):
    save_checkpoint({"model": {}}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["format"] == FORMAT == 2
    assert load_checkpoint(tmp_path / "c.pt")["format"] == 2


def test_a_checkpoint_without_a_format_is_one_line(tmp_path):
    # before: read as format 1, its config's old key names upgraded
    old = {"dataset": {"name": "csv", "holdout": "stratified"}, "sched": {"warmup_iters": 5}}
    path = written(tmp_path, config=old)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    assert (
        str(error.value)
        == f"checkpoint {path} is of checkpoint format None; this mlcls reads format 2 (train again)"
    )


@pytest.mark.parametrize(
    ("stored", "remedy"),
    [
        (3, "a newer mlcls wrote it: upgrade mlcls"),
        (1, "train again"),
        ("2", "train again"),
        (True, "train again"),
        (0, "train again"),
        (2.0, "train again"),
        (None, "train again"),
    ],
)
def test_a_checkpoint_of_another_format_is_one_line(tmp_path, stored, remedy):
    path = written(tmp_path, format=stored)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    assert str(error.value) == (
        f"checkpoint {path} is of checkpoint format {stored!r}; this mlcls reads format 2 ({remedy})"
    )


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({}, "m.json is of pack format None; this mlcls reads format 2 (pack the dataset again)"),
        ({"format": 1}, "m.json is of pack format 1; this mlcls reads format 2 (pack the dataset again)"),
        ({"format": 7}, "m.json is of pack format 7; this mlcls reads format 2 (a newer mlcls wrote it"),
    ],
)
def test_a_pack_manifest_of_another_format_is_one_line(manifest, message):
    with pytest.raises(DatasetFormatError, match=f"^{re.escape(message)}"):
        check_format(manifest, "pack", "m.json", DatasetFormatError)


def test_a_current_pack_manifest_comes_back_unchanged():
    manifest = {"format": 2, "train": {"samples": 3}}
    assert check_format(dict(manifest), "pack", "m.json", DatasetFormatError) == manifest
