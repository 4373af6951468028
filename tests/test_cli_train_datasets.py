"""Every dataset trains one step through the ``mlcls-train`` config and trainer, from its official layout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from data_fixtures import write_coco, write_csv, write_nuswide, write_vaw, write_vispr, write_voc, write_wider
from hydra import compose, initialize_config_dir

from mlcls import config_dir


def csv_fixture(root: Path) -> Path:
    images = [f"img/{i}.jpg" for i in range(4)]
    text = "image,labels\n" + "".join(
        f"{name},{'cat dog' if i % 2 else 'dog'}\n" for i, name in enumerate(images)
    )
    return write_csv(root, text, images=images)


# dataset -> (fixture writer, training samples, validation samples, classes), as the fixtures define them
CASES: dict[str, tuple[Callable[[Path], Path], int, int, int]] = {
    "coco": (write_coco, 3, 1, 4),
    "voc2007": (lambda root: write_voc(root, 2007), 3, 2, 20),
    "voc2012": (lambda root: write_voc(root, 2012), 3, 2, 20),
    "vispr": (write_vispr, 3, 2, 68),
    "wider": (write_wider, 3, 1, 14),
    "vaw": (write_vaw, 4, 1, 6),
    "nuswide": (write_nuswide, 3, 2, 81),
    "csv": (csv_fixture, 2, 2, 2),  # val_fraction 0.25 (below) of 4 rows, and cat (2 positives) one in val
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_trains_one_step(name: str, tmp_path: Path) -> None:
    from mlcls.cli.train import run

    write, train_size, val_size, num_classes = CASES[name]
    root = write(tmp_path / "data")
    overrides = [
        f"dataset={name}",
        f"dataset.root={root}",
        "model.name=resnet10t",
        "model.pretrained=false",
        "dataset.image_size=32",
        "trainer.epochs=1",
        "trainer.batch_size=2",
        "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=1",
        "trainer.workers=0",
        "trainer.report=false",
    ]
    if name == "csv":
        overrides.append("dataset.val_fraction=0.25")
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    results = run(cfg, run_dir=tmp_path / "run")
    facts = json.loads((tmp_path / "run" / "results.json").read_text())["dataset"]
    assert facts == results["dataset"]
    assert facts == {
        "name": name,
        "num_classes": num_classes,
        "train_size": train_size,
        "val_size": min(val_size, 2),
    }
    assert results["epochs_completed"] == 1
