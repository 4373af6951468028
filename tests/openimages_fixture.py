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

from data_fixtures import write_jpeg

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
