"""CUB-200-2011 attributes from the release's layout: 312 attribute classes, is_present as the label,
the official train/test flag, the release's malformed label lines, one-line errors, and training under the
single-positive regime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlcls.data import build_dataset
from mlcls.data.datasets import cub as cub_module
from mlcls.data.datasets.base import DatasetConfigError, DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.cub import CUB

NAMES = [f"has_part_{j}::colour_{j % 15}" for j in range(1, 313)]
# image_id -> (path, is_training_image); ids out of order in images.txt, as a file may list them
IMAGES = {
    4: ("002.Laysan_Albatross/Laysan_0004.jpg", 1),
    1: ("001.Black_footed_Albatross/Black_0001.jpg", 1),
    2: ("001.Black_footed_Albatross/Black_0002.jpg", 0),
    7: ("003.Sooty_Albatross/Sooty_0007.jpg", 1),
    3: ("002.Laysan_Albatross/Laysan_0003.jpg", 0),
}
# the malformed lines: (image_id, attribute_id) -> the line, with extra fields after is_present
MALFORMED = {(7, 5): "7 5 1 0 0 3 12.25", (2, 312): "2 312 0 1 1 4 7.5"}


def truth() -> dict[int, np.ndarray]:
    """The (312,) 0 / 1 is_present row the fixture writes for each image_id."""
    rng = np.random.default_rng(3)
    rows = {image_id: (rng.random(312) < 0.1).astype(np.float32) for image_id in sorted(IMAGES)}
    rows[7][4] = 1.0  # the malformed lines' is_present
    rows[2][311] = 0.0
    return rows


def write_cub(root: Path) -> Path:
    """A tiny CUB_200_2011.tgz as it unpacks under ``root``, with :func:`truth`'s labels."""
    base = root / "CUB_200_2011"
    (base / "attributes").mkdir(parents=True)
    (root / "attributes.txt").write_text("".join(f"{j} {name}\n" for j, name in enumerate(NAMES, start=1)))
    (base / "images.txt").write_text("".join(f"{i} {path}\n" for i, (path, _) in IMAGES.items()))
    (base / "train_test_split.txt").write_text("".join(f"{i} {flag}\n" for i, (_, flag) in IMAGES.items()))
    lines = []
    for image_id, row in truth().items():
        for j, present in enumerate(row.tolist(), start=1):
            # certainty 1..4 and a time: read by no one
            default = f"{image_id} {j} {int(present)} {1 + (j + image_id) % 4} {j * 0.5:.3f}"
            lines.append(MALFORMED.get((image_id, j), default))
    (base / "attributes/image_attribute_labels.txt").write_text("\n".join(lines) + "\n")
    for image_id, (path, _) in IMAGES.items():
        (base / "images" / path).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), (image_id * 30, 90, 160)).save(base / "images" / path)
    return root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return write_cub(tmp_path / "cub")


def test_classes_labels_and_official_split(root: Path) -> None:
    rows = truth()
    for split, flag in (("train", 1), ("test", 0)):
        data = CUB(split, root=str(root))
        ids = [i for i, (_, f) in IMAGES.items() if f == flag]  # images.txt order
        assert data.classes == NAMES and data.num_classes == 312
        assert data.labels.numpy().tolist() == [rows[i].tolist() for i in ids]
        assert [Path(s.path) for s in data.samples] == [
            root / "CUB_200_2011/images" / IMAGES[i][0] for i in ids
        ]
    # the malformed lines count by their first three fields: image 7's attribute 5 present, 2's 312 absent
    assert (
        CUB("train", root=str(root)).labels[2, 4] == 1.0 and CUB("test", root=str(root)).labels[0, 311] == 0
    )


def test_attribute_names_under_attributes_folder(root: Path) -> None:
    (root / "attributes.txt").rename(root / "CUB_200_2011/attributes/attributes.txt")
    assert CUB("test", root=str(root)).classes == NAMES


def test_config_builds_both_splits_with_every_dataset_key(root: Path) -> None:
    from conftest import compose_config

    cfg = compose_config(["dataset=cub"]).dataset
    voc = compose_config(["dataset=voc2012"]).dataset
    assert set(voc) - {"year", "difficult"} <= set(cfg)
    cfg.root, cfg.image_size, cfg.observed = str(root), 16, "single_positive"
    train, test = build_dataset(cfg, train=True), build_dataset(cfg, train=False)
    assert (len(train), len(test)) == (3, 2)
    rows = truth()
    for index, image_id in enumerate((4, 1, 7)):
        image, target = train[index]
        assert image.shape == (3, 16, 16)
        assert (target == 1).sum() == 1 and (target == 0).sum() == 0  # one positive, the rest unknown
        assert rows[image_id][target.numpy() == 1].tolist() == [1.0]  # a true positive
    assert test[1][1].tolist() == rows[3].tolist()  # evaluation reads the full labels


def rewrite(path: Path, old: str, new: str) -> None:
    """Replace the first ``old`` of the file ``path`` by ``new``."""
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_the_fast_reader_and_the_line_reader_agree(root: Path, monkeypatch) -> None:
    """A valid file (extra fields on the release's malformed lines, blank lines) is read by NumPy alone;
    both readers give :func:`truth`'s labels."""
    labels = root / "CUB_200_2011/attributes/image_attribute_labels.txt"
    labels.write_text("\n" + labels.read_text().replace("\n1 9 ", "\n\n1 9 ") + "\n\n")
    ids = sorted(IMAGES)
    expected = np.stack([truth()[i] for i in ids])
    assert np.array_equal(cub_module.read_labels_by_line(labels, ids), expected)

    def refuse(*args):
        raise AssertionError("the line reader ran")

    monkeypatch.setattr(cub_module, "read_labels_by_line", refuse)
    assert np.array_equal(cub_module.read_attribute_labels(labels, ids), expected)


def test_layout_and_format_errors(root: Path) -> None:
    with pytest.raises(DatasetConfigError, match="unknown CUB split 'val'"):
        CUB("val", root=str(root))
    with pytest.raises(
        DatasetLayoutError, match=r"missing .*nowhere/CUB_200_2011/images\.txt; expected layout"
    ):
        CUB("train", root=str(root / "nowhere"))
    labels = root / "CUB_200_2011/attributes/image_attribute_labels.txt"
    original = labels.read_text()
    lines = original.splitlines()
    cases = {  # line 7 (image 1, attribute 7) -> the error
        "1 313 0 1 2.0": r"line 7: '1 313 0 1 2\.0': attribute_id 313 is outside 1\.\.312",
        "1 0 0 1 2.0": r"line 7: .*attribute_id 0 is outside 1\.\.312",
        "1 7 2 1 2.0": r"line 7: .*is_present 2; expected 0 or 1",
        "9 7 0 1 2.0": r"line 7: .*image_id 9 is not in images\.txt",
        "1 7": r"line 7: '1 7'; expected '<image_id> <attribute_id> <is_present> <certainty_id> <time>'",
        "1 seven 0 1 2.0": r"line 7: '1 seven 0 1 2\.0'; expected '<image_id>",
        "1 6 0 1 2.0": r"line 7: .*image_id 1, attribute_id 6 was given before; expected one line each",
    }
    for line, message in cases.items():
        labels.write_text("\n".join([*lines[:6], line, *lines[7:]]) + "\n")
        with pytest.raises(DatasetFormatError, match=rf"image_attribute_labels\.txt, {message}"):
            CUB("train", root=str(root))
    labels.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(DatasetFormatError, match=r"no line for image_id 7, attribute_id 312; expected one"):
        CUB("train", root=str(root))
    labels.write_text(original)
    rewrite(root / "CUB_200_2011/train_test_split.txt", "3 0", "3 2")
    with pytest.raises(DatasetFormatError, match=r"train_test_split\.txt: image_id 3 has '2'; expected"):
        CUB("train", root=str(root))
    rewrite(root / "CUB_200_2011/train_test_split.txt", "3 2\n", "")
    with pytest.raises(DatasetFormatError, match=r"train_test_split\.txt: image_id 3 has no line"):
        CUB("train", root=str(root))
    rewrite(root / "CUB_200_2011/images.txt", "3 002", "1 002")
    with pytest.raises(
        DatasetFormatError, match=r"images\.txt: image_id 1 is listed twice; expected one line"
    ):
        CUB("train", root=str(root))
    rewrite(root / "attributes.txt", "312 ", "313 ")
    with pytest.raises(DatasetFormatError, match=r"attributes\.txt: 312 attributes; expected the 312 .* ids"):
        CUB("train", root=str(root))
    (root / "attributes.txt").unlink()
    with pytest.raises(DatasetLayoutError, match=r"missing .*cub/attributes\.txt; expected layout"):
        CUB("train", root=str(root))


@pytest.mark.slow
def test_trains_one_epoch_single_positive(root: Path, tmp_path: Path, tiny: list[str]) -> None:
    from conftest import compose_config

    from mlcls.cli.train import run

    overrides = [o for o in tiny if not o.startswith(("dataset", "trainer.epochs", "trainer.batch_size"))]
    cfg = compose_config(
        [
            *overrides,
            "dataset=cub",
            f"dataset.root={root}",
            "dataset.image_size=32",
            "dataset.observed=single_positive",
            "loss=an",
            "trainer.epochs=1",
            "trainer.batch_size=2",
        ]
    )
    results = run(cfg, run_dir=tmp_path / "run")
    facts = json.loads((tmp_path / "run" / "results.json").read_text())["dataset"]
    assert facts == {"name": "cub", "num_classes": 312, "train_size": 3, "val_size": 2}
    assert results["epochs_completed"] == 1
