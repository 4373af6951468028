"""Embedded multi-label dataset, generated procedurally: no files, no download.

Each image shows 1-4 coloured shapes on a noisy background; a class is a (colour, shape) pair. As in real
data: 12 classes with frequencies proportional to ``1 / (c + 1)^0.7``; 1-4 labels per image (probabilities
0.35 / 0.30 / 0.20 / 0.15); with probability 0.6 a multi-label image also holds the partner ``(c + 5) mod 12``
of its first class. A function of ``seed``, split and index: labels drawn in ``__init__``, pixels in
``picture``, each drawn once and kept where the split's pixels fit in :data:`KEPT_BYTES` (an epoch after the
first, and each evaluation after the first, reads them back instead of drawing them again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from mlcls.data.datasets.base import MultiLabelDataset, Sample, check_choice, check_integer

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230)}
LABEL_COUNT_PROBS = (0.35, 0.30, 0.20, 0.15)
PARTNER_PROB = 0.6
_SPLIT_IDS = {"train": 0, "val": 1}
MAX_SIZE = 1_000_000  # images a split may have (their labels are drawn and held up front)
KEPT_BYTES = 256 * 2**20  # the pixels a split keeps once drawn: the default 2,000 + 500 pictures take 31 MB


class SyntheticMultiLabel(MultiLabelDataset):
    """Procedural shapes dataset: ``train_size`` / ``val_size`` images of ``canvas_size`` pixels a side."""

    reads_files = False  # the pixels are drawn (:meth:`picture`)

    def __init__(
        self,
        split: str = "train",
        transform: Callable | None = None,
        train_size: int = 2000,
        val_size: int = 500,
        canvas_size: int = 64,
        seed: int = 0,
        **config_keys: Any,
    ) -> None:
        for key, value, low, high in (
            ("train_size", train_size, 0, MAX_SIZE),
            ("val_size", val_size, 0, MAX_SIZE),
            ("canvas_size", canvas_size, 8, 4096),
            ("seed", seed, 0, 2**63 - 1),
        ):
            check_integer(key, value, low, high)
        super().__init__(transform, **config_keys)
        self.split = check_choice("synthetic split", split, tuple(_SPLIT_IDS))
        self.canvas_size = int(canvas_size)
        self.seed = int(seed)
        self.classes = [f"{colour}_{shape}" for shape in SHAPES for colour in COLOURS]
        size = train_size if split == "train" else val_size
        num_classes = len(self.classes)
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split]])
        weights = 1.0 / np.arange(1, num_classes + 1) ** 0.7
        labels = np.zeros((size, num_classes), dtype=np.float32)
        for row in labels:
            count = rng.choice(len(LABEL_COUNT_PROBS), p=LABEL_COUNT_PROBS) + 1
            first = rng.choice(num_classes, p=weights / weights.sum())
            row[first] = 1
            if count > 1 and rng.random() < PARTNER_PROB:
                row[(first + 5) % num_classes] = 1
            while row.sum() < count:
                free = weights * (row == 0)
                row[rng.choice(num_classes, p=free / free.sum())] = 1
        self.labels = labels
        self.samples = [Sample(path=f"synthetic://{split}/{i}") for i in range(size)]
        # index -> (its label row, its pixels), as bytes: a picture drawn for other labels is drawn again
        self._drawn: dict[int, tuple[bytes, bytes]] | None = (
            {} if size * self.canvas_size**2 * 3 <= KEPT_BYTES else None
        )

    def picture(self, index: int) -> Image.Image:
        """The index's picture: drawn on its first call, then (within :data:`KEPT_BYTES`) a copy of it."""
        size = self.canvas_size
        labels = self.labels[index].numpy()
        kept = self._drawn.get(index) if self._drawn is not None else None
        if kept is not None and kept[0] == labels.tobytes():
            return Image.frombytes("RGB", (size, size), kept[1])
        img = self._draw(index, labels)
        if self._drawn is not None:
            self._drawn[index] = (labels.tobytes(), img.tobytes())
        return img

    def _draw(self, index: int, labels: np.ndarray) -> Image.Image:
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], 1, index])
        size = self.canvas_size
        background = rng.integers(60, 140)
        pixels = background + rng.normal(0, 18, (size, size, 3))
        img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        colours = list(COLOURS.values())
        for cls in rng.permutation(np.flatnonzero(labels)):
            shape, colour = SHAPES[cls // len(COLOURS)], colours[cls % len(COLOURS)]
            colour = tuple(min(max(c + int(rng.integers(-25, 26)), 0), 255) for c in colour)
            side = rng.uniform(0.24, 0.38) * size
            x0, y0 = rng.uniform(0, size - side, 2)
            x1, y1, bar = x0 + side, y0 + side, side / 3
            if shape == "circle":
                draw.ellipse((x0, y0, x1, y1), fill=colour)
            elif shape == "square":
                draw.rectangle((x0, y0, x1, y1), fill=colour)
            elif shape == "triangle":
                draw.polygon(((x0 + side / 2, y0), (x1, y1), (x0, y1)), fill=colour)
            else:  # cross
                draw.rectangle((x0 + bar, y0, x1 - bar, y1), fill=colour)
                draw.rectangle((x0, y0 + bar, x1, y1 - bar), fill=colour)
        return img
