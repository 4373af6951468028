"""Tiny datasets written in each official layout, for the dataset, stats and training tests.

Every writer documents the labels its fixture implies; the tests restate them as literals, so that a
parser bug cannot be hidden by computing expectations with the parser itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mlcls.bench.pipeline_bench import make_jpegs
from mlcls.data.datasets.base import MultiLabelDataset, Sample

VISPR_ATTRIBUTES = Path("/work/shared/fixtures/vispr/attributes.tsv")
RED, BLUE, GREY = (230, 20, 20), (20, 20, 230), (128, 128, 128)


def write_jpeg(
    path: Path, size: tuple[int, int] = (24, 16), left: tuple = GREY, right: tuple | None = None
) -> Path:
    """A JPEG of ``size`` (width, height): left half ``left``, right half ``right`` (default ``left``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, left)
    if right is not None:
        img.paste(right, (size[0] // 2, 0, size[0], size[1]))
    img.save(path, quality=95)
    return path


def mean_colour(image: Image.Image) -> tuple[float, ...]:
    """Mean RGB of ``image``."""
    return tuple(np.asarray(image, dtype=np.float64).reshape(-1, 3).mean(axis=0).tolist())


def close(colour: tuple, expected: tuple, tolerance: float = 25) -> bool:
    """Every channel of ``colour`` within ``tolerance`` of ``expected`` (JPEG blurs colours a little)."""
    return all(abs(a - b) <= tolerance for a, b in zip(colour, expected, strict=True))


def corrupt(path: Path) -> None:
    """Overwrite ``path`` with bytes no image decoder accepts."""
    path.write_bytes(b"this is not a jpeg" * 10)


def truncate(path: Path) -> None:
    """Cut ``path`` in half: the header reads, the pixels do not."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ---------------------------------------------------------------------------------------------- COCO
COCO_CATEGORIES = [(18, "dog"), (1, "person"), (90, "toothbrush"), (3, "car")]  # file order, not id order
# image id -> [(category id, iscrowd)]
COCO_TRAIN = {42: [(90, 0), (3, 1), (3, 0)], 9: [(1, 0), (1, 0), (18, 0)], 30: [], 25: [(3, 1)]}
COCO_VAL = {7: [], 5: [(18, 0)]}


def write_coco(root: Path, year: int = 2014, image_dirs: tuple[str, str] | None = None) -> Path:
    """COCO instances files. Classes by id: person(1), car(3), dog(18), toothbrush(90).

    train: 9 -> person, dog; 25 -> car (crowd only); 30 -> none; 42 -> car, toothbrush (one crowd car).
    val: 5 -> dog; 7 -> none.
    """
    ann_id = 1
    for split, content in (("train", COCO_TRAIN), ("val", COCO_VAL)):
        folder = root / (image_dirs[split == "val"] if image_dirs else f"{split}{year}")
        images, annotations = [], []
        for image_id, objects in content.items():
            name = f"COCO_{split}{year}_{image_id:012d}.jpg" if year == 2014 else f"{image_id:012d}.jpg"
            write_jpeg(folder / name)
            images.append({"id": image_id, "file_name": name, "width": 24, "height": 16})
            for category, crowd in objects:
                annotations.append(
                    {"id": ann_id, "image_id": image_id, "category_id": category, "iscrowd": crowd,
                     "bbox": [1, 1, 5, 5], "area": 25.0}
                )  # fmt: skip
                ann_id += 1
        categories = [{"id": i, "name": n, "supercategory": "x"} for i, n in COCO_CATEGORIES]
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        payload = {"images": images, "annotations": annotations, "categories": categories}
        (root / "annotations" / f"instances_{split}{year}.json").write_text(json.dumps(payload))
    return root


# ----------------------------------------------------------------------------------------------- VOC
def voc_xml(objects: list[tuple], filename: str) -> str:
    """A VOC annotation; an object is (name, difficult or None for no tag, [part names])."""
    body = []
    for name, difficult, parts in objects:
        tag = "" if difficult is None else f"<difficult>{difficult}</difficult>"
        part_xml = "".join(f"<part><name>{p}</name><bndbox><xmin>1</xmin></bndbox></part>" for p in parts)
        body.append(
            f"<object><name>{name}</name><pose>Left</pose>{tag}<bndbox><xmin>1</xmin></bndbox>{part_xml}</object>"
        )
    return f"<annotation><folder>VOC</folder><filename>{filename}</filename>{''.join(body)}</annotation>"


# image id -> objects; the split each id belongs to is given per year below
VOC_OBJECTS = {
    "a1": [("dog", 0, []), ("person", 0, [])],
    "a2": [("car", 1, []), ("chair", 0, []), ("chair", 1, [])],
    "a3": [("person", 0, ["head", "hand", "foot"])],
    "b1": [("bird", None, [])],
    "b2": [("sofa", 1, []), ("sofa", 1, []), ("tvmonitor", 0, [])],
}
VOC_SPLITS = {2007: {"trainval": ["a1", "a2", "a3"], "test": ["b1", "b2"]},
              2012: {"train": ["a1", "a2", "a3"], "val": ["b1", "b2"]}}  # fmt: skip


def write_voc(root: Path, year: int = 2007) -> Path:
    """VOCdevkit/VOC{year}. First split: a1 dog+person; a2 car (difficult only) + chair (easy and difficult);
    a3 person with head/hand/foot parts. Second split: b1 bird (no difficult tag); b2 sofa (difficult only) +
    tvmonitor."""
    base = root / "VOCdevkit" / f"VOC{year}"
    ids = [i for split_ids in VOC_SPLITS[year].values() for i in split_ids]
    for image_id in ids:
        (base / "Annotations").mkdir(parents=True, exist_ok=True)
        (base / "Annotations" / f"{image_id}.xml").write_text(
            voc_xml(VOC_OBJECTS[image_id], f"{image_id}.jpg")
        )
        write_jpeg(base / "JPEGImages" / f"{image_id}.jpg")
    (base / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
    for split, split_ids in VOC_SPLITS[year].items():
        (base / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i}\n" for i in split_ids))
    return root


# --------------------------------------------------------------------------------------------- VISPR
VISPR_LISTS = {
    "train2017": {"2017_10001018": ["a0_safe"], "2017_10002000": ["a4_gender", "a17_color", "a16_race"]},
    "val2017": {"2017_20000001": ["a104_license_plate_partial"]},
    "test2017": {"2017_30000001": [], "2017_30000002": ["a9_face_complete", "a4_gender"]},
}


def write_vispr(root: Path) -> Path:
    """VISPR with the real attributes.tsv (68 classes); lists use CRLF line ends and a trailing blank line."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(VISPR_ATTRIBUTES, root / "attributes.tsv")
    for split, content in VISPR_LISTS.items():
        lines = []
        for image_id, labels in content.items():
            annotation = f"annotations/{split}/{image_id}.json"
            image_path = f"images/{split}/{image_id}.jpg"
            (root / annotation).parent.mkdir(parents=True, exist_ok=True)
            (root / annotation).write_text(
                json.dumps({"id": image_id, "image_path": image_path, "labels": labels})
            )
            write_jpeg(root / image_path)
            lines.append(annotation)
        (root / f"{split}.txt").write_bytes(("\r\n".join(lines) + "\r\n\r\n").encode())
    return root


# --------------------------------------------------------------------------------------------- WIDER
WIDER_NAMES = ["Male", "longHair", "sunglass", "hat", "tshirt", "longsleeve", "formal", "shorts", "jeans",
               "longPants", "skirt", "faceMask", "logo", "stripe"]  # fmt: skip


def wider_values(positive: list[int], negative: list[int]) -> list[int]:
    """14 WIDER attribute values: 1 at ``positive``, -1 at ``negative``, 0 (unspecified) elsewhere."""
    return [1 if i in positive else -1 if i in negative else 0 for i in range(14)]


def write_wider(root: Path) -> Path:
    """WIDER-Attribute. Images are 40x30, red left half, blue right half. attribute_id_map keys are written
    in string order ("0", "1", "10", ..., "2", ...).

    trainval: image A: box [22, 5, 30, 40] (crop 18x25, blue; +Male -hat), box [0, 0, 10, 10] (10x10, red;
    +longHair +tshirt -Male), box [5, 5, 0, 10] (zero width: dropped); image B: box [-4, -3, 14, 13]
    (10x10 at the origin; -stripe). test: image C: box [1, 1, 8, 8] (+skirt).
    """
    id_map = {str(i): name for i, name in sorted(enumerate(WIDER_NAMES), key=lambda t: str(t[0]))}
    a, b, c = (
        "train/0--Parade/0_Parade_a.jpg",
        "val/1--Handshaking/1_Handshaking_b.jpg",
        "test/2--Demo/2_Demo_c.jpg",
    )
    for name in (a, b, c):
        write_jpeg(root / "Image" / name, (40, 30), RED, BLUE)
    trainval = [
        {"file_name": a, "scene_id": 0, "targets": [
            {"bbox": [22, 5, 30, 40], "attribute": wider_values([0], [3])},
            {"bbox": [0, 0, 10, 10], "attribute": wider_values([1, 4], [0])},
            {"bbox": [5, 5, 0, 10], "attribute": wider_values([2], [])},
        ]},
        {"file_name": b, "scene_id": 1, "targets": [
            {"bbox": [-4, -3, 14, 13], "attribute": wider_values([], [13])},
        ]},
    ]  # fmt: skip
    test = [
        {
            "file_name": c,
            "scene_id": 2,
            "targets": [{"bbox": [1, 1, 8, 8], "attribute": wider_values([10], [])}],
        }
    ]
    (root / "Annotations").mkdir(parents=True, exist_ok=True)
    for split, images in (("trainval", trainval), ("test", test)):
        payload = {"images": images, "attribute_id_map": id_map, "scene_id_map": {"0": "Parade"}}
        (root / "Annotations" / f"wider_attribute_{split}.json").write_text(json.dumps(payload))
    return root


# ----------------------------------------------------------------------------------------------- VAW
VAW_INDEX = {
    "white": 2,
    "red": 0,
    "wooden": 1,
    "tall": 3,
    "striped": 4,
    "metal": 5,
}  # classes: red, wooden, ...


def vaw_instance(image_id, instance_id, box, positive, negative) -> dict:
    return {"image_id": image_id, "instance_id": instance_id, "instance_name": "thing", "instance_bbox": box,
            "instance_polygon": [[[0, 0], [1, 1]]], "object_name": "thing", "positive_attributes": positive,
            "negative_attributes": negative}  # fmt: skip


def write_vaw(root: Path) -> Path:
    """VAW with 6 attributes (index order red, wooden, white, tall, striped, metal). Images are 40x30, red
    left, blue right; 1001.jpg in VG_100K, 2002.jpg and 3003.jpg in VG_100K_2.

    train_part1: (1001, [22, 5, 30, 40], +white -red)  (1001, [0, 0, 10, 10], +red +tall, -tall -metal)
    train_part2: ("2002", [2, 2, 6, 4], +striped)
    val:         (2002, [0, 0, 40, 30], -wooden)
    test:        ("3003", [1, 1, 5, 5], +metal)  (3003, [3, 3, 5, 0], +red: zero height, dropped)
    """
    write_jpeg(root / "VG_100K" / "1001.jpg", (40, 30), RED, BLUE)
    write_jpeg(root / "VG_100K_2" / "2002.jpg", (40, 30), RED, BLUE)
    write_jpeg(root / "VG_100K_2" / "3003.jpg", (40, 30), RED, BLUE)
    files = {
        "train_part1": [vaw_instance(1001, 1, [22, 5, 30, 40], ["white"], ["red"]),
                        vaw_instance(1001, 2, [0, 0, 10, 10], ["red", "tall"], ["tall", "metal"])],
        "train_part2": [vaw_instance("2002", "3", [2, 2, 6, 4], ["striped"], [])],
        "val": [vaw_instance(2002, 4, [0, 0, 40, 30], [], ["wooden"])],
        "test": [vaw_instance("3003", 5, [1, 1, 5, 5], ["metal"], []),
                 vaw_instance(3003, 6, [3, 3, 5, 0], ["red"], [])],
    }  # fmt: skip
    (root / "data").mkdir(parents=True, exist_ok=True)
    for name, instances in files.items():
        (root / "data" / f"{name}.json").write_text(json.dumps(instances))
    (root / "data" / "attribute_index.json").write_text(json.dumps(VAW_INDEX))
    return root


# ------------------------------------------------------------------------------------------- NUS-WIDE
# The release's Concepts81.txt, in its order.
NUSWIDE_CONCEPTS = [
    "airport", "animal", "beach", "bear", "birds", "boats", "book", "bridge", "buildings", "cars",
    "castle", "cat", "cityscape", "clouds", "computer", "coral", "cow", "dancing", "dog", "earthquake",
    "elk", "fire", "fish", "flags", "flowers", "food", "fox", "frost", "garden", "glacier", "grass",
    "harbor", "horses", "house", "lake", "leaf", "map", "military", "moon", "mountain", "nighttime",
    "ocean", "person", "plane", "plants", "police", "protest", "railroad", "rainbow", "reflection", "road",
    "rocks", "running", "sand", "sign", "sky", "snow", "soccer", "sports", "statue", "street", "sun",
    "sunset", "surf", "swimmers", "tattoo", "temple", "tiger", "tower", "town", "toy", "train", "tree",
    "valley", "vehicle", "water", "waterfall", "wedding", "whales", "window", "zebra",
]  # fmt: skip
NUSWIDE_LISTS = {
    "Train": {
        "actor\\0001_2124494179.jpg": ["person", "sky"],
        "animal\\0002_38457.jpg": ["animal", "dog"],
        "beach\\0003_11.jpg": [],
        "zebra\\0004_5.jpg": ["zebra", "grass", "animal"],
    },
    "Test": {"sky\\0005_77.jpg": ["sky", "clouds"], "water\\0006_8.jpg": ["water"]},
}


def write_nuswide(root: Path) -> Path:
    """NUS-WIDE in the release's layout: all 81 concepts, CRLF line ends (the release's), Windows paths.

    Train (list order): actor/0001_2124494179.jpg +person +sky; animal/0002_38457.jpg +animal +dog;
    beach/0003_11.jpg no concept (dropped unless keep_empty); zebra/0004_5.jpg +zebra +grass +animal.
    Test: sky/0005_77.jpg +sky +clouds; water/0006_8.jpg +water. Images are 24x16 grey JPEGs under Flickr/.
    """
    (root / "ConceptsList").mkdir(parents=True, exist_ok=True)
    (root / "ConceptsList" / "Concepts81.txt").write_bytes(
        "".join(f"{c}\r\n" for c in NUSWIDE_CONCEPTS).encode()
    )
    (root / "ImageList").mkdir(parents=True, exist_ok=True)
    (root / "Groundtruth" / "TrainTestLabels").mkdir(parents=True, exist_ok=True)
    for part, images in NUSWIDE_LISTS.items():
        (root / "ImageList" / f"{part}Imagelist.txt").write_bytes(
            "".join(f"{i}\r\n" for i in images).encode()
        )
        for concept in NUSWIDE_CONCEPTS:
            column = "".join(f"{int(concept in positives)}\r\n" for positives in images.values())
            (root / "Groundtruth" / "TrainTestLabels" / f"Labels_{concept}_{part}.txt").write_bytes(
                column.encode()
            )
        for image in images:
            write_jpeg(root / "Flickr" / image.replace("\\", "/"))
    return root


# ----------------------------------------------------------------------------------------------- CSV
def write_csv(root: Path, text: str, name: str = "train.csv", images: list[str] | None = None) -> Path:
    """Write ``text`` to ``root / name`` and a JPEG for every image path in ``images``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
    for image in images or []:
        write_jpeg(root / image)
    return root


# ------------------------------------------------------------------------- JPEGs of the input pipelines
# (tests/test_data_fast.py, tests/test_data_dali.py, tests/test_data_loader.py)
RAMP_WIDTH, RAMP_HEIGHT = 512, 384


def write_photos(folder: Path, count: int) -> list[Path]:
    """``count`` 320x240 JPEGs of natural-looking content (:func:`mlcls.bench.pipeline_bench.make_jpegs`)."""
    return make_jpegs(folder, count, size=(320, 240))


def write_ramp(folder: Path) -> Path:
    """A 512x384 JPEG whose red channel encodes x and green channel y (255 at the far edge)."""
    y, x = np.mgrid[0:RAMP_HEIGHT, 0:RAMP_WIDTH]
    pixels = np.stack([x * 255 / (RAMP_WIDTH - 1), y * 255 / (RAMP_HEIGHT - 1), np.full(x.shape, 128.0)], -1)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ramp.jpg"
    Image.fromarray(pixels.round().astype(np.uint8)).save(path, quality=95)
    return path


def decode_rgb(path: Path) -> Image.Image:
    """PIL's full-size RGB decode of ``path``."""
    with Image.open(path) as img:
        return img.convert("RGB")


class PhotoFiles(MultiLabelDataset):
    """Image files as a 2-class dataset: sample k has the crop box (20, 10, 200, 150) when k is even, none
    when odd, and the label row [1, 0] when k is even, [0, 1] when odd."""

    def __init__(self, paths: list[Path], transform=None, on_bad_image: str = "error") -> None:
        super().__init__(transform, on_bad_image)
        self.classes = ["a", "b"]
        self.samples = [
            Sample(str(p), None if k % 2 else (20.0, 10.0, 200.0, 150.0)) for k, p in enumerate(paths)
        ]
        self.labels = torch.eye(2)[torch.arange(len(paths)) % 2]
