"""mlcls-predict format=captions: caption files beside the images, most probable tag first, existing files
kept, replaced or extended as asked, read back by dataset=captions as written."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mlcls.data.datasets.captions import CaptionFolder
from mlcls.errors import InferenceError
from mlcls.inference.captions import CaptionsWritten, check_tags, write_captions
from mlcls.inference.predictor import Prediction


def predictions(folder: Path) -> list[Prediction]:
    """Three images (one nested, one of two dots) and their labels by decreasing probability."""
    (folder / "sub").mkdir(parents=True)
    labelled = {
        "a.jpg": [("smile", 0.9), ("1girl", 0.8), ("long hair", 0.6)],
        "sub/b.png": [("cat", 0.7)],
        "c.v2.webp": [],
    }
    for image in labelled:
        (folder / image).write_bytes(b"image")
    return [Prediction(str(folder / image), labels) for image, labels in labelled.items()]


def test_tags_are_written_beside_each_image_and_read_back_alike(tmp_path):
    written = write_captions(predictions(tmp_path))
    assert written == CaptionsWritten(3, 0, 0)
    assert (tmp_path / "a.txt").read_text() == "smile, 1girl, long hair\n"
    assert (tmp_path / "sub/b.txt").read_text() == "cat\n"
    assert (tmp_path / "c.v2.txt").read_text() == "\n"
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    dataset = CaptionFolder("train", root=str(tmp_path), val_fraction=0.0)
    read = {
        Path(s.path).name: {dataset.classes[c] for c in np.flatnonzero(row.numpy() == 1)}
        for s, row in zip(dataset.samples, dataset.labels, strict=True)
    }
    assert read == {"a.jpg": {"smile", "1girl", "long hair"}, "b.png": {"cat"}, "c.v2.webp": set()}


def test_other_separator_and_suffix(tmp_path):
    write_captions(predictions(tmp_path), caption_ext=".caption", separator="|")
    assert (tmp_path / "a.caption").read_text() == "smile|1girl|long hair\n"


def test_an_existing_caption_is_kept_replaced_or_extended(tmp_path):
    made = predictions(tmp_path)
    (tmp_path / "a.txt").write_text("1girl, outdoors\n")
    assert write_captions(made) == CaptionsWritten(2, 0, 1)
    assert (tmp_path / "a.txt").read_text() == "1girl, outdoors\n"
    assert write_captions(made, append=True) == CaptionsWritten(0, 3, 0)
    # its own tags first, then the predicted ones it lacks, by probability
    assert (tmp_path / "a.txt").read_text() == "1girl, outdoors, smile, long hair\n"
    assert (tmp_path / "sub/b.txt").read_text() == "cat\n"
    assert write_captions(made, overwrite=True) == CaptionsWritten(3, 0, 0)
    assert (tmp_path / "a.txt").read_text() == "smile, 1girl, long hair\n"


def test_what_a_caption_file_cannot_hold_is_one_line(tmp_path):
    with pytest.raises(
        InferenceError, match=r"class 'a, b' cannot be written in a caption file separated by ','"
    ):
        check_tags(["cat", "a, b"], ",")
    with pytest.raises(InferenceError, match="class 'x\\\\ny' cannot be written"):
        check_tags(["x\ny"], "|")
    with pytest.raises(InferenceError, match="overwrite=true and append=true: choose one"):
        write_captions(predictions(tmp_path), overwrite=True, append=True)
