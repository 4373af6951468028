"""Shared by the inference tests (no tests here): one tiny trained run per session, image folders, references.

The trained run is made once per pytest process (module-level cache), whichever test module asks first.
From its ``last.pt`` two checkpoint variants are written with literal, hand-chosen contents:

* ``plain.pt`` -- without per-class ``thresholds`` (the half-probability fallback), its own ``preprocess``;
* ``calibrated.pt`` -- with per-class ``thresholds`` and a ``preprocess`` spec of the *paper* transform,
  which differs from the run's dataset config (``light``), so a test can tell which one predict used.

References are computed with timm and :mod:`mlcls.data.pipeline.transforms` directly, never with
mlcls.inference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from conftest import TINY_RESNET10T as TINY
from conftest import compose_config
from PIL import Image

from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.pipeline.transforms import build_transform

RUN_OVERRIDES = [
    *TINY,
    "trainer.epochs=1",
    "dataset.train_size=64",
    "dataset.val_size=32",
]
IMAGE_SIZE = 32
# The preprocess spec stored in calibrated.pt, written out literally: paper eval transform at 32 px.
PAPER_SPEC = {
    "transform": "paper",
    "image_size": 32,
    "resize": 37,
    "crop": 32,
    "interpolation": "bilinear",
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
}
_CACHE: dict[str, Path] = {}


def trained_run(factory: pytest.TempPathFactory) -> Path:
    """Directory of a one-epoch tiny run, trained on the first call of the session only, in a folder of the
    session's (a test's own ``tmp_path`` is removed when the test passes)."""
    if "run" not in _CACHE:
        from mlcls.cli.train import run

        run_dir = factory.mktemp("inference") / "run"
        run(compose_config([*RUN_OVERRIDES]), run_dir=run_dir)
        state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
        plain = {k: v for k, v in state.items() if k != "thresholds"}
        torch.save(plain, run_dir / "plain.pt")
        thresholds = torch.linspace(-1.5, 0.5, len(state["classes"]), dtype=torch.float64)
        torch.save({**plain, "preprocess": PAPER_SPEC, "thresholds": thresholds}, run_dir / "calibrated.pt")
        _CACHE["run"] = run_dir
    return _CACHE["run"]


def write_images(folder: Path, count: int = 7) -> list[Path]:
    """``count`` synthetic validation images as PNG/JPEG files (nested folder for every third), non-square
    for half of them so that resize and crop matter; returns their paths in sorted order."""
    dataset = SyntheticMultiLabel("val", val_size=count)
    paths = []
    for i in range(count):
        image = dataset.load_image(i)
        if i % 2:
            image = image.resize((60, 44))
        sub = folder / "nested" if i % 3 == 0 else folder
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"img_{i:02d}.{'png' if i % 2 else 'jpg'}"
        image.save(path)
        paths.append(path)
    return sorted(paths)


def reference_model(checkpoint: Path) -> tuple[torch.nn.Module, dict]:
    """The eager network of ``checkpoint`` built with timm directly, in eval mode, and the raw state."""
    state = torch.load(checkpoint, weights_only=False)
    model = timm.create_model(state["config"]["model"]["name"], num_classes=len(state["classes"]))
    model.load_state_dict(state["model"])
    return model.eval(), state


def reference_logits(checkpoint: Path, paths: list[Path], kind: str) -> torch.Tensor:
    """Logits of ``paths`` through :func:`mlcls.data.pipeline.transforms.build_transform` (``kind``, eval) and
    timm."""
    model, _ = reference_model(checkpoint)
    transform = build_transform(kind, IMAGE_SIZE, train=False)
    images = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    with torch.no_grad():
        return model(images)
