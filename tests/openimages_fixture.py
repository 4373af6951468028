"""A tiny Open Images V6 in the official file format (CSV names, headers, 16-digit hexadecimal ImageIDs).

Classes (trainable-list order, not the descriptions' order) and the labels the files imply, written out
so that tests restate them as literals:

    classes = ["Dog", "Cat", "Bass (/m/bass_fish)", "Bass (/m/bass_guitar)", "Car"]

    train (sorted by ImageID; 00000000000000d4 has only a non-trainable label and is left out)
        000000000000000b  [ 1, -1, -1, -1,  1]   Dog verified twice as 1
        0000000000000a01  [ 1,  0, -1, -1, -1]   plus Tree (not trainable)
        0000000000000c03  [-1, -1,  0, -1, -1]   Cat verified both 1 and 0: unknown
        f00000000000000e  [-1,  0, -1,  1, -1]   its JPEG is missing
    validation
        1000000000000001  [ 0,  1, -1, -1, -1]
        1000000000000002  [-1, -1, -1, -1,  0]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from data_fixtures import write_jpeg
from PIL import Image

DESCRIPTIONS = [
    ("/m/cat", "Cat"),
    ("/m/tree", "Tree"),
    ("/m/dog", "Dog"),
    ("/m/bass_fish", "Bass"),
    ("/m/bass_guitar", "Bass"),
    ("/m/car", "Car"),
]
TRAINABLE = ["/m/dog", "/m/cat", "/m/bass_fish", "/m/bass_guitar", "/m/car"]
# (ImageID, Source, LabelName, Confidence), in the unsorted order of a real file.
TRAIN_LABELS = [
    ("0000000000000a01", "verification", "/m/dog", "1"),
    ("0000000000000a01", "crowdsource-verification", "/m/cat", "0"),
    ("0000000000000a01", "verification", "/m/tree", "1"),
    ("f00000000000000e", "verification", "/m/cat", "0"),
    ("f00000000000000e", "verification", "/m/bass_guitar", "1"),
    ("000000000000000b", "verification", "/m/car", "1"),
    ("000000000000000b", "verification", "/m/dog", "1"),
    ("000000000000000b", "crowdsource-verification", "/m/dog", "1"),
    ("0000000000000c03", "verification", "/m/cat", "1"),
    ("0000000000000c03", "crowdsource-verification", "/m/cat", "0"),
    ("0000000000000c03", "verification", "/m/bass_fish", "0"),
    ("00000000000000d4", "verification", "/m/tree", "1"),
]
VALIDATION_LABELS = [
    ("1000000000000002", "verification", "/m/car", "0"),
    ("1000000000000001", "verification", "/m/cat", "1"),
    ("1000000000000001", "verification", "/m/dog", "0"),
]
MISSING_IMAGE = "f00000000000000e"
LABEL_FILES = {
    "train": "oidv6-train-annotations-human-imagelabels.csv",
    "validation": "validation-annotations-human-imagelabels.csv",
}


def write_openimages(root: Path) -> Path:
    """Write the fixture under ``root`` (CSVs at the top, JPEGs in ``train/`` and ``validation/``)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = ["LabelName,DisplayName", *(f"{mid},{name}" for mid, name in DESCRIPTIONS)]
    (root / "oidv6-class-descriptions.csv").write_text("\n".join(lines) + "\n")
    (root / "oidv6-classes-trainable.txt").write_text("\n".join(TRAINABLE) + "\n")
    for split, rows in (("train", TRAIN_LABELS), ("validation", VALIDATION_LABELS)):
        text = "ImageID,Source,LabelName,Confidence\n" + "".join(",".join(row) + "\n" for row in rows)
        (root / LABEL_FILES[split]).write_text(text)
        for image_id in sorted({row[0] for row in rows} - {MISSING_IMAGE}):
            write_jpeg(root / split / f"{image_id}.jpg")
    return root


def write_generated_openimages(
    root: Path, train: int = 64, validation: int = 20, classes: int = 12, seed: int = 0
) -> tuple[Path, dict[str, list[list[float]]]]:
    """Write a larger Open Images in the official format, with random human-verified labels, for training.

    Each image gets 1-3 positive verifications and 1-6 negative ones among ``classes`` trainable classes
    (one more, non-trainable class appears in the descriptions and labels); each image's JPEG has the
    colour of its first positive class plus noise, so a model can learn something and no two images tie.
    Returns ``(root, rows)`` with the
    (N, C) 1 / 0 / -1 rows each split must yield, in ImageID order, computed here from the drawn labels.
    """
    import random

    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    names = [f"/m/gen{c:03d}" for c in range(classes)]
    root.mkdir(parents=True, exist_ok=True)
    lines = ["LabelName,DisplayName", "/m/other,Other", *(f"{mid},Class {c}" for c, mid in enumerate(names))]
    (root / "oidv6-class-descriptions.csv").write_text("\n".join(lines) + "\n")
    (root / "oidv6-classes-trainable.txt").write_text("\n".join(names) + "\n")
    expected: dict[str, list[list[float]]] = {}
    for split, count in (("train", train), ("validation", validation)):
        rows, text = [], ["ImageID,Source,LabelName,Confidence"]
        ids = sorted(rng.sample(range(1, 2**40), count))
        for image_id in ids:
            picked = rng.sample(range(classes), rng.randint(2, 7))
            positives = picked[: rng.randint(1, min(3, len(picked) - 1))]
            row = [-1.0] * classes
            for c in picked:
                row[c] = 1.0 if c in positives else 0.0
                text.append(f"{image_id:016x},verification,{names[c]},{int(row[c])}")
            text.append(f"{image_id:016x},verification,/m/other,1")
            rows.append(row)
            hue = 255 * positives[0] // classes
            base = np.array([hue, 255 - hue, 128], dtype=np.float32)
            noise = np_rng.normal(0, 25, (30, 40, 3))  # every image distinct: no tied scores
            path = root / split / f"{image_id:016x}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(path, quality=95)
        body = text[1:]
        rng.shuffle(body)  # a real file is not sorted by image
        (root / LABEL_FILES[split]).write_text("\n".join([text[0], *body]) + "\n")
        expected[split] = rows
    return root, expected
